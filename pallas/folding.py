"""GQA folding for the split cache halves: the query heads that share a kv head become rows of one problem, and
the per-split partial results of those rows are merged back into ``[B, M, H, ...]``.

Row ``m * G + g`` of kv head ``k`` is query ``m`` of head ``k * G + g`` (G = H / K), so one pass over a kv head's
keys serves its whole group. Both cache halves that run on the folded problem (jax's cuDNN flash attention,
``longspec_jax.cudnn_cache``; the Mosaic GPU kernel, ``pallas.mosaic_cache_attention``) merge their splits, and
the tree half when given, here in one float32 merge (:func:`pallas.reference.merge_partials`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas.reference import merge_partials
from pallas.sizes import round_up

__all__ = ["fold_group", "merge_folded_splits"]


def fold_group(q_BxMxHxD, kv_heads: int, row_multiple: int = 1):
    """``[B, M, H, D] -> [B, T, K, D]`` with T = M * G rounded up to ``row_multiple`` (the rows past M * G are
    zeros)."""
    B, M, H, D = q_BxMxHxD.shape
    G = H // kv_heads
    folded = q_BxMxHxD.reshape(B, M, kv_heads, G, D).swapaxes(2, 3).reshape(B, M * G, kv_heads, D)
    pad = round_up(M * G, row_multiple) - M * G
    return jnp.pad(folded, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else folded


def merge_folded_splits(o_PxBxTxKxD, lse_PxBxTxK, num_queries: int, num_heads: int, extra=None, dtype=None):
    """Exact float32 merge of P splits of the folded rows (rows past ``num_queries * G`` are dropped; an empty
    split has LSE ``-inf``), plus ``extra = (o_BxMxHxD, lse_BxMxH)`` of another, disjoint key set when given.
    Returns ``(o_BxMxHxD in dtype (default o's), lse_BxMxH float32)``."""
    _, B, _, K, D = o_PxBxTxKxD.shape
    M, G = num_queries, num_heads // K
    o_PxBxTxKxD, lse_PxBxTxK = o_PxBxTxKxD[:, :, :M * G], lse_PxBxTxK[:, :, :M * G]
    if extra is not None:
        o_extra, lse_extra = fold_group(extra[0], K), fold_group(extra[1][..., None], K)[..., 0]
        o_PxBxTxKxD = jnp.concatenate([o_PxBxTxKxD, o_extra[None].astype(o_PxBxTxKxD.dtype)])
        lse_PxBxTxK = jnp.concatenate([lse_PxBxTxK, lse_extra[None].astype(jnp.float32)])
    o, lse = merge_partials(o_PxBxTxKxD, lse_PxBxTxK.astype(jnp.float32))  # [B, T, K, D], [B, T, K]
    o_BxMxHxD = o.reshape(B, M, G, K, D).swapaxes(2, 3).reshape(B, M, num_heads, D)
    lse_BxMxH = lse.reshape(B, M, G, K).swapaxes(2, 3).reshape(B, M, num_heads)
    return o_BxMxHxD.astype(o_PxBxTxKxD.dtype if dtype is None else dtype), lse_BxMxH
