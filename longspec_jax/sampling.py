"""Token selection shared by plain and speculative decoding: greedy, temperature and top-p (nucleus).

Both decoders draw from exactly the distribution :func:`sampling_log_probs` defines, which is what makes
speculative sampling distribution-preserving.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


def sampling_log_probs(logits_xV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Log-probabilities (float32) of the sampling distribution: softmax(logits / T), restricted to the
    smallest set of most likely tokens whose mass reaches ``top_p`` and renormalised."""
    logp = jax.nn.log_softmax(logits_xV.astype(jnp.float32) / sampling.temperature, axis=-1)
    if sampling.top_p >= 1.0:
        return logp
    order = jnp.argsort(-logp, axis=-1)
    sorted_logp = jnp.take_along_axis(logp, order, axis=-1)
    mass_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
    keep_sorted = mass_before < sampling.top_p
    keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
    kept = jnp.where(keep, logp, -jnp.inf)
    return jax.nn.log_softmax(kept, axis=-1)


def select_tokens(logits_xV: jax.Array, key: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Argmax when greedy, else one draw per row from :func:`sampling_log_probs` (int32)."""
    if sampling.greedy:
        return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_log_probs(logits_xV, sampling), axis=-1).astype(jnp.int32)
