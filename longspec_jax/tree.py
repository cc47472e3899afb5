"""Token-tree shapes (level widths, and static topologies for sampled trees), the tree build of a speculative
round (dynamic beam search, or children sampled from the draft), and the lossless acceptance walk for
deterministic trees.

Node 0 is the root (the last accepted token); level k holds ``tree_shape[k-1]`` nodes at indices
``[offsets[k-1], offsets[k])``. Parents always have smaller indices than their children, so indices grow with
depth, and every (parent, token) pair is unique, so siblings carry distinct tokens.

The draft's log-probs (``V`` here) span what it proposes from: the target's vocabulary, or a draft vocabulary's K
ids (:mod:`longspec_jax.draft_vocab`), in which case the build ranks and samples over those K columns and maps
the chosen columns to target ids (``ids_V``) before they become tree tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longspec_jax.draft import DraftSettings, DraftWeights, draft_log_probs, draft_self_kv
from longspec_jax.kv_cache import KVCache, RingCache
from longspec_jax.sampling import fold_in, greedy_rows, gumbel, tempered
from longspec_jax.top_k import top_k

MAX_TREE_NODES = 512

SAMPLING_KINDS = ("without_replacement", "top_plus_one")


def check_sampling_kind(kind: str) -> None:
    if kind not in SAMPLING_KINDS:
        raise ValueError(f"unknown draft sampling kind {kind!r}; choose from {', '.join(SAMPLING_KINDS)}")


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Static description of a tree shape such as ``(4, 16, 16, 16, 16)``: level widths, filled by beam search
    (dynamic: which node has how many children depends on the round), or, with ``branching``, a static
    topology: ``branching[k][j]`` children for the j-th node of level k (level 0 = the root), in node order, so
    level k + 1 lists the children of level k's first node first, each node's children by rank."""

    shape: tuple[int, ...]
    branching: tuple[tuple[int, ...], ...] | None = None

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

    def with_branching(self, branching) -> "TreeSpec":
        """This shape with a static topology (``branching``, see the class); raises ``ValueError`` where it does
        not fit the level widths."""
        branching = tuple(tuple(int(c) for c in level) for level in branching)
        if len(branching) != self.depth:
            raise ValueError(f"branching has {len(branching)} levels, tree_shape {self.shape} has {self.depth}")
        for k, counts in enumerate(branching):
            parents = 1 if k == 0 else self.shape[k - 1]
            if len(counts) != parents or sum(counts) != self.shape[k] or min(counts) < 0:
                raise ValueError(f"branching[{k}] = {counts} must give {parents} node(s) non-negative child counts "
                                 f"summing to tree_shape[{k}] = {self.shape[k]}")
        return dataclasses.replace(self, branching=branching)

    @functools.cached_property
    def static_parents(self) -> np.ndarray:
        """``[N]`` parent of every node of a static topology (root: 0)."""
        return np.concatenate([[0]] + [np.repeat(np.arange(self.offsets[k - 1] if k else 0,
                                                           self.offsets[k] if k else 1), counts)
                                       for k, counts in enumerate(self.branching)]).astype(np.int32)

    @functools.cached_property
    def sibling_ranks(self) -> np.ndarray:
        """``[N]`` rank of every node among its siblings of a static topology (0 = first child; root: 0)."""
        return np.concatenate([[0]] + [np.concatenate([np.arange(c) for c in counts]) for counts in
                                       self.branching]).astype(np.int32)

    @functools.cached_property
    def children_table(self) -> np.ndarray:
        """``[N, K]`` children of every node of a static topology by rank, ``-1`` past the last; K = the most
        children of any node."""
        K = max(max(counts) for counts in self.branching)
        table = np.full((self.num_nodes, K), -1, np.int32)
        table[self.static_parents[1:], self.sibling_ranks[1:]] = np.arange(1, self.num_nodes)
        return table

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
    draft_ids: jax.Array | None = None  # [V] int32 target id of each draft_logp column; None: column = target id


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


