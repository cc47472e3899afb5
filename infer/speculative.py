"""LongSpec tree speculative decoding: prefill, then rounds of (draft step 0, beam-search tree, verify with
hybrid tree attention, accept, commit) inside one ``lax.while_loop`` (architecture.md section 3).

Bookkeeping per sequence (all positions equal cache slots):
  * ``cache.lengths`` = tokens committed in every target layer; the root (last emitted token) sits at that
    position and is not in the target cache yet.
  * ``pending`` = the tokens emitted last round (the root last), not yet in the draft's ring cache; they
    occupy positions ``lengths - num_pending + 1 ... lengths``.
  * The draft's ring cache holds self-attention K/V of the committed positions before them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from infer.vanilla import DecodeSettings, Progress, StopCriteria, prefill_and_first_token
from longspec_jax.attention import cache_attention, windowed_ring_attention
from longspec_jax.draft import Draft, DraftConfig, DraftLayer
from longspec_jax.kv_cache import KVCache, RingCache, write_rows
from longspec_jax.sampling import select_tokens
from longspec_jax.target import embed_tokens, forward, lm_head_logits
from longspec_jax.tree import Acceptance, TreeSpec, accept, add_level_to_mask, expand_level


@struct.dataclass
class Tree:
    tokens: jax.Array     # [B, N] int32, node 0 = root
    parents: jax.Array    # [B, N] int32 (root: 0)
    mask: jax.Array       # [B, N, N] bool ancestor-or-self
    draft_logp: jax.Array  # [B, N, V] float32 draft log-probs after each node (0 for the last level, never run)


def exact_acceptance(tree: Tree, target_logits_BxNxV, key, settings: "SpecSettings") -> Acceptance:
    """The target's own choice after every node (argmax, or an independent draw from its sampling distribution
    at T > 0), then the walk of :func:`longspec_jax.tree.accept`: lossless for any deterministic tree."""
    choices = select_tokens(target_logits_BxNxV, key, settings.base.sampling)
    return accept(tree.tokens, tree.parents, tree.mask, choices, settings.tree)


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    base: DecodeSettings
    tree: TreeSpec
    draft_config: DraftConfig
    draft_dtype: type
    logits_hook: Callable | None = None
    acceptance: Callable = exact_acceptance  # (tree, target_logits, key, settings) -> Acceptance

    @property
    def module(self) -> DraftLayer:
        return DraftLayer(self.draft_config, self.draft_dtype)


@struct.dataclass
class DraftWeights:
    """The draft's traced inputs: Flax variables and the optional logits-hook data."""

    variables: dict
    hook_data: Any = None


@struct.dataclass
class SpecState:
    cache: KVCache
    ring: RingCache
    pending: jax.Array       # [B, A] int32
    num_pending: jax.Array   # [B] int32
    progress: Progress
    accept_counts: jax.Array  # [B, A] int32: rounds that emitted j + 1 tokens
    key: jax.Array


def draft_log_probs(settings: SpecSettings, draft_vars, target_params, cache: KVCache, ring: RingCache,
                    tokens_BxT, positions_BxT, new_k, new_v, new_mask_BxTxN):
    """Draft log-softmax (float32) for tokens at ``positions``: windowed self-attention over the ring plus
    ``new_k/new_v`` under ``new_mask``; cross-attention to the target's last layer, slots ``[0, lengths)``."""
    impl = settings.base.impl
    window = settings.draft_config.window

    def attend_self(q):
        return windowed_ring_attention(q, positions_BxT, ring.k, ring.v, ring.pos, window, new_k, new_v,
                                       new_mask_BxTxN, impl=impl)[0]

    def attend_cross(q):
        return cache_attention(q, cache.k[-1], cache.v[-1], cache.lengths, impl=impl)[0]

    x = embed_tokens(target_params, tokens_BxT).astype(settings.draft_dtype)
    y = settings.module.apply(draft_vars.variables, x, positions_BxT, attend_self, attend_cross)
    logits = lm_head_logits(target_params, y.astype(target_params["embed"].dtype))
    if settings.logits_hook is not None:
        logits = settings.logits_hook(logits, positions_BxT, draft_vars.hook_data)
    return jax.nn.log_softmax(logits, axis=-1)


