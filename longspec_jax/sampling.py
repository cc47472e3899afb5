"""Token selection shared by plain and speculative decoding: greedy, temperature and top-p (nucleus).

Both decoders draw from exactly the distribution :func:`sampling_log_probs` defines, which is what makes
speculative sampling distribution-preserving.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

# Temperatures below this are greedy, as in vLLM. At T = 1e-5 a draw differs from the argmax only where the top
# two logits are within ~1e-4, and much smaller T breaks the float32 log-softmax of logits / T (inf / NaN: at
# T = 1e-30 both decoders emitted token 0 forever); logits up to ~1e4 in magnitude are safe at T = 1e-5.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling mode. A temperature below :data:`MIN_TEMPERATURE` (0 included) is greedy and is stored
    as 0, so that all greedy configs are equal (one compiled program); top-p is applied only when ``top_p < 1``."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@struct.dataclass
class RowSampling:
    """Sampling that differs between the rows of a batch, as traced arrays (one compiled program serves any mix):
    ``temperature [B]`` (below :data:`MIN_TEMPERATURE`: that row is greedy) and ``top_p [B]``. A greedy row's
    sampling distribution is the point mass on its argmax, so every sampler here picks the argmax for it.
    ``use_top_p`` (static) compiles the top-p filter in; without it ``top_p`` is ignored."""

    temperature: jax.Array
    top_p: jax.Array
    use_top_p: bool = struct.field(pytree_node=False, default=True)

    greedy = False  # not greedy as a whole: rows choose

    @classmethod
    def make(cls, temperatures, top_ps, use_top_p: bool | None = None) -> "RowSampling":
        temperature_B = jnp.asarray(temperatures, jnp.float32)
        top_p_B = jnp.asarray(top_ps, jnp.float32)
        temperature_B = jnp.where(temperature_B < MIN_TEMPERATURE, 0.0, temperature_B)
        if use_top_p is None:
            use_top_p = bool(jnp.any(top_p_B < 1.0))
        return cls(temperature=temperature_B, top_p=top_p_B, use_top_p=use_top_p)


def _rows(x_B: jax.Array, ndim: int) -> jax.Array:
    return x_B.reshape(x_B.shape + (1,) * (ndim - 1))


def greedy_rows(sampling, ndim: int):
    """Which rows are greedy, broadcastable against an ``ndim`` array whose first axis is the batch (a Python bool
    for a :class:`SamplingConfig`)."""
    if isinstance(sampling, RowSampling):
        return _rows(sampling.temperature == 0, ndim)
    return sampling.greedy


def tempered(logits_BxV: jax.Array, sampling) -> jax.Array:
    """``logits / T`` in float32, per row for a :class:`RowSampling` (its greedy rows divided by 1)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if isinstance(sampling, RowSampling):
        temperature = _rows(sampling.temperature, logits_BxV.ndim)
        return logits_BxV / jnp.where(temperature == 0, 1.0, temperature)
    return logits_BxV / sampling.temperature


def sampling_log_probs(logits_xV: jax.Array, sampling) -> jax.Array:
    """Log-probabilities (float32) of the sampling distribution: softmax(logits / T), restricted to the
    smallest set of most likely tokens whose mass reaches ``top_p`` and renormalised (per row for a
    :class:`RowSampling`, whose greedy rows get the point mass on their argmax)."""
    logp = jax.nn.log_softmax(tempered(logits_xV, sampling), axis=-1)
    per_row = isinstance(sampling, RowSampling)
    if per_row and sampling.use_top_p:
        top_p = _rows(sampling.top_p, logp.ndim)
    elif not per_row and sampling.top_p < 1.0:
        top_p = sampling.top_p
    else:
        top_p = None
    if top_p is not None:
        order = jnp.argsort(-logp, axis=-1)
        sorted_logp = jnp.take_along_axis(logp, order, axis=-1)
        mass_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
        keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        logp = jax.nn.log_softmax(jnp.where(keep, logp, -jnp.inf), axis=-1)
    if per_row:
        argmax = jax.nn.one_hot(jnp.argmax(logits_xV, axis=-1), logp.shape[-1], dtype=bool)
        logp = jnp.where(greedy_rows(sampling, logp.ndim), jnp.where(argmax, 0.0, -jnp.inf), logp)
    return logp


def select_tokens(logits_xV: jax.Array, key: jax.Array, sampling) -> jax.Array:
    """Argmax when greedy, else one draw per row from :func:`sampling_log_probs` (int32); ``key`` may be one key
    per row (:func:`row_keys`)."""
    if sampling.greedy:
        return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)
    return categorical(key, sampling_log_probs(logits_xV, sampling)).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------ random streams
# Every random draw goes through these, which take one key (the whole batch draws from it) or one key per row
# ``[B, 2]`` (each row draws from its own stream, so a row's draws do not depend on the other rows).


def row_keys(seeds_B) -> jax.Array:
    """One key per row from integer seeds ``[B]``."""
    return jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds_B, jnp.uint32))


def _per_row(key: jax.Array) -> bool:
    return key.ndim == 2


def split(key: jax.Array, num: int = 2) -> tuple[jax.Array, ...]:
    if _per_row(key):
        return tuple(jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(key), 1, 0))
    return tuple(jax.random.split(key, num))


def fold_in(key: jax.Array, data: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(key) if _per_row(key) else jax.random.fold_in(key, data)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform [0, 1) floats of ``shape`` (its first axis the batch)."""
    if _per_row(key):
        return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)
    return jax.random.uniform(key, shape)


def gumbel(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Standard Gumbel float32 noise of ``shape`` (its first axis the batch)."""
    if _per_row(key):
        return jax.vmap(lambda k: jax.random.gumbel(k, shape[1:], jnp.float32))(key)
    return jax.random.gumbel(key, shape, jnp.float32)


def categorical(key: jax.Array, logits_BxV: jax.Array) -> jax.Array:
    """One draw over the last axis of ``logits`` per leading index."""
    if _per_row(key):
        return jax.vmap(lambda k, lg: jax.random.categorical(k, lg, axis=-1))(key, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1)