def sample_children(logp_BxWxV: jax.Array, counts: tuple[int, ...], key: jax.Array, sampling,
                    kind: str) -> tuple[np.ndarray, jax.Array]:
    """Children of a level's W nodes, ``counts[j]`` for node j, drawn from the draft's tempered distribution q =
    softmax(logp / T) at the ``sampling`` temperature (per row for a
    :class:`~longspec_jax.sampling.RowSampling`, whose greedy rows take their top tokens): without replacement (the
    top k of logp / T plus Gumbel noise are, in order, k successive draws without replacement), or
    ``top_plus_one``: the node's k - 1 most likely tokens, then one draw from q without them. Returns the next
    level's parents (static local indices ``[W']``, node order) and tokens ``[B, W']``, each node's children in
    rank order."""
    check_sampling_kind(kind)
    K = max(counts)
    parents_Wn = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    ranks_Wn = np.concatenate([np.arange(c) for c in counts]).astype(np.int32)
    noise_BxWxV = jnp.where(greedy_rows(sampling, 3), 0.0, gumbel(key, logp_BxWxV.shape))
    perturbed_BxWxV = tempered(logp_BxWxV, sampling) + noise_BxWxV
    if kind == "without_replacement" or K == 1:
        _, tokens_BxWxK = top_k(perturbed_BxWxV, K)
        return parents_Wn, tokens_BxWxK[:, parents_Wn, ranks_Wn].astype(jnp.int32)
    _, top_BxWxJ = top_k(logp_BxWxV, K - 1)
    excluded_WxJ = np.arange(K - 1)[None] < np.asarray(counts)[:, None] - 1  # node j's top counts[j] - 1 tokens
    B, W, _ = logp_BxWxV.shape
    rows_B11, nodes_1W1 = jnp.arange(B)[:, None, None], jnp.arange(W)[None, :, None]
    perturbed_BxWxV = perturbed_BxWxV.at[rows_B11, nodes_1W1, top_BxWxJ].min(
        jnp.where(excluded_WxJ, -jnp.inf, jnp.inf)[None])
    drawn_BxW = jnp.argmax(perturbed_BxWxV, axis=-1)
    candidates_BxWxK = jnp.concatenate([top_BxWxJ, drawn_BxW[..., None]], axis=-1)
    slot_Wn = np.where(ranks_Wn == np.asarray(counts)[parents_Wn] - 1, K - 1, ranks_Wn)
    return parents_Wn, candidates_BxWxK[:, parents_Wn, slot_Wn].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DraftSample:
    """How a sampled tree draws its children (:func:`sample_children`): the round's key (or one per row), the
    sampling (a :class:`~longspec_jax.sampling.SamplingConfig` or per-row
    :class:`~longspec_jax.sampling.RowSampling`), and the kind (``without_replacement`` or ``top_plus_one``)."""

    key: jax.Array
    sampling: object
    kind: str = "without_replacement"


def next_level(spec: TreeSpec, level: int, scores_BxW: jax.Array, logp_BxWxV: jax.Array,
               sample: DraftSample | None, ids_V: jax.Array | None = None):
    """Level ``level + 1`` from level ``level``'s cumulative scores and draft log-probs: beam search (the global
    top-c of cumulative log-prob + child log-prob), or with ``sample`` the children of ``spec.branching`` drawn
    from the draft. Returns local parent indices, target tokens (column j is token ``ids_V[j]`` where given) and
    cumulative draft log-probs, each ``[B, width]``."""
    if sample is None:
        parents_BxWn, columns_BxWn, scores_BxWn = expand_level(scores_BxW, logp_BxWxV, spec.shape[level])
    else:
        parents_Wn, columns_BxWn = sample_children(logp_BxWxV, spec.branching[level],
                                                   fold_in(sample.key, level), sample.sampling,
                                                   sample.kind)
        logp_BxWn = jnp.take_along_axis(logp_BxWxV[:, parents_Wn], columns_BxWn[..., None], axis=-1)[..., 0]
        parents_BxWn = jnp.broadcast_to(parents_Wn, columns_BxWn.shape)
        scores_BxWn = scores_BxW[:, parents_Wn] + logp_BxWn
    return parents_BxWn, columns_BxWn if ids_V is None else ids_V[columns_BxWn], scores_BxWn


