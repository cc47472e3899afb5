"""Attention dispatch: hybrid tree attention (cache half + speculative half merged by LSE) and references.

Layouts: queries ``q_BxMxHxD``; the KV cache ``[B, S, K, D]`` (S slots, K kv heads) with a per-sequence
valid length ``lengths_B``; new (speculative) keys ``[B, N, K, D]`` with a boolean ``mask_BxMxN`` saying which
new keys each query may see. Query head ``h`` reads kv head ``h // (H // K)``. All LSEs are float32 natural
logs of the sum of ``exp(scale * q.k)``; an empty key set gives output 0 and LSE ``-inf``.

Under a tensor-parallel mesh (:mod:`longspec_jax.mesh`) the decoding entry points (cache, hybrid tree and
windowed ring attention) run per shard: each device attends with its own rows and heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longspec_jax.cudnn_cache import cudnn_cache_attention, cudnn_supports
from longspec_jax.mesh import HEAD_LSE, HEADS, ROWS, per_shard
from pallas import cache_attention as pallas_cache_attention
from pallas import tree_attention
from pallas.mosaic_cache_attention import (check_mosaic_operands, mosaic_cache_attention, mosaic_runs_here,
                                           mosaic_supports)
from pallas.reference import cache_attention_reference, default_scale, masked_attention_reference, merge_partials
from pallas.sizes import ceil_div

IMPLS = ("auto", "gpu", "pallas", "cudnn", "mosaic", "xla", "naive")
# "gpu" (what "auto" picks on a GPU) takes a tensor-core cache half from this many query rows (queries x GQA group)
# on, in half precision: the Mosaic GPU one on Hopper (rounds 4.5% less busy than with cuDNN's on the H200),
# cuDNN's elsewhere; the Pallas split-K kernel below that (one query row per sequence in plain decoding).
TENSOR_CORE_MIN_ROWS = 64
# "mosaic" takes the Mosaic GPU cache half from this many rows on (one compute warpgroup's), the Pallas one below.
MOSAIC_MIN_ROWS = 64
# The split cache halves, which merge the tree half (``extra=``) with their splits in one float32 merge.
MERGING_CACHE_HALVES = (cudnn_cache_attention, mosaic_cache_attention)

__all__ = ["cache_attention_reference", "masked_attention_reference", "cache_attention_blockwise",
           "merge_attention", "naive_tree_attention", "hybrid_tree_attention", "cache_attention",
           "windowed_ring_attention", "causal_attention", "resolve_impl"]


def cache_attention_blockwise(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale=None,
                              block_size: int = 128):
    """Same function as :func:`cache_attention_reference`, with memory bounded by ``block_size`` keys.

    Online softmax over key blocks; only the blocks below ``max(lengths)`` are visited.
    """
    B, M, H, D = q_BxMxHxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    block = min(block_size, S)
    if S % block:
        raise ValueError(f"cache capacity {S} must be a multiple of the key block {block}")
    scale = default_scale(D) if scale is None else scale
    q = q_BxMxHxD.reshape(B, M, K, H // K, D)

    def body(i, carry):
        m_run, l_run, acc = carry
        start = i * block
        k = jax.lax.dynamic_slice_in_dim(k_cache_BxSxKxD, start, block, axis=1)
        v = jax.lax.dynamic_slice_in_dim(v_cache_BxSxKxD, start, block, axis=1)
        s = jnp.einsum("bmkgd,bnkd->bkgmn", q, k, preferred_element_type=jnp.float32) * scale
        valid = (start + jnp.arange(block))[None, :] < lengths_B[:, None]
        s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m_run), m_run - m_safe, -jnp.inf))
        l_new = l_run * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgmn,bnkd->bkgmd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc * correction[..., None] + pv

    G = H // K
    init = (jnp.full((B, K, G, M), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, M), jnp.float32),
            jnp.zeros((B, K, G, M, D), jnp.float32))
    num_blocks = ceil_div(jnp.max(lengths_B), block)
    m_run, l_run, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o = acc / jnp.where(l_run > 0, l_run, 1.0)[..., None]
    lse = jnp.where(l_run > 0, jnp.log(jnp.where(l_run > 0, l_run, 1.0)) + m_run, -jnp.inf)
    o_BxMxHxD = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, M, H, D)
    lse_BxMxH = jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, M, H)
    return o_BxMxHxD.astype(q_BxMxHxD.dtype), lse_BxMxH


def merge_attention(o_a, lse_a, o_b, lse_b):
    """Exact softmax over the union of two disjoint key sets from their partial results (float32 merge,
    :func:`pallas.reference.merge_partials`); the output has ``o_a``'s dtype."""
    o, lse = merge_partials(jnp.stack([o_a.astype(jnp.float32), o_b.astype(jnp.float32)]), jnp.stack([lse_a, lse_b]))
    return o.astype(o_a.dtype), lse


