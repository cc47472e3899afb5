"""Cache half of hybrid tree attention over jax's own flash attention (cuDNN), split along the keys.

jax's cuDNN flash attention parallelises over (query tile, head, sequence) only. With a few dozen tree queries
that is a handful of thread blocks for 132 SMs, each walking the whole cache, so here the problem is reshaped
first (no cache copy):

* the G query heads that share a kv head are folded into the query axis (:mod:`pallas.folding`):
  ``[B, M, H, D] -> [B, M*G, K, D]``, so every K/V tile is read once per kv head, not once per query head;
* the cache is cut into ``num_splits`` equal chunks that become extra sequences:
  ``[B, S, K, D] -> [B*splits, S/splits, K, D]`` (a free reshape), each with its own valid length
  ``clip(length - s*chunk, 0, chunk)``; the (small) folded queries are repeated per chunk;
* one flash call returns each chunk's output and float32 LSE; chunks past the valid length are dropped and the
  rest merged exactly in float32 (:func:`pallas.folding.merge_folded_splits`).

The per-chunk kernel is a parameter: :func:`cudnn_chunk_attention` on a GPU, :func:`reference_chunk_attention`
(pure jnp) for tests of everything around it on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas.folding import fold_group, merge_folded_splits
from pallas.reference import cache_attention_reference, check_cache_operands, default_scale
from pallas.sizes import NUM_SMS, ceil_div

__all__ = ["cudnn_cache_attention", "default_num_splits", "repeat_per_chunk", "cudnn_chunk_attention",
           "reference_chunk_attention", "cudnn_supports", "CUDNN_DTYPES"]

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
MIN_CHUNK = 512  # keys per chunk at least (short chunks spend their time in the per-tile prologue)
QUERY_TILE = 128  # cuDNN's query tile on Hopper


def cudnn_chunk_attention(q_NxTxKxD, k_NxCxKxD, v_NxCxKxD, lengths_N, scale: float):
    """cuDNN flash attention of T queries over the first ``lengths[n]`` keys of each of N sequences.

    Returns ``(o [N, T, K, D] in q.dtype, lse [N, T, K] float32)``. The LSE comes from jax's cuDNN binding
    directly: ``jax.nn.dot_product_attention(return_residual=True)`` casts it to the output dtype (bf16), too
    coarse for an exact merge. Rows with length 0 are undefined here (the caller drops them).
    """
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
    except ImportError as exc:  # pragma: no cover - depends on the installed jax
        raise RuntimeError(f"this jax ({jax.__version__}) has no cuDNN attention binding: {exc}") from exc
    N, T = q_NxTxKxD.shape[:2]
    q_len = jnp.full((N,), T, jnp.int32)
    o, lse_NxKxT = cudnn_attention(q_NxTxKxD, k_NxCxKxD, v_NxCxKxD, None, None, q_len, lengths_N.astype(jnp.int32),
                                   scale=float(scale), mask_type=MaskType.PADDING, qkv_layout="BTNH",
                                   return_residual=True)
    return o, jnp.swapaxes(lse_NxKxT, 1, 2).astype(jnp.float32)


def reference_chunk_attention(q_NxTxKxD, k_NxCxKxD, v_NxCxKxD, lengths_N, scale: float):
    """Pure-jnp stand-in for :func:`cudnn_chunk_attention` (same contract; any device, any dtype)."""
    return cache_attention_reference(q_NxTxKxD, k_NxCxKxD, v_NxCxKxD, lengths_N, scale)


def cudnn_supports(q_dtype, cache_dtype, head_dim: int) -> bool:
    """Whether the cuDNN chunk kernel takes these operands (half precision, matching dtypes, head_dim % 8)."""
    return (jnp.dtype(q_dtype) == jnp.dtype(cache_dtype)
            and any(jnp.dtype(q_dtype) == jnp.dtype(d) for d in CUDNN_DTYPES)
            and head_dim % 8 == 0 and head_dim <= 256)


def default_num_splits(batch: int, kv_heads: int, rows: int, capacity: int, *,
                       num_sms: int = NUM_SMS) -> int:
    """Fewest chunks that fill the GPU: the smallest divisor of ``capacity`` (chunks of at least ``MIN_CHUNK``
    keys) whose thread blocks, ``tiles x splits``, number at least 90% of the SMs and fill their last wave to at
    least 85%; the most such chunks if none qualifies, 1 if the capacity is too short to split.

    Every extra chunk costs a copy of the folded queries and a partial output to merge, so fewer is better once
    the SMs are busy (on the H200 at 32k the rule picks the fastest of 4-128 splits at Llama-3-8B and Vicuna-7B
    heads, 1 and 74 queries).
    """
    tiles = batch * kv_heads * ceil_div(rows, QUERY_TILE)
    allowed = [n for n in range(1, capacity // MIN_CHUNK + 1) if capacity % n == 0]
    for n in allowed:
        blocks = tiles * n
        waves = ceil_div(blocks, num_sms)
        if blocks >= 0.9 * num_sms and blocks >= 0.85 * waves * num_sms:
            return n
    return allowed[-1] if allowed else 1


def repeat_per_chunk(q_BxTxKxD, splits: int):
    """``[B, T, K, D] -> [B*splits, T, K, D]``: the queries of sequence b for each of its cache chunks, in the
    order of ``k_cache.reshape(B * splits, S // splits, K, D)``."""
    B, T, K, D = q_BxTxKxD.shape
    return jnp.broadcast_to(q_BxTxKxD[:, None], (B, splits, T, K, D)).reshape(B * splits, T, K, D)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "chunk_attention"))
