"""LongSpec tree speculative decoding: prefill, then rounds of (draft step 0, beam-search tree, verify with
hybrid tree attention, accept, commit) inside one ``lax.while_loop`` (docs/architecture.md, "One speculative round").

The draft's runtime lives in :mod:`longspec_jax.draft`, the tree build and the acceptance walk in
:mod:`longspec_jax.tree`, the commit in :mod:`longspec_jax.kv_cache`; this module composes them into a round
and the loop. Bookkeeping: see :mod:`longspec_jax.draft`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from infer.decoding import DecodeSettings, Progress, StopCriteria, prefill_and_first_token
from longspec_jax.draft import DraftSettings, DraftWeights, draft_prefill, draft_root
from longspec_jax.kv_cache import KVCache, RingCache, TreeKV, commit
from longspec_jax.multidraft import multidraft_acceptance
from longspec_jax.sampling import select_tokens, split
from longspec_jax.target import forward_tree, lm_head_logits
from longspec_jax.tree import RANK_SLOTS, Acceptance, DraftSample, Tree, TreeSpec, accept, build_tree, rank_outcomes

# XLA options the speculative loop is compiled with (by generate(), reproducible or not, and by the benchmarks):
# inside a command buffer, kernels that do not depend on each other may run at the same time, where XLA's default
# runs them one after another in its schedule's order. At 16k on the padded 8B pair a round is 4.1% faster (6.9%
# with generate's reproducible options), while a plain step is 2.5% slower, so plain decoding keeps the default.
# It changes how kernels are launched, not the kernels, so not the output.
SPECULATIVE_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def exact_acceptance(tree: Tree, target_logits_BxNxV, key, settings: "SpecSettings") -> Acceptance:
    """The target's own choice after every node (argmax, or an independent draw from its sampling distribution
    at T > 0), then the walk of :func:`longspec_jax.tree.accept`: lossless for any deterministic tree."""
    choices_BxN = select_tokens(target_logits_BxNxV, key, settings.base.sampling)
    return accept(tree.tokens, tree.parents, tree.mask, choices_BxN, settings.tree)


def sampled_tree_acceptance(tree: Tree, target_logits_BxNxV, key, settings: "SpecSettings") -> Acceptance:
    """Recursive rejection sampling down a tree sampled from the draft
    (:func:`longspec_jax.multidraft.multidraft_acceptance`): lossless for any draft."""
    return multidraft_acceptance(tree, target_logits_BxNxV, key, settings.tree, settings.base.sampling,
                                 settings.draft_sampling)


# Verification runs the tree padded to a multiple of this many nodes (:func:`pad_tree_nodes`): XLA pads the rows of
# every cuBLAS GEMM to a multiple of 8 and slices them off again, in every layer; padding the tree once makes a round
# 1.7-5.3% faster end to end on the H200 (oracle rounds on the 8B-cost pair at 16k, docs/results.md).
VERIFY_NODE_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Everything static about one compiled speculative generate call (a jit cache key). ``draft_sampling``: the
    kind of tree sampled from the draft at the sampling temperature (:class:`longspec_jax.tree.DraftSample`;
    ``tree.branching`` is its topology), verified by :func:`sampled_tree_acceptance`; ``None``: the children are
    deterministic top-k beams."""

    base: DecodeSettings
    tree: TreeSpec
    draft: DraftSettings
    acceptance: Callable = exact_acceptance  # (tree, target_logits, key, settings) -> Acceptance
    draft_sampling: str | None = None
    verify_node_multiple: int = VERIFY_NODE_MULTIPLE  # 1: verify the tree as it is

    def __post_init__(self):
        if self.verify_node_multiple < 1:
            raise ValueError(f"verify_node_multiple must be >= 1, got {self.verify_node_multiple}")


@struct.dataclass
class SpecState:
    cache: KVCache
    ring: RingCache
    pending: jax.Array        # [B, A] int32: last round's emitted tokens, the root last
    num_pending: jax.Array    # [B] int32
    progress: Progress
    accept_counts: jax.Array  # [B, A] int32: rounds that emitted j + 1 tokens
    rank_tried: jax.Array     # [D, RANK_SLOTS] int32: children tried at each depth, by sibling rank (rank_outcomes)
    rank_accepted: jax.Array  # [D, RANK_SLOTS] int32: children accepted
    key: jax.Array


def pad_tree_nodes(tokens_BxN, depths_N, mask_BxNxN, multiple: int):
    """The tree's tokens, depths and mask with padding nodes appended up to a multiple of ``multiple`` nodes:
    token 0 at depth 0, each seeing only itself, seen by no real node (so no real node's output changes)."""
    N = tokens_BxN.shape[1]
    P = -N % multiple
    if not P:
        return tokens_BxN, depths_N, mask_BxNxN
    tokens_BxM = jnp.pad(tokens_BxN, ((0, 0), (0, P)))
    depths_M = jnp.pad(depths_N, (0, P))
    mask_BxMxM = jnp.pad(mask_BxNxN, ((0, 0), (0, P), (0, P))).at[:, N:, N:].set(jnp.eye(P, dtype=bool))
    return tokens_BxM, depths_M, mask_BxMxM


