"""Static token-tree shapes, dynamic beam-search expansion, the tree build of a speculative round, and the
lossless acceptance walk (reference.md 2.3, 2.6; architecture.md section 5).

Node 0 is the root (the last accepted token); level k holds ``tree_shape[k-1]`` nodes at indices
``[offsets[k-1], offsets[k])``. Parents always have smaller indices than their children, so indices grow with
depth, and every (parent, token) pair is unique, so siblings carry distinct tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longspec_jax.draft import DraftSettings, DraftWeights, draft_log_probs, draft_self_kv
from longspec_jax.kv_cache import KVCache, RingCache
from longspec_jax.top_k import top_k

MAX_TREE_NODES = 512


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Static description of a tree shape such as ``(4, 16, 16, 16, 16)``."""

    shape: tuple[int, ...]

    @classmethod
    def parse(cls, tree_shape, vocab_size: int) -> "TreeSpec":
        try:
            shape = tuple(tree_shape)
        except TypeError:
            raise ValueError(f"tree_shape must be a sequence of positive ints, got {tree_shape!r}") from None
        if not shape or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c > 0
                                for c in shape):
            raise ValueError(f"tree_shape must be a non-empty sequence of positive ints, got {tree_shape!r}")
        shape = tuple(int(c) for c in shape)
        if shape[0] > vocab_size:
            raise ValueError(f"tree_shape[0] = {shape[0]} exceeds the vocabulary size {vocab_size}")
        for k in range(1, len(shape)):
            if shape[k] > shape[k - 1] * vocab_size:
                raise ValueError(f"tree_shape[{k}] = {shape[k]} exceeds the {shape[k - 1]} x {vocab_size} "
                                 f"candidates of the level above")
        spec = cls(shape)
        if spec.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree_shape {shape} has {spec.num_nodes} nodes; at most {MAX_TREE_NODES} allowed")
        return spec

    @property
    def depth(self) -> int:
        return len(self.shape)

    @property
    def num_nodes(self) -> int:
        return 1 + sum(self.shape)

    @property
    def max_accept(self) -> int:
        """Most tokens one round can emit: a full root-to-leaf path plus the bonus token."""
        return self.depth + 1

    @property
    def offsets(self) -> tuple[int, ...]:
        """``(1, 1 + c1, 1 + c1 + c2, ...)``: level k occupies ``[offsets[k-1], offsets[k])``."""
        return tuple(int(x) for x in np.cumsum((1,) + self.shape))

    def level(self, k: int) -> slice:
        return slice(self.offsets[k - 1], self.offsets[k])

    @property
    def node_depths(self) -> np.ndarray:
        return np.concatenate([[0]] + [np.full(c, k + 1) for k, c in enumerate(self.shape)]).astype(np.int32)