def draft_self_kv(settings: SpecSettings, draft_vars, target_params, tokens_BxT, positions_BxT):
    x = embed_tokens(target_params, tokens_BxT).astype(settings.draft_dtype)
    return settings.module.apply(draft_vars.variables, x, positions_BxT, method=DraftLayer.self_kv)


def draft_prefill(settings: SpecSettings, draft_vars, target_params, tokens_BxT, prompt_lengths_B) -> RingCache:
    """Fills the ring with the self-attention K/V of each prompt's last ``ring_capacity`` positions (the draft's
    other prefill outputs are never used)."""
    B, T = tokens_BxT.shape
    c = settings.draft_config
    span = min(c.ring_capacity, T)
    positions = prompt_lengths_B[:, None] - span + jnp.arange(span)[None]
    valid = positions >= 0
    safe = jnp.maximum(positions, 0)
    k, v = draft_self_kv(settings, draft_vars, target_params, jnp.take_along_axis(tokens_BxT, safe, 1), safe)
    ring = RingCache.empty(B, c.ring_capacity, c.num_kv_heads, c.head_dim, settings.draft_dtype)
    return ring.write(k, v, positions, valid)


def draft_root(settings: SpecSettings, draft_vars, target_params, state: SpecState):
    """Step 0: stores the pending tokens' K/V in the ring and returns the draft's distribution after the root
    ``[B, V]``. Only the root's full layer output is needed; the other pending tokens contribute K/V only."""
    A = settings.tree.max_accept
    root_pos = state.cache.lengths
    offsets = jnp.arange(A)[None]
    positions = root_pos[:, None] - state.num_pending[:, None] + 1 + offsets
    valid = offsets < state.num_pending[:, None]
    k, v = draft_self_kv(settings, draft_vars, target_params, state.pending, positions)
    root = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)
    logp = draft_log_probs(settings, draft_vars, target_params, state.cache, state.ring, root, root_pos[:, None],
                           k, v, valid[:, None, :])
    return logp[:, 0], state.ring.write(k, v, positions, valid)


@struct.dataclass
class TreeBuilder:
    """A tree during beam search: the nodes so far, their cumulative draft log-probs, and the draft's
    self-attention K/V of the nodes it has run on (nodes 1..N-1; the root is in the ring)."""

    tree: Tree
    scores: jax.Array  # [B, N] float32
    tree_k: jax.Array  # [B, N - 1, K, D]
    tree_v: jax.Array


def _add_level(spec: TreeSpec, builder: TreeBuilder, k: int, parents_local, tokens, scores,
               parent_start: int) -> TreeBuilder:
    lvl = spec.level(k)
    parents = parent_start + parents_local
    t = builder.tree
    tree = t.replace(tokens=t.tokens.at[:, lvl].set(tokens), parents=t.parents.at[:, lvl].set(parents),
                     mask=add_level_to_mask(t.mask, parents, lvl.start))
    return builder.replace(tree=tree, scores=builder.scores.at[:, lvl].set(scores))


def start_tree(settings: SpecSettings, root_B, logp_root_BxV) -> TreeBuilder:
    """The root and level 1: the draft's top-c1 tokens after the root."""
    spec, c = settings.tree, settings.draft_config
    B, N = root_B.shape[0], spec.num_nodes
    tree = Tree(tokens=jnp.zeros((B, N), jnp.int32).at[:, 0].set(root_B), parents=jnp.zeros((B, N), jnp.int32),
                mask=jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N)),
                draft_logp=jnp.zeros((B, N, logp_root_BxV.shape[-1]), jnp.float32).at[:, 0].set(logp_root_BxV))
    tree_k = jnp.zeros((B, N - 1, c.num_kv_heads, c.head_dim), settings.draft_dtype)
    builder = TreeBuilder(tree=tree, scores=jnp.zeros((B, N), jnp.float32), tree_k=tree_k,
                          tree_v=jnp.zeros_like(tree_k))
    level = expand_level(jnp.zeros((B, 1), jnp.float32), logp_root_BxV[:, None], spec.shape[0])
    return _add_level(spec, builder, 1, *level, parent_start=0)