def verify(settings: SpecSettings, target_params, cache: KVCache, tree: Tree) -> tuple[jax.Array, TreeKV]:
    """One target forward over the whole tree with hybrid tree attention; returns the target's float32 logits
    after every node ``[B, N, V]`` and the tree's K/V (the cache is not written: :func:`commit` writes the
    accepted path). The pass runs on the tree padded to ``settings.verify_node_multiple`` nodes."""
    N = tree.tokens.shape[1]
    tokens_BxM, depths_M, mask_BxMxM = pad_tree_nodes(tree.tokens, jnp.asarray(settings.tree.node_depths),
                                                      tree.mask, settings.verify_node_multiple)
    positions_BxM = cache.lengths[:, None] + depths_M[None]
    hidden_BxMxd, tree_kv = forward_tree(target_params, settings.base.config, tokens_BxM, positions_BxM, cache,
                                         mask_BxMxM, impl=settings.base.impl)
    if tokens_BxM.shape[1] > N:
        tree_kv = TreeKV(k=tuple(k[:, :N] for k in tree_kv.k), v=tuple(v[:, :N] for v in tree_kv.v))
    return lm_head_logits(target_params, hidden_BxMxd)[:, :N], tree_kv


def verify_and_commit(settings, target_params, cache: KVCache, tree: Tree, key, active_B,
                      acceptance: Callable = exact_acceptance) -> tuple[Acceptance, KVCache]:
    """Verifies the tree, accepts (``acceptance(tree, logits, key, settings)``), and commits the accepted path
    of the active rows. A finished row's tree attends to none of its cache: its result is dropped, and the cache
    half's kernels read a row's cache only up to its length, so a static batch's finished rows cost no cache
    reads while its last rows finish."""
    attended = cache.replace(lengths=jnp.where(active_B, cache.lengths, 0))
    target_logits_BxNxV, tree_kv = verify(settings, target_params, attended, tree)
    accepted = acceptance(tree, target_logits_BxNxV, key, settings)
    return accepted, commit(cache, tree_kv, accepted.path_BxA, accepted.count_B, active_B)


def tally_accepted(accept_counts_BxA: jax.Array, count_B: jax.Array, active_B: jax.Array) -> jax.Array:
    """Adds one to each active row's count of rounds that emitted ``count`` tokens."""
    A = accept_counts_BxA.shape[1]
    return accept_counts_BxA + jax.nn.one_hot(count_B - 1, A, dtype=jnp.int32) * active_B[:, None]


def spec_round(settings: SpecSettings, target_params, weights: DraftWeights, stop: StopCriteria,
               state: SpecState) -> SpecState:
    key, verify_key = split(state.key)
    sample = None
    if settings.draft_sampling:
        verify_key, draft_key = split(verify_key)
        sample = DraftSample(draft_key, settings.base.sampling, settings.draft_sampling)
    logp_root_BxV, ring = draft_root(settings.draft, weights, target_params, state.cache, state.ring,
                                     state.pending, state.num_pending)
    root_B = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]
    tree = build_tree(settings.tree, settings.draft, weights, target_params, state.cache, ring, root_B,
                      logp_root_BxV, sample)
    active_B = ~state.progress.done
    accepted, cache = verify_and_commit(settings, target_params, state.cache, tree, verify_key, active_B,
                                        settings.acceptance)
    progress = state.progress.emit(accepted.tokens_BxA, accepted.count_B, stop)
    tried_BxDxR, accepted_BxDxR = rank_outcomes(tree.parents, accepted.path_BxA, accepted.count_B, settings.tree.depth)
    active_Bx1x1 = active_B[:, None, None]
    width = state.pending.shape[1]  # the tree's max_accept, or more where one buffer serves several trees
    tokens_BxP = jnp.pad(accepted.tokens_BxA, ((0, 0), (0, width - accepted.tokens_BxA.shape[1])))
    return SpecState(cache=cache, ring=ring,
                     pending=jnp.where(active_B[:, None], tokens_BxP, state.pending),
                     num_pending=jnp.where(active_B, accepted.count_B, state.num_pending),
                     progress=progress, accept_counts=tally_accepted(state.accept_counts, accepted.count_B, active_B),
                     rank_tried=state.rank_tried + jnp.sum(tried_BxDxR * active_Bx1x1, axis=0),
                     rank_accepted=state.rank_accepted + jnp.sum(accepted_BxDxR * active_Bx1x1, axis=0), key=key)


def speculative_start(settings: SpecSettings, target_params, weights: DraftWeights, tokens_BxT, prompt_lengths_B,
                      stop: StopCriteria, key) -> SpecState:
    """Target prefill (first token) and draft prefill (ring cache): the state before the first round."""
    first_B, cache, key = prefill_and_first_token(target_params, settings.base, tokens_BxT, prompt_lengths_B, key)
    ring = draft_prefill(settings.draft, weights, target_params, tokens_BxT, prompt_lengths_B)
    B, A = first_B.shape[0], settings.tree.max_accept
    return SpecState(cache=cache, ring=ring, pending=jnp.zeros((B, A), jnp.int32).at[:, 0].set(first_B),
                     num_pending=jnp.ones((B,), jnp.int32),
                     progress=Progress.start(first_B, settings.base.out_len, stop),
                     accept_counts=jnp.zeros((B, A), jnp.int32),
                     rank_tried=jnp.zeros((settings.tree.depth, RANK_SLOTS), jnp.int32),
                     rank_accepted=jnp.zeros((settings.tree.depth, RANK_SLOTS), jnp.int32), key=key)


def speculative_loop(settings: SpecSettings, target_params, weights: DraftWeights, stop: StopCriteria,
                     state: SpecState) -> SpecState:
    """Rounds until every sequence is done."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.progress.done),
                              functools.partial(spec_round, settings, target_params, weights, stop), state)


def speculative_generate(settings: SpecSettings, target_params, weights: DraftWeights, tokens_BxT, prompt_lengths_B,
                         stop: StopCriteria, key) -> SpecState:
    state = speculative_start(settings, target_params, weights, tokens_BxT, prompt_lengths_B, stop, key)
    return speculative_loop(settings, target_params, weights, stop, state)