def start_tree(spec: TreeSpec, ds: DraftSettings, root_B, logp_root_BxV, sample=None,
               ids_V: jax.Array | None = None) -> TreeBuilder:
    """The root and level 1 (:func:`next_level` of the root); ``ids_V``: the draft vocabulary's ids, if any."""
    c = ds.config
    B, N = root_B.shape[0], spec.num_nodes
    tree = Tree(tokens=jnp.zeros((B, N), jnp.int32).at[:, 0].set(root_B), parents=jnp.zeros((B, N), jnp.int32),
                mask=jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N)),
                draft_logp=jnp.zeros((B, N, logp_root_BxV.shape[-1]), jnp.float32).at[:, 0].set(logp_root_BxV),
                draft_ids=ids_V)
    tree_k = jnp.zeros((B, N - 1, c.num_kv_heads, c.head_dim), ds.dtype)
    builder = TreeBuilder(tree=tree, scores=jnp.zeros((B, N), jnp.float32), tree_k=tree_k,
                          tree_v=jnp.zeros_like(tree_k))
    first = next_level(spec, 0, jnp.zeros((B, 1), jnp.float32), logp_root_BxV[:, None], sample, ids_V)
    return _add_level(spec, builder, 1, *first, parent_start=0)


def grow_tree(spec: TreeSpec, ds: DraftSettings, weights: DraftWeights, target_params, cache: KVCache,
              ring: RingCache, builder: TreeBuilder, level: int, sample=None) -> TreeBuilder:
    """Runs the draft on tree level ``level`` (all its nodes at once) and adds level ``level + 1``
    (:func:`next_level`)."""
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
    children = next_level(spec, level, builder.scores[:, nodes], logp_BxWxV, sample, builder.tree.draft_ids)
    return _add_level(spec, builder, level + 1, *children, parent_start=nodes.start)


def build_tree(spec: TreeSpec, ds: DraftSettings, weights: DraftWeights, target_params, cache: KVCache,
               ring: RingCache, root_B, logp_root_BxV, sample: DraftSample | None = None) -> Tree:
    """The round's tree over ``spec.shape``: beam search, or with ``sample`` a tree of ``spec.branching`` sampled
    from the draft; the draft runs once per level 1..depth-1."""
    if sample is not None and spec.branching is None:
        raise ValueError(f"a sampled tree needs a static topology (TreeSpec.branching); tree_shape {spec.shape}")
    ids_V = None if weights.vocab is None else weights.vocab.ids
    builder = start_tree(spec, ds, root_B, logp_root_BxV, sample, ids_V)
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
    prefix, so the output distribution is the target's (docs/architecture.md, "Acceptance that is exact").
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


RANK_SLOTS = 8  # sibling ranks told apart by rank_outcomes; the last slot pools it and every later rank


def rank_outcomes(parents_BxN: jax.Array, path_BxA: jax.Array, count_B: jax.Array,
                  depth: int) -> tuple[jax.Array, jax.Array]:
    """What verification did at each depth of the accepted path, by sibling rank (children in node order):
    ``tried[b, d, r]``: the node visited at depth d had a rank-r child and no lower-ranked child was accepted;
    ``accepted[b, d, r]``: its rank-r child was accepted. Both ``[B, depth, RANK_SLOTS]`` int32. Their ratio
    per (depth, rank) is the conditional acceptance rate that speculation profiles are made of."""
    B, N = parents_BxN.shape
    is_child_BxN = jnp.arange(N)[None] > 0
    same_parent_BxNxN = (parents_BxN[:, :, None] == parents_BxN[:, None, :]) & is_child_BxN[:, None, :]
    rank_BxN = jnp.sum(same_parent_BxNxN & (jnp.arange(N)[None, :] < jnp.arange(N)[:, None])[None], axis=-1)
    num_children_BxN = jnp.sum((parents_BxN[:, None, :] == jnp.arange(N)[None, :, None]) & is_child_BxN[:, None, :],
                               axis=-1)
    d_D = jnp.arange(depth)
    visited_BxD = d_D[None] < count_B[:, None]
    node_BxD = path_BxA[:, :depth]
    has_next_BxD = d_D[None] + 1 < count_B[:, None]
    next_rank_BxD = jnp.take_along_axis(rank_BxN, path_BxA[:, 1:depth + 1], axis=1)
    children_BxD = jnp.take_along_axis(num_children_BxN, node_BxD, axis=1)
    r_R = jnp.arange(RANK_SLOTS)
    last_tried_BxD = jnp.where(has_next_BxD, next_rank_BxD, children_BxD - 1)
    tried = (visited_BxD[..., None] & (r_R < children_BxD[..., None])
             & (r_R <= jnp.minimum(last_tried_BxD, RANK_SLOTS - 1)[..., None]))
    accepted = (visited_BxD & has_next_BxD)[..., None] & (r_R == jnp.minimum(next_rank_BxD, RANK_SLOTS - 1)[..., None])
    return tried.astype(jnp.int32), accepted.astype(jnp.int32)
