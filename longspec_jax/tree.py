"""Static token-tree shapes, dynamic beam-search expansion, and lossless acceptance (reference.md 2.3, 2.6;
architecture.md section 5).

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

    Computed as a per-parent top-``width`` followed by a top-``width`` over those candidates, which selects
    the same set as one top-k over ``P * V`` values without a full-vocabulary sort per parent pair.
    """
    B, P, V = logp_BxPxV.shape
    per_parent = min(width, V)
    cand_scores, cand_tokens = jax.lax.top_k(scores_BxP[:, :, None] + logp_BxPxV, per_parent)
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