def grow_tree(settings: SpecSettings, draft_vars, target_params, cache: KVCache, ring: RingCache,
              builder: TreeBuilder, k: int) -> TreeBuilder:
    """Runs the draft on level k (all its nodes at once) and adds level k+1: the global top-c_{k+1} of
    (cumulative log-prob + child log-prob) over all children of level k."""
    spec = settings.tree
    lvl = spec.level(k)
    tokens = builder.tree.tokens[:, lvl]
    positions = jnp.broadcast_to(cache.lengths[:, None] + k, tokens.shape)
    kk, vv = draft_self_kv(settings, draft_vars, target_params, tokens, positions)
    builder = builder.replace(tree_k=builder.tree_k.at[:, lvl.start - 1:lvl.stop - 1].set(kk),
                              tree_v=builder.tree_v.at[:, lvl.start - 1:lvl.stop - 1].set(vv))
    logp = draft_log_probs(settings, draft_vars, target_params, cache, ring, tokens, positions, builder.tree_k,
                           builder.tree_v, builder.tree.mask[:, lvl, 1:])
    builder = builder.replace(tree=builder.tree.replace(draft_logp=builder.tree.draft_logp.at[:, lvl].set(logp)))
    level = expand_level(builder.scores[:, lvl], logp, spec.shape[k])
    return _add_level(spec, builder, k + 1, *level, parent_start=lvl.start)


def build_tree(settings: SpecSettings, draft_vars, target_params, cache: KVCache, ring: RingCache,
               root_B, logp_root_BxV) -> Tree:
    """Dynamic beam search over ``settings.tree.shape``; the draft runs once per level 1..G-1."""
    builder = start_tree(settings, root_B, logp_root_BxV)
    for k in range(1, settings.tree.depth):
        builder = grow_tree(settings, draft_vars, target_params, cache, ring, builder, k)
    return builder.tree


def verify(settings: SpecSettings, target_params, cache: KVCache, tree: Tree):
    """One target forward over the whole tree with hybrid tree attention; returns the target's float32 logits
    after every node ``[B, N, V]`` and the cache with the tree's K/V written at slots ``lengths + node index``."""
    depths = jnp.asarray(settings.tree.node_depths)
    positions = cache.lengths[:, None] + depths[None]
    hidden, cache = forward(target_params, settings.base.config, tree.tokens, positions, cache, tree.mask,
                            impl=settings.base.impl)
    return lm_head_logits(target_params, hidden), cache


def compact_path(buffer_BxSxKxD, path_BxA, root_B):
    """Copies the rows at slots ``root + path[j]`` to slots ``root + j`` (accepted nodes made consecutive)."""
    src = (root_B[:, None] + path_BxA)[:, :, None, None]
    return write_rows(buffer_BxSxKxD, jnp.take_along_axis(buffer_BxSxKxD, src, axis=1), root_B)


def commit(cache: KVCache, path_BxA, count_B, active_B) -> KVCache:
    """Moves the accepted nodes' K/V (every layer) from their tree slots to consecutive slots after the root's,
    and commits the root and the accepted nodes for active sequences."""
    root = cache.lengths
    return cache.replace(k=tuple(compact_path(b, path_BxA, root) for b in cache.k),
                         v=tuple(compact_path(b, path_BxA, root) for b in cache.v),
                         lengths=jnp.where(active_B, root + count_B, root))


def spec_round(settings: SpecSettings, target_params, draft_vars, stop: StopCriteria, state: SpecState) -> SpecState:
    key, verify_key = jax.random.split(state.key)
    logp_root, ring = draft_root(settings, draft_vars, target_params, state)
    root = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]
    tree = build_tree(settings, draft_vars, target_params, state.cache, ring, root, logp_root)
    target_logits, cache = verify(settings, target_params, state.cache, tree)
    accepted = settings.acceptance(tree, target_logits, verify_key, settings)
    active = ~state.progress.done
    cache = commit(cache, accepted.path_BxA, accepted.count_B, active)
    progress = state.progress.emit(accepted.tokens_BxA, accepted.count_B, stop)
    A = settings.tree.max_accept
    counted = jax.nn.one_hot(accepted.count_B - 1, A, dtype=jnp.int32) * active[:, None]
    return SpecState(cache=cache, ring=ring,
                     pending=jnp.where(active[:, None], accepted.tokens_BxA, state.pending),
                     num_pending=jnp.where(active, accepted.count_B, state.num_pending),
                     progress=progress, accept_counts=state.accept_counts + counted, key=key)


