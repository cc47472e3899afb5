"""What plain and speculative decoding share: the static settings of a compiled call, the traced stop rules,
the output buffer carried through the loop, and the prefill both loops start from."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.config import TargetConfig
from longspec_jax.kv_cache import init_cache
from longspec_jax.sampling import SamplingConfig, select_tokens, split
from longspec_jax.target import prefill
from pallas.sizes import next_pow2


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Everything static about one compiled generate call (a jit cache key)."""

    config: TargetConfig
    sampling: SamplingConfig
    capacity: int          # KV cache slots per sequence
    prefill_chunk: int
    out_len: int           # output buffer length (>= max_new_tokens, bucketed)
    prompt_len: int        # padded prompt length (a multiple of prefill_chunk)
    impl: str = "auto"


@struct.dataclass
class StopCriteria:
    """Traced stopping rules, so changing them does not recompile: the same for every row, or per row."""

    max_new: jax.Array   # int32 scalar, or [B]: most tokens per sequence
    eos_ids: jax.Array   # int32 [E], or [B, E]; -1 entries never match

    @classmethod
    def make(cls, max_new_tokens: int, eos_ids) -> "StopCriteria":
        ids = list(eos_ids)
        width = next_pow2(len(ids))
        return cls(max_new=jnp.int32(max_new_tokens), eos_ids=jnp.asarray(ids + [-1] * (width - len(ids)), jnp.int32))

    def is_eos(self, tokens: jax.Array) -> jax.Array:
        """Which of ``tokens`` (``[B]`` or ``[B, A]``) stop their row."""
        eos = self.eos_ids
        if eos.ndim == 2:
            eos = eos.reshape(eos.shape[:1] + (1,) * (tokens.ndim - 1) + eos.shape[1:])
        return jnp.any(tokens[..., None] == eos, axis=-1)


@struct.dataclass
class Progress:
    """Per-sequence output buffer and counters carried through the decode loop."""

    tokens: jax.Array         # [B, out_len] int32, -1 where nothing was emitted
    num_generated: jax.Array  # [B] int32
    num_rounds: jax.Array     # [B] int32: target forward passes after prefill
    done: jax.Array           # [B] bool

    @classmethod
    def start(cls, first_B: jax.Array, out_len: int, stop: StopCriteria) -> "Progress":
        B = first_B.shape[0]
        tokens = jnp.full((B, out_len), -1, jnp.int32).at[:, 0].set(first_B)
        ones = jnp.ones((B,), jnp.int32)
        done = stop.is_eos(first_B) | (stop.max_new <= 1)
        return cls(tokens=tokens, num_generated=ones, num_rounds=jnp.zeros((B,), jnp.int32), done=done)

    def emit(self, new_BxA: jax.Array, count_B: jax.Array, stop: StopCriteria) -> "Progress":
        """Appends the first ``count[b]`` of ``new[b]`` to unfinished rows, stopping at EOS / ``max_new``."""
        B, A = new_BxA.shape
        active = ~self.done
        offsets = jnp.arange(A)[None, :]
        eos_BxA = stop.is_eos(new_BxA) & (offsets < count_B[:, None])
        first_eos = jnp.where(jnp.any(eos_BxA, axis=1), jnp.argmax(eos_BxA, axis=1) + 1, A + 1)
        room = stop.max_new - self.num_generated
        take = jnp.where(active, jnp.minimum(jnp.minimum(count_B, first_eos), room), 0)
        index = self.num_generated[:, None] + offsets
        keep = offsets < take[:, None]
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
        tokens = self.tokens.at[rows, jnp.where(keep, index, self.tokens.shape[1])].set(new_BxA, mode="drop")
        num_generated = self.num_generated + take
        done = self.done | (active & ((first_eos <= take) | (num_generated >= stop.max_new)))
        return Progress(tokens=tokens, num_generated=num_generated,
                        num_rounds=self.num_rounds + active.astype(jnp.int32), done=done)


def prefill_and_first_token(params, settings: DecodeSettings, tokens_BxT, prompt_lengths_B, key):
    """Allocates the cache inside the jit (so it is updated in place), prefills, picks the first token."""
    config = settings.config
    B = tokens_BxT.shape[0]
    cache = init_cache(config.num_layers, B, settings.capacity, config.num_kv_heads, config.head_dim,
                       params["embed"].dtype)
    logits, cache = prefill(params, config, tokens_BxT, prompt_lengths_B, cache,
                            chunk=settings.prefill_chunk, impl=settings.impl)
    key, sub = split(key)
    return select_tokens(logits, sub, settings.sampling), cache, key
