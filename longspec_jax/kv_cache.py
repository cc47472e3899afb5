"""Caches: the target's fixed-capacity KV cache (one K and one V array per layer, per-sequence lengths) with the
commit of a speculative round, and the draft's ring cache. Allocated under a tensor-parallel mesh
(:mod:`longspec_jax.mesh`), both are laid out rows over ``data`` and KV heads over ``model``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.mesh import HEADS, ROWS, constrain


@struct.dataclass
class KVCache:
    """``k[l], v[l]: [B, S, K, D]`` for layer l; ``lengths: [B]`` committed slots per sequence.

    Slots ``[0, lengths[b])`` hold committed tokens at positions equal to their slot index. Slots beyond may hold
    uncommitted (speculative or padding) entries; attention never reads them as cache.
    """

    k: tuple
    v: tuple
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (*self.k, *self.v))


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.bfloat16) -> KVCache:
    shape = (batch, capacity, num_kv_heads, head_dim)
    return KVCache(k=tuple(constrain(jnp.zeros(shape, dtype), HEADS) for _ in range(num_layers)),
                   v=tuple(constrain(jnp.zeros(shape, dtype), HEADS) for _ in range(num_layers)),
                   lengths=constrain(jnp.zeros((batch,), jnp.int32), ROWS))


def write_rows(buffer_BxSxKxD: jax.Array, new_BxTxKxD: jax.Array, start_B: jax.Array) -> jax.Array:
    """Writes ``new[b]`` into slots ``[start[b], start[b] + T)`` of ``buffer[b]`` (in place under donation)."""
    def write_one(buf, new, start):
        return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=0)
    return jax.vmap(write_one)(buffer_BxSxKxD, new_BxTxKxD, start_B)


@struct.dataclass
class TreeKV:
    """The K/V a verification pass computed for the tree's nodes, not yet in the cache: ``k[l], v[l]:
    [B, N, K, D]`` for layer l. Only the accepted path is written (:func:`commit`)."""

    k: tuple
    v: tuple


def commit(cache: KVCache, tree_kv: TreeKV, path_BxA, count_B, active_B) -> KVCache:
    """Writes the accepted path's K/V (tree nodes ``path[j]``, every layer) to slots ``lengths + j`` and commits
    the root and the accepted nodes of active sequences. Rows past a sequence's count land beyond its new
    length, where attention never reads them as cache."""
    root_B = cache.lengths

    def write_path(buffer_BxSxKxD, new_BxNxKxD):
        return write_rows(buffer_BxSxKxD, jnp.take_along_axis(new_BxNxKxD, path_BxA[:, :, None, None], axis=1), root_B)

    return cache.replace(k=tuple(map(write_path, cache.k, tree_kv.k)), v=tuple(map(write_path, cache.v, tree_kv.v)),
                         lengths=jnp.where(active_B, root_B + count_B, root_B))


@struct.dataclass
class RingCache:
    """The draft's self-attention cache: a fixed ring of slots holding the most recent committed positions.

    ``k, v: [B, R, K, D]``; ``pos: [B, R]`` the position stored in each slot (-1 when empty). Position p lives in
    slot ``p % R``. Memory is independent of the context length.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array

    @classmethod
    def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype) -> "RingCache":
        shape = (batch, capacity, num_kv_heads, head_dim)
        return cls(k=constrain(jnp.zeros(shape, dtype), HEADS), v=constrain(jnp.zeros(shape, dtype), HEADS),
                   pos=constrain(jnp.full((batch, capacity), -1, jnp.int32), ROWS))

    def write(self, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array, positions_BxT: jax.Array,
              valid_BxT: jax.Array) -> "RingCache":
        """Stores the valid entries at their positions' slots (positions of one row must be distinct mod R)."""
        B, T = positions_BxT.shape
        R = self.pos.shape[1]
        slots = jnp.where(valid_BxT, positions_BxT % R, R)  # R is out of range: dropped
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        return RingCache(k=self.k.at[rows, slots].set(k_BxTxKxD.astype(self.k.dtype), mode="drop"),
                         v=self.v.at[rows, slots].set(v_BxTxKxD.astype(self.v.dtype), mode="drop"),
                         pos=self.pos.at[rows, slots].set(positions_BxT, mode="drop"))

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (self.k, self.v, self.pos))
