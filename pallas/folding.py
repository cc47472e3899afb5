"""GQA folding for the split cache halves: the query heads that share a kv head become rows of one problem, and
the per-split partial results of those rows are merged back into ``[B, M, H, ...]``.

Row ``m * G + g`` of kv head ``k`` is query ``m`` of head ``k * G + g`` (G = H / K), so one pass over a kv head's
keys serves its whole group. Both cache halves that run on the folded problem (jax's cuDNN flash attention,
``longspec_jax.cudnn_cache``; the Mosaic GPU kernel, ``pallas.mosaic_cache_attention``) merge their splits here in
one float32 merge: with the tree half computed in the merging kernel (:func:`pallas.tree_attention.
tree_attention_merged`) when there is one, else in jnp (:func:`pallas.reference.merge_partials`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas.reference import merge_partials
from pallas.sizes import round_up
from pallas.tree_attention import tree_attention_merged

__all__ = ["fold_group", "merge_folded_splits"]


def fold_group(q_BxMxHxD, kv_heads: int, row_multiple: int = 1):
    """``[B, M, H, D] -> [B, T, K, D]`` with T = M * G rounded up to ``row_multiple`` (the rows past M * G are
    zeros)."""
    B, M, H, D = q_BxMxHxD.shape
    G = H // kv_heads
    folded = q_BxMxHxD.reshape(B, M, kv_heads, G, D).swapaxes(2, 3).reshape(B, M * G, kv_heads, D)
    pad = round_up(M * G, row_multiple) - M * G
    return jnp.pad(folded, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else folded


def merge_folded_splits(o_parts_PxBxRxKxD, lse_parts_PxBxKxR, num_queries: int, num_heads: int, *, dtype,
                        tree=None, scale=None):
    """Exact float32 merge of P partial results of the folded rows over disjoint key sets (the cache half's splits;
    an empty split has LSE ``-inf``, whatever its output holds), unfolded to ``[B, M, H, ...]``; rows past
    ``num_queries * G`` are dropped.

    tree: ``(q_BxRxKxD folded, k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN)``: the tree half (the new keys under the
    mask, softmax ``scale``) is computed and merged in the same kernel (:func:`pallas.tree_attention.
    tree_attention_merged`). Returns ``(o_BxMxHxD in dtype, lse_BxMxH float32)``.
    """
    _, B, _, K, D = o_parts_PxBxRxKxD.shape
    M, G = num_queries, num_heads // K
    if tree is None:
        o_BxTxKxD, lse_BxTxK = merge_partials(o_parts_PxBxRxKxD[:, :, :M * G],
                                              jnp.swapaxes(lse_parts_PxBxKxR, 2, 3)[:, :, :M * G])
        lse_BxKxT = jnp.swapaxes(lse_BxTxK, 1, 2)
    else:
        q_BxRxKxD, k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN = tree
        o_BxTxKxD, lse_BxKxT = tree_attention_merged(q_BxRxKxD, k_new_BxNxKxD, v_new_BxNxKxD,
                                                     jnp.repeat(mask_BxMxN, G, axis=1), o_parts_PxBxRxKxD,
                                                     lse_parts_PxBxKxR, rows=M * G, scale=scale)
    o_BxMxHxD = o_BxTxKxD.reshape(B, M, G, K, D).swapaxes(2, 3).reshape(B, M, num_heads, D)
    lse_BxMxH = lse_BxKxT.reshape(B, K, M, G).transpose(0, 2, 1, 3).reshape(B, M, num_heads)
    return o_BxMxHxD.astype(dtype), lse_BxMxH