def expand_level(scores_BxP: jax.Array, logp_BxPxV: jax.Array, width: int):
    """Dynamic beam search step: the global top-``width`` of ``score(parent) + logp(parent, token)`` over all
    parents and tokens. Returns local parent indices, tokens and scores, each ``[B, width]``, best first.

    Computed as a per-parent top-``width`` (staged over the vocabulary, :mod:`longspec_jax.top_k`) followed by a
    top-``width`` over those candidates, which selects the same set as one top-k over ``P * V`` values.
    """
    B, P, V = logp_BxPxV.shape
    per_parent = min(width, V)
    cand_scores, cand_tokens = top_k(scores_BxP[:, :, None] + logp_BxPxV, per_parent)
    best_scores, flat = jax.lax.top_k(cand_scores.reshape(B, P * per_parent), width)
    parents = (flat // per_parent).astype(jnp.int32)
    tokens = jnp.take_along_axis(cand_tokens.reshape(B, P * per_parent), flat, axis=1).astype(jnp.int32)
    return parents, tokens, best_scores


def add_level_to_mask(mask_BxNxN: jax.Array, parents_BxW: jax.Array, start: int) -> jax.Array:
    """Rows ``[start, start + W)`` of the ancestor mask become their parent's row plus the diagonal."""
    B, N, _ = mask_BxNxN.shape
    W = parents_BxW.shape[1]
    parent_rows = jnp.take_along_axis(mask_BxNxN, parents_BxW[:, :, None], axis=1)
    own = jax.nn.one_hot(start + jnp.arange(W), N, dtype=bool)[None]
    return jax.lax.dynamic_update_slice_in_dim(mask_BxNxN, parent_rows | own, start, axis=1)


@struct.dataclass
class Tree:
    tokens: jax.Array      # [B, N] int32, node 0 = root
    parents: jax.Array     # [B, N] int32 (root: 0)
    mask: jax.Array        # [B, N, N] bool ancestor-or-self
    draft_logp: jax.Array  # [B, N, V] float32 draft log-probs after each node (0 for the last level, never run)


@struct.dataclass
class TreeBuilder:
    """A tree during beam search: the nodes so far, their cumulative draft log-probs, and the draft's
    self-attention K/V of the nodes it has run on (nodes 1..N-1; the root is in the ring)."""

    tree: Tree
    scores: jax.Array  # [B, N] float32
    tree_k: jax.Array  # [B, N - 1, K, D]
    tree_v: jax.Array


def _add_level(spec: TreeSpec, builder: TreeBuilder, level: int, parents_local_BxW, tokens_BxW, scores_BxW,
               parent_start: int) -> TreeBuilder:
    nodes = spec.level(level)
    parents_BxW = parent_start + parents_local_BxW
    t = builder.tree
    tree = t.replace(tokens=t.tokens.at[:, nodes].set(tokens_BxW), parents=t.parents.at[:, nodes].set(parents_BxW),
                     mask=add_level_to_mask(t.mask, parents_BxW, nodes.start))
    return builder.replace(tree=tree, scores=builder.scores.at[:, nodes].set(scores_BxW))


def proposal_log_probs(logp_BxPxV: jax.Array, sample, level: int) -> jax.Array:
    """What beam search ranks a level's children by: the draft's log-probs, or with ``sample = (key, T)`` their
    tempered, Gumbel-perturbed version, whose top-1 per parent is a draw from softmax(logp / T) (Gumbel-max)."""
    if sample is None:
        return logp_BxPxV
    key, temperature = sample
    noise = jax.random.gumbel(jax.random.fold_in(key, level), logp_BxPxV.shape, jnp.float32)
    return logp_BxPxV / temperature + noise


def start_tree(spec: TreeSpec, ds: DraftSettings, root_B, logp_root_BxV, sample=None) -> TreeBuilder:
    """The root and level 1: the draft's top-c1 tokens after the root (``sample``: see
    :func:`proposal_log_probs`)."""
    c = ds.config
    B, N = root_B.shape[0], spec.num_nodes
    tree = Tree(tokens=jnp.zeros((B, N), jnp.int32).at[:, 0].set(root_B), parents=jnp.zeros((B, N), jnp.int32),
                mask=jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N)),
                draft_logp=jnp.zeros((B, N, logp_root_BxV.shape[-1]), jnp.float32).at[:, 0].set(logp_root_BxV))
    tree_k = jnp.zeros((B, N - 1, c.num_kv_heads, c.head_dim), ds.dtype)
    builder = TreeBuilder(tree=tree, scores=jnp.zeros((B, N), jnp.float32), tree_k=tree_k,
                          tree_v=jnp.zeros_like(tree_k))
    first = expand_level(jnp.zeros((B, 1), jnp.float32), proposal_log_probs(logp_root_BxV[:, None], sample, 0),
                         spec.shape[0])
    return _add_level(spec, builder, 1, *first, parent_start=0)


