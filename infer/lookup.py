"""Prompt-lookup decoding (n-gram speculative decoding) on the speculative verify path: the retrieval baseline.

Each round proposes the ``num_tokens`` tokens that followed the latest earlier occurrence of the sequence's last
n tokens in prompt + output (n from ``max_ngram`` down to ``min_ngram``, the first n that matches), as a chain
rooted at the last emitted token. The chain is verified by the same one-pass hybrid tree attention and accepted
by the same lossless walk as LongSpec's trees (:func:`infer.speculative.exact_acceptance`), so the output is the
target's own, greedy or sampled. Without a match, or where the continuation runs past the known tokens, the
chain holds token 0: verification rejects it and the round still emits the target's own next token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from infer.decoding import DecodeSettings, Progress, StopCriteria, prefill_and_first_token
from infer.speculative import VERIFY_NODE_MULTIPLE, tally_accepted, verify_and_commit
from longspec_jax.kv_cache import KVCache
from longspec_jax.tree import Tree, TreeSpec


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """``generate(..., draft=PromptLookup())``: n-gram lookup in prompt + output instead of a draft model."""

    num_tokens: int = 10  # chain length proposed per round
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PromptLookup.{name} must be a positive integer, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup.min_ngram ({self.min_ngram}) exceeds max_ngram ({self.max_ngram})")


@dataclasses.dataclass(frozen=True)
class LookupSettings:
    """Everything static about one compiled prompt-lookup generate call (a jit cache key)."""

    base: DecodeSettings
    tree: TreeSpec        # the chain (1,) * num_tokens
    lookup: PromptLookup
    history_len: int      # slots for prompt + output + one round's overshoot
    verify_node_multiple: int = VERIFY_NODE_MULTIPLE  # as SpecSettings' (infer.speculative.verify reads it)


@struct.dataclass
class LookupState:
    cache: KVCache
    history: jax.Array        # [B, H] int32: prompt + emitted tokens; the last one (the root) not yet in the cache
    length: jax.Array         # [B] int32: tokens in history
    progress: Progress
    accept_counts: jax.Array  # [B, A] int32: rounds that emitted j + 1 tokens
    key: jax.Array


def propose(history_BxH: jax.Array, length_B: jax.Array, lookup: PromptLookup) -> jax.Array:
    """``[B, num_tokens]``: the tokens after the latest earlier occurrence of the last n tokens (largest n that
    occurs), 0 where unknown."""
    B, H = history_BxH.shape
    k = lookup.num_tokens
    proposal_Bxk = jnp.zeros((B, k), jnp.int32)
    found_B = jnp.zeros((B,), bool)
    for n in range(lookup.max_ngram, lookup.min_ngram - 1, -1):
        if n >= H:
            continue
        suffix_Bxn = jnp.take_along_axis(history_BxH, jnp.maximum(length_B[:, None] - n + jnp.arange(n), 0), axis=1)
        starts = H - n + 1
        match_BxJ = jnp.ones((B, starts), bool)
        for i in range(n):
            match_BxJ &= history_BxH[:, i:i + starts] == suffix_Bxn[:, i:i + 1]
        # an earlier occurrence: it ends before the suffix starts being matched against itself
        match_BxJ &= jnp.arange(starts)[None] < (length_B - n)[:, None]
        has_B = jnp.any(match_BxJ, axis=1) & (length_B >= n)
        latest_B = jnp.max(jnp.where(match_BxJ, jnp.arange(starts)[None], -1), axis=1)
        index_Bxk = latest_B[:, None] + n + jnp.arange(k)[None]
        known_Bxk = index_Bxk < length_B[:, None]
        tokens_Bxk = jnp.where(known_Bxk, jnp.take_along_axis(history_BxH, jnp.minimum(index_Bxk, H - 1), axis=1), 0)
        take_B = has_B & ~found_B
        proposal_Bxk = jnp.where(take_B[:, None], tokens_Bxk, proposal_Bxk)
        found_B |= has_B
    return proposal_Bxk


def chain_tree(root_B: jax.Array, proposal_Bxk: jax.Array) -> Tree:
    """The chain root -> proposal[0] -> ... as a :class:`Tree` (no draft log-probs: exact acceptance needs none)."""
    B, k = proposal_Bxk.shape
    N = k + 1
    parents_N = jnp.maximum(jnp.arange(N) - 1, 0)
    return Tree(tokens=jnp.concatenate([root_B[:, None], proposal_Bxk], axis=1).astype(jnp.int32),
                parents=jnp.broadcast_to(parents_N, (B, N)).astype(jnp.int32),
                mask=jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool)), (B, N, N)),
                draft_logp=jnp.zeros((B, N, 1), jnp.float32))


def _append(history_BxH, length_B, tokens_BxA, count_B, active_B):
    """Writes each active row's ``count`` new tokens at its ``length``."""
    B, A = tokens_BxA.shape
    offsets = jnp.arange(A)[None]
    index_BxA = jnp.where(active_B[:, None] & (offsets < count_B[:, None]), length_B[:, None] + offsets,
                          history_BxH.shape[1])
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
    return (history_BxH.at[rows, index_BxA].set(tokens_BxA, mode="drop"),
            length_B + jnp.where(active_B, count_B, 0))


def lookup_round(settings: LookupSettings, target_params, stop: StopCriteria, state: LookupState) -> LookupState:
    key, verify_key = jax.random.split(state.key)
    root_B = jnp.take_along_axis(state.history, (state.length - 1)[:, None], axis=1)[:, 0]
    tree = chain_tree(root_B, propose(state.history, state.length, settings.lookup))
    active_B = ~state.progress.done
    accepted, cache = verify_and_commit(settings, target_params, state.cache, tree, verify_key, active_B)
    history, length = _append(state.history, state.length, accepted.tokens_BxA, accepted.count_B, active_B)
    return LookupState(cache=cache, history=history, length=length,
                       progress=state.progress.emit(accepted.tokens_BxA, accepted.count_B, stop),
                       accept_counts=tally_accepted(state.accept_counts, accepted.count_B, active_B), key=key)


def lookup_generate(settings: LookupSettings, target_params, tokens_BxT, prompt_lengths_B, stop: StopCriteria,
                    key) -> LookupState:
    """Prefill, then lookup rounds until every sequence is done."""
    first_B, cache, key = prefill_and_first_token(target_params, settings.base, tokens_BxT, prompt_lengths_B, key)
    B, T = tokens_BxT.shape
    history = jnp.zeros((B, settings.history_len), jnp.int32).at[:, :T].set(tokens_BxT)
    history = history.at[jnp.arange(B), prompt_lengths_B].set(first_B)
    A = settings.tree.max_accept
    state = LookupState(cache=cache, history=history, length=prompt_lengths_B + 1,
                        progress=Progress.start(first_B, settings.base.out_len, stop),
                        accept_counts=jnp.zeros((B, A), jnp.int32), key=key)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.progress.done),
                              functools.partial(lookup_round, settings, target_params, stop), state)