def cudnn_cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None,
                          num_splits: int | None = None, chunk_attention=cudnn_chunk_attention, extra=None):
    """Every query attends to cache slots ``[0, lengths[b])`` (the contract of
    :func:`pallas.reference.cache_attention_reference`). Returns ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``.

    num_splits: chunks of the cache (must divide S; default :func:`default_num_splits`).
    chunk_attention: the per-chunk flash kernel, ``(q [N,T,K,D], k [N,C,K,D], v, lengths [N], scale) ->
      (o [N,T,K,D], lse [N,T,K] float32)``.
    extra: ``(o_BxMxHxD, lse_BxMxH)`` of another, disjoint key set (e.g. the tree half), merged in the same
      float32 merge as the chunks: the result is then attention over the cache and that set.
    """
    check_cache_operands("cudnn_cache_attention", q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B)
    B, M, H, D = q_BxMxHxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    G = H // K
    splits = default_num_splits(B, K, M * G, S) if num_splits is None else num_splits
    if splits < 1 or S % splits:
        raise ValueError(f"cudnn_cache_attention: num_splits={splits} must be >= 1 and divide the capacity {S}")
    chunk = S // splits
    scale = default_scale(D) if scale is None else scale

    q_NxTxKxD = repeat_per_chunk(fold_group(q_BxMxHxD, K), splits)
    k_NxCxKxD = k_cache_BxSxKxD.reshape(B * splits, chunk, K, D)
    v_NxCxKxD = v_cache_BxSxKxD.reshape(B * splits, chunk, K, D)
    starts = jnp.arange(splits, dtype=jnp.int32) * chunk
    chunk_len_BxP = jnp.clip(lengths_B.astype(jnp.int32)[:, None] - starts[None, :], 0, chunk)

    o_NxTxKxD, lse_NxTxK = chunk_attention(q_NxTxKxD, k_NxCxKxD, v_NxCxKxD, chunk_len_BxP.reshape(-1), scale)

    has_keys = (chunk_len_BxP > 0).reshape(B * splits, 1, 1)
    lse_NxTxK = jnp.where(has_keys, lse_NxTxK.astype(jnp.float32), -jnp.inf)
    o_NxTxKxD = jnp.where(has_keys[..., None], o_NxTxKxD, 0)
    o_PxBxTxKxD = o_NxTxKxD.reshape(B, splits, M * G, K, D).swapaxes(0, 1)
    lse_PxBxTxK = lse_NxTxK.reshape(B, splits, M * G, K).swapaxes(0, 1)
    return merge_folded_splits(o_PxBxTxKxD, lse_PxBxTxK, M, H, extra=extra, dtype=q_BxMxHxD.dtype)