def speculative_start(settings: SpecSettings, target_params, draft_vars, tokens_BxT, prompt_lengths_B,
                      stop: StopCriteria, key) -> SpecState:
    """Target prefill (first token) and draft prefill (ring cache): the state before the first round."""
    first, cache, key = prefill_and_first_token(target_params, settings.base, tokens_BxT, prompt_lengths_B, key)
    ring = draft_prefill(settings, draft_vars, target_params, tokens_BxT, prompt_lengths_B)
    B, A = first.shape[0], settings.tree.max_accept
    return SpecState(cache=cache, ring=ring, pending=jnp.zeros((B, A), jnp.int32).at[:, 0].set(first),
                     num_pending=jnp.ones((B,), jnp.int32),
                     progress=Progress.start(first, settings.base.out_len, stop),
                     accept_counts=jnp.zeros((B, A), jnp.int32), key=key)


def speculative_loop(settings: SpecSettings, target_params, draft_vars, stop: StopCriteria,
                     state: SpecState) -> SpecState:
    """Rounds until every sequence is done."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.progress.done),
                              functools.partial(spec_round, settings, target_params, draft_vars, stop), state)


def speculative_generate(settings: SpecSettings, target_params, draft_vars, tokens_BxT, prompt_lengths_B,
                         stop: StopCriteria, key) -> SpecState:
    state = speculative_start(settings, target_params, draft_vars, tokens_BxT, prompt_lengths_B, stop, key)
    return speculative_loop(settings, target_params, draft_vars, stop, state)


@functools.partial(jax.jit, static_argnames=("settings",))
def _speculative_jit(target_params, draft_vars, tokens, lengths, stop, key, settings):
    return speculative_generate(settings, target_params, draft_vars, tokens, lengths, stop, key)


def plan_speculative(target, draft: Draft, longest_prompt: int, max_new_tokens: int, sampling, tree_shape,
                     prefill_chunk: int, impl: str) -> SpecSettings:
    """Checks that the draft fits the target and plans the static shapes of one speculative generate call."""
    from infer.generate import plan_shapes

    if not isinstance(draft, Draft):
        raise ValueError(f"draft must be a longspec_jax Draft (see load_draft), got {type(draft).__name__}")
    config = target.config
    dc = draft.config
    if (dc.hidden_size, dc.num_heads, dc.num_kv_heads, dc.head_dim) != (
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim):
        raise ValueError(f"draft (hidden {dc.hidden_size}, heads {dc.num_heads}/{dc.num_kv_heads}, head_dim "
                         f"{dc.head_dim}) does not match the target (hidden {config.hidden_size}, heads "
                         f"{config.num_heads}/{config.num_kv_heads}, head_dim {config.head_dim})")
    spec = TreeSpec.parse(tree_shape, config.vocab_size)
    padded, chunk, out_len, capacity = plan_shapes(longest_prompt, max_new_tokens,
                                                   spec.num_nodes + spec.max_accept, prefill_chunk)
    base = DecodeSettings(config=config, sampling=sampling, capacity=capacity, prefill_chunk=chunk,
                          out_len=out_len, prompt_len=padded, impl=impl)
    return SpecSettings(base=base, tree=spec, draft_config=dc, draft_dtype=np.dtype(draft.param_dtype).type,
                        logits_hook=draft.logits_hook)


def run_speculative(settings: SpecSettings, target, draft: Draft, prompts, max_new_tokens: int, stop, seed: int):
    """Runs the compiled speculative loop and converts its state to a ``GenerateOutput``."""
    from infer.generate import pad_prompts, to_output

    tokens, lengths = pad_prompts(prompts, settings.base.prompt_len)
    draft_vars = DraftWeights(variables=draft.variables, hook_data=draft.hook_data)
    state = _speculative_jit(target.params, draft_vars, tokens, lengths, stop, jax.random.PRNGKey(seed),
                             settings=settings)
    out = to_output(state.progress, max_new_tokens)
    out.accept_counts = np.asarray(state.accept_counts)
    return out