def resolve_impl(impl: str) -> str:
    """``auto`` picks ``gpu`` on a GPU and the XLA (jnp) path elsewhere.

    Impls: ``pallas`` (both halves Pallas kernels), ``cudnn`` (cache half: jax's cuDNN flash attention, split
    along the keys, :mod:`longspec_jax.cudnn_cache`; speculative half: Pallas), ``mosaic`` (cache half: the
    Hopper Mosaic GPU kernel, :mod:`pallas.mosaic_cache_attention`, in jax's Mosaic GPU interpreter off a GPU;
    speculative half: Pallas), ``gpu`` (per call, :func:`gpu_cache_half`: for many query rows in half precision
    ``mosaic``'s cache half on Hopper and ``cudnn``'s on other GPUs, ``pallas`` otherwise), ``xla`` (blockwise jnp),
    ``naive`` (one dense masked softmax). How the Pallas kernels are lowered (Triton on a GPU, interpret mode
    elsewhere) is a separate choice that :func:`pallas.backend.resolve_backend` makes from the device.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "gpu" if jax.default_backend() == "gpu" else "xla"
    return impl


def gpu_cache_half(num_queries: int, num_heads: int, kv_heads: int, q_dtype, cache_dtype, head_dim: int) -> str:
    """The ``gpu`` impl's cache half for one call's shapes: ``mosaic``, ``cudnn`` or ``pallas``."""
    if num_queries * (num_heads // kv_heads) < TENSOR_CORE_MIN_ROWS or jax.default_backend() != "gpu":
        return "pallas"
    if mosaic_supports(q_dtype, cache_dtype, head_dim) and mosaic_runs_here():
        return "mosaic"
    return "cudnn" if cudnn_supports(q_dtype, cache_dtype, head_dim) else "pallas"


def naive_tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale=None):
    """One masked softmax over ``[cache slots | new keys]``: the reference for the hybrid version."""
    S = k_cache.shape[1]
    B, M = q.shape[:2]
    valid = jnp.arange(S)[None, :] < cache_len[:, None]
    full_mask = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (B, M, S)), mask], axis=-1)
    k = jnp.concatenate([k_cache, k_new.astype(k_cache.dtype)], axis=1)
    v = jnp.concatenate([v_cache, v_new.astype(v_cache.dtype)], axis=1)
    return masked_attention_reference(q, k, v, full_mask, scale)


def _tree_half(impl: str):
    """Speculative-half implementation for a resolved impl name."""
    if impl in ("naive", "xla"):
        return masked_attention_reference
    return tree_attention


def _cache_half(impl: str, q_BxMxHxD, k_cache_BxSxKxD):
    """Cache-half implementation for a resolved impl name (not ``naive``) and these operands."""
    if impl == "xla":
        return cache_attention_blockwise
    _, M, H, D = q_BxMxHxD.shape
    K = k_cache_BxSxKxD.shape[2]
    if impl == "gpu":
        impl = gpu_cache_half(M, H, K, q_BxMxHxD.dtype, k_cache_BxSxKxD.dtype, D)
    if impl == "mosaic":
        check_mosaic_operands("impl='mosaic'", q_BxMxHxD.dtype, k_cache_BxSxKxD.dtype, D)
        if M * (H // K) >= MOSAIC_MIN_ROWS:
            return functools.partial(mosaic_cache_attention, interpret=jax.default_backend() != "gpu")
        impl = "pallas"
    if impl == "pallas":
        return pallas_cache_attention
    if jax.default_backend() != "gpu":
        raise ValueError(f"impl='cudnn' needs a CUDA GPU (JAX's default backend here is {jax.default_backend()!r})")
    if not cudnn_supports(q_BxMxHxD.dtype, k_cache_BxSxKxD.dtype, D):
        raise ValueError(f"impl='cudnn' needs float16/bfloat16 queries and cache of one dtype and a head_dim that "
                         f"is a multiple of 8 up to 256; got q {q_BxMxHxD.dtype}, cache {k_cache_BxSxKxD.dtype}, "
                         f"head_dim {D}")
    return cudnn_cache_attention


def cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None, impl: str = "auto"):
    """Every query attends to cache slots ``[0, lengths[b])``. Returns ``(o, lse)``."""
    fn = per_shard(functools.partial(_cache_attention, scale=scale, impl=resolve_impl(impl)),
                   (HEADS, HEADS, HEADS, ROWS), (HEADS, HEAD_LSE))
    return fn(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B)


def _cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale, impl: str):
    if impl == "naive":
        return cache_attention_reference(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale)
    cache_half = _cache_half(impl, q_BxMxHxD, k_cache_BxSxKxD)
    return cache_half(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale=scale)


def hybrid_tree_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cache_len_B, k_new_BxNxKxD,
                          v_new_BxNxKxD, mask_BxMxN, *, scale=None, impl: str = "auto"):
    """Attention of M new queries over the committed cache prefix plus the new keys under ``mask``.

    cache half (``[0, cache_len)``) + speculative half (new keys, masked), merged by float32 LSE.
    Returns ``(o_BxMxHxD, lse_BxMxH)``.
    """
    fn = per_shard(functools.partial(_hybrid_tree_attention, scale=scale, impl=resolve_impl(impl)),
                   (HEADS, HEADS, HEADS, ROWS, HEADS, HEADS, ROWS), (HEADS, HEAD_LSE))
    return fn(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cache_len_B, k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN)


def _hybrid_tree_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cache_len_B, k_new_BxNxKxD,
                           v_new_BxNxKxD, mask_BxMxN, *, scale, impl: str):
    if impl == "naive":
        return naive_tree_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cache_len_B,
                                    k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN, scale)
    cache_half = _cache_half(impl, q_BxMxHxD, k_cache_BxSxKxD)
    o_new, lse_new = _tree_half(impl)(q_BxMxHxD, k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN, scale=scale)
    if getattr(cache_half, "func", cache_half) in MERGING_CACHE_HALVES:
        return cache_half(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cache_len_B, scale=scale,
                          extra=(o_new, lse_new))
    o_cache, lse_cache = cache_half(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cache_len_B, scale=scale)
    return merge_attention(o_cache, lse_cache, o_new, lse_new)


def windowed_ring_attention(q_BxMxHxD, q_pos_BxM, ring_k_BxRxKxD, ring_v_BxRxKxD, ring_pos_BxR, window: int,
                            k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN, *, scale=None, impl: str = "auto"):
    """Sliding-window attention for the draft: a query at position t sees the ring entries at positions
    ``[t - window, t)`` plus the new keys its ``mask`` row allows (itself and its tree ancestors), merged by LSE.

    The ring is at most a few hundred slots, so its half is a dense masked attention.
    """
    fn = per_shard(functools.partial(_windowed_ring_attention, window=window, scale=scale, impl=resolve_impl(impl)),
                   (HEADS, ROWS, HEADS, HEADS, ROWS, HEADS, HEADS, ROWS), (HEADS, HEAD_LSE))
    return fn(q_BxMxHxD, q_pos_BxM, ring_k_BxRxKxD, ring_v_BxRxKxD, ring_pos_BxR, k_new_BxNxKxD, v_new_BxNxKxD,
              mask_BxMxN)


def _windowed_ring_attention(q_BxMxHxD, q_pos_BxM, ring_k_BxRxKxD, ring_v_BxRxKxD, ring_pos_BxR, k_new_BxNxKxD,
                             v_new_BxNxKxD, mask_BxMxN, *, window: int, scale, impl: str):
    rp = ring_pos_BxR[:, None, :]
    qp = q_pos_BxM[:, :, None]
    ring_mask = (rp >= 0) & (rp >= qp - window) & (rp < qp)
    o_ring, lse_ring = masked_attention_reference(q_BxMxHxD, ring_k_BxRxKxD, ring_v_BxRxKxD, ring_mask, scale)
    o_new, lse_new = _tree_half(impl)(q_BxMxHxD, k_new_BxNxKxD, v_new_BxNxKxD, mask_BxMxN, scale=scale)
    return merge_attention(o_ring, lse_ring, o_new, lse_new)


def causal_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, *, window: int | None = None, impl: str = "auto"):
    """Causal attention over whole sequences (training forwards, differentiable): query t sees keys
    ``max(0, t - window) .. t`` (all keys up to t without a window). jax's cuDNN flash attention where the
    impl allows it (a GPU, half precision), XLA's dense attention otherwise. Returns ``o_BxTxHxD``."""
    impl = resolve_impl(impl)
    flash = (impl in ("gpu", "cudnn") and jax.default_backend() == "gpu"
             and cudnn_supports(q_BxTxHxD.dtype, k_BxTxKxD.dtype, q_BxTxHxD.shape[-1]))
    if impl == "cudnn" and not flash:
        raise ValueError(f"impl='cudnn' needs a CUDA GPU and float16/bfloat16 operands; got backend "
                         f"{jax.default_backend()!r}, q {q_BxTxHxD.dtype}")
    return jax.nn.dot_product_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, is_causal=True,
                                        local_window_size=None if window is None else (window, 0),
                                        implementation="cudnn" if flash else "xla")
