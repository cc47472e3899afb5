"""Plain autoregressive decoding: prefill, then one target forward per token inside one ``lax.while_loop``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from infer.decoding import DecodeSettings, Progress, StopCriteria, prefill_and_first_token
from longspec_jax.kv_cache import KVCache
from longspec_jax.sampling import select_tokens, split
from longspec_jax.target import forward, lm_head_logits


def decode_step(params, settings: DecodeSettings, cache: KVCache, last_B: jax.Array, key: jax.Array,
                active_B: jax.Array | None = None):
    """One target forward on each sequence's last token; returns the next token and the cache (not committed).
    A row not in ``active_B`` (default: all are) attends to none of its cache: its token is dropped."""
    B = last_B.shape[0]
    attended_B = None if active_B is None else jnp.where(active_B, cache.lengths, 0)
    hidden, cache = forward(params, settings.config, last_B[:, None], cache.lengths[:, None], cache,
                            jnp.ones((B, 1, 1), bool), impl=settings.impl, attended_B=attended_B)
    return select_tokens(lm_head_logits(params, hidden)[:, 0], key, settings.sampling), cache


def plain_loop(params, settings: DecodeSettings, stop: StopCriteria, progress: Progress, cache: KVCache,
                 last_B: jax.Array, key: jax.Array, on_tokens=None) -> Progress:
    """One target forward per token until every sequence is done. ``on_tokens(tokens_B, emitted_B)``, when
    given, is called on the host (ordered ``io_callback``) with each step's tokens and which rows emitted them;
    ``None`` (the default) adds no host callback to the loop."""

    def cond(carry):
        return ~jnp.all(carry[0].done)

    def body(carry):
        progress, cache, last, key = carry
        key, sub = split(key)
        active = ~progress.done
        token, cache = decode_step(params, settings, cache, last, sub, active)
        cache = cache.replace(lengths=cache.lengths + active.astype(jnp.int32))
        new_progress = progress.emit(token[:, None], jnp.ones_like(token), stop)
        if on_tokens is not None:
            io_callback(on_tokens, None, token, new_progress.num_generated > progress.num_generated, ordered=True)
        return new_progress, cache, jnp.where(active, token, last), key

    return jax.lax.while_loop(cond, body, (progress, cache, last_B, key))[0]


def plain_generate(params, settings: DecodeSettings, tokens_BxT, prompt_lengths_B, stop: StopCriteria,
                     key, on_tokens=None) -> Progress:
    first, cache, key = prefill_and_first_token(params, settings, tokens_BxT, prompt_lengths_B, key)
    progress = Progress.start(first, settings.out_len, stop)
    if on_tokens is not None:
        io_callback(on_tokens, None, first, jnp.ones(first.shape, bool), ordered=True)
    return plain_loop(params, settings, stop, progress, cache, first, key, on_tokens)