def grow_tree(spec: TreeSpec, ds: DraftSettings, weights: DraftWeights, target_params, cache: KVCache,
              ring: RingCache, builder: TreeBuilder, level: int, sample=None) -> TreeBuilder:
    """Runs the draft on tree level ``level`` (all its nodes at once) and adds level ``level + 1``: the global
    top-c of (cumulative log-prob + child log-prob) over all children of the level (``sample``: see
    :func:`proposal_log_probs`)."""
    nodes = spec.level(level)
    tokens_BxW = builder.tree.tokens[:, nodes]
    positions_BxW = jnp.broadcast_to(cache.lengths[:, None] + level, tokens_BxW.shape)
    k, v = draft_self_kv(ds, weights, target_params, tokens_BxW, positions_BxW)
    builder = builder.replace(tree_k=builder.tree_k.at[:, nodes.start - 1:nodes.stop - 1].set(k),
                              tree_v=builder.tree_v.at[:, nodes.start - 1:nodes.stop - 1].set(v))
    logp_BxWxV = draft_log_probs(ds, weights, target_params, cache, ring, tokens_BxW, positions_BxW, builder.tree_k,
                                 builder.tree_v, builder.tree.mask[:, nodes, 1:])
    builder = builder.replace(tree=builder.tree.replace(
        draft_logp=builder.tree.draft_logp.at[:, nodes].set(logp_BxWxV)))
    children = expand_level(builder.scores[:, nodes], proposal_log_probs(logp_BxWxV, sample, level),
                            spec.shape[level])
    return _add_level(spec, builder, level + 1, *children, parent_start=nodes.start)


def build_tree(spec: TreeSpec, ds: DraftSettings, weights: DraftWeights, target_params, cache: KVCache,
               ring: RingCache, root_B, logp_root_BxV, sample=None) -> Tree:
    """Dynamic beam search over ``spec.shape``; the draft runs once per level 1..depth-1. With ``sample = (key,
    T)`` a chain's tokens are draws from the draft's softmax(logp / T) (:func:`proposal_log_probs`)."""
    builder = start_tree(spec, ds, root_B, logp_root_BxV, sample)
    for level in range(1, spec.depth):
        builder = grow_tree(spec, ds, weights, target_params, cache, ring, builder, level, sample)
    return builder.tree


@struct.dataclass
class Acceptance:
    path_BxA: jax.Array    # node indices of the accepted path by depth (root first); padded with the last node
    count_B: jax.Array     # tokens emitted this round = accepted nodes (root included) = depth(last) + 1
    tokens_BxA: jax.Array  # emitted tokens: the target's choice after each path node (last one = bonus)


def accept(tree_tokens_BxN: jax.Array, parents_BxN: jax.Array, mask_BxNxN: jax.Array, choices_BxN: jax.Array,
           spec: TreeSpec) -> Acceptance:
    """Walks from the root, moving to the child whose token equals the target's choice at the current node.

    ``choices[n]`` is the target's token after node n: its argmax (greedy) or an independent draw from its
    sampling distribution (T > 0). Each emitted token is then exactly the target's own choice given its
    prefix, so the output distribution is the target's (architecture.md section 5).
    """
    B, N = tree_tokens_BxN.shape
    parent_choice = jnp.take_along_axis(choices_BxN, jnp.maximum(parents_BxN, 0), axis=1)
    verified = (tree_tokens_BxN == parent_choice).at[:, 0].set(True)
    mask = mask_BxNxN.astype(jnp.int32)
    on_path = jnp.einsum("bij,bj->bi", mask, verified.astype(jnp.int32)) == jnp.sum(mask, axis=-1)
    last = jnp.max(jnp.where(on_path, jnp.arange(N)[None], 0), axis=1)
    depths = jnp.asarray(spec.node_depths)
    count = depths[last] + 1
    last_row = jnp.take_along_axis(mask_BxNxN, last[:, None, None], axis=1)[:, 0]  # ancestors of last
    by_depth = last_row[:, None, :] & (depths[None, None, :] == jnp.arange(spec.max_accept)[None, :, None])
    path = jnp.where(jnp.any(by_depth, axis=-1), jnp.argmax(by_depth, axis=-1), last[:, None]).astype(jnp.int32)
    return Acceptance(path_BxA=path, count_B=count.astype(jnp.int32),
                      tokens_BxA=jnp.take_along_axis(choices_BxN, path, axis=1))
