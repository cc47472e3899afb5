"""Cache half of hybrid tree attention: split-K flash-decoding over a long KV cache with per-row valid length.

Bandwidth-bound. The M queries of a sequence are folded into the GQA head group, so one kv head has
``R = M * G`` query rows (row ``m * G + g`` is query ``m`` of head ``kvh * G + g``) and its K/V tiles are read
once per split for all of them. The valid prefix ``[0, lengths[b])`` of each row is cut into ``num_splits``
equal chunks at run time (rounded to ``block_k``), so the work of every program, and the total traffic,
scale with the valid length, not with the capacity S. Each program (row block, split, kv head, batch) runs
an online softmax over its chunk and writes a normalised partial output plus its float32 LSE; a small jnp
epilogue merges the splits in float32 and restores the ``[B, M, H, D]`` layout.

Returns ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``, the contract of
:func:`pallas.reference.cache_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas.backend import (LOG2E, dot_f32, dot_precision, finalize_softmax, next_pow2, online_softmax_step,
                            pallas_call_options, resolve_backend)
from pallas.reference import default_scale

__all__ = ["cache_attention", "cache_attention_partials", "combine_splits", "default_config"]

NUM_SMS_DEFAULT = 132  # H100 / H200


def _cache_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, capacity: int, head_dim: int, block_k: int,
                  block_d: int, num_splits: int, scale2: float, precision):
    split = pl.program_id(1)
    length = jnp.clip(len_ref[()], 0, capacity)
    # This program's chunk of the valid prefix: num_splits equal chunks, each a whole number of key blocks.
    chunk = ((length + num_splits - 1) // num_splits + block_k - 1) // block_k * block_k
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    num_blocks = (jnp.maximum(end - start, 0) + block_k - 1) // block_k

    col_ok = jnp.arange(block_d) < head_dim
    need_col_mask = block_d != head_dim
    q = q_ref[...]  # [block_r, block_d], zero-padded rows / columns
    block_r = q.shape[0]

    def body(i, carry):
        key0 = start + i * block_k
        key_ok = (key0 + jnp.arange(block_k)) < end  # [bk]
        kv_mask = key_ok[:, None] & col_ok[None, :] if need_col_mask else key_ok[:, None]
        k = plt.load(k_ref.at[pl.ds(key0, block_k), pl.ds(0, block_d)], mask=kv_mask, other=0.0)
        k = k.astype(q.dtype)
        s2 = dot_f32(q, k, trans_b=True, precision=precision) * scale2  # [br, bk]
        s2 = jnp.where(key_ok[None, :], s2, -jnp.inf)
        v = plt.load(v_ref.at[pl.ds(key0, block_k), pl.ds(0, block_d)], mask=kv_mask, other=0.0)
        v = v.astype(q.dtype)
        return online_softmax_step(carry, s2, v, precision=precision)

    init = (jnp.full((block_r,), -jnp.inf, jnp.float32), jnp.zeros((block_r,), jnp.float32),
            jnp.zeros((block_r, block_d), jnp.float32))
    carry = lax.fori_loop(0, num_blocks, body, init)
    o, lse = finalize_softmax(*carry)  # empty chunk: o = 0, lse = -inf
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def default_config(batch: int, kv_heads: int, num_queries: int, group: int, capacity: int,
                   num_sms: int = NUM_SMS_DEFAULT) -> dict:
    """Launch config used when the caller leaves block sizes / splits unset.

    Rows: one row block when ``M * G <= 128`` (K/V read once), else 64-row blocks (adjacent programs share
    K/V tiles through L2). Splits: enough programs for ~2 waves of ``num_sms`` SMs, capped so a chunk of a
    full cache keeps >= 2 key blocks.
    """
    rows = num_queries * group
    block_r = next_pow2(rows) if rows <= 128 else 64
    block_k = 128 if block_r <= 64 else 64
    num_row_blocks = pl.cdiv(rows, block_r)
    programs = batch * kv_heads * num_row_blocks
    want = pl.cdiv(2 * num_sms, programs)
    max_splits = max(1, capacity // (2 * block_k))
    num_splits = int(max(1, min(want, max_splits, 64)))
    num_warps = 4 if block_r <= 32 else 8
    return dict(block_r=block_r, block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=2)


def _lower_cache_attention(lengths, q_rows, k_cache, v_cache, *, scale: float, backend: str, block_r: int,
                           block_k: int, num_splits: int, head_dim: int, partial_dtype, num_warps: int | None,
                           num_stages: int | None):
    """The one place that builds the cache-attention ``pallas_call`` for a resolved backend.

    ``q_rows``: [B, K, Rp, Dp] (rows folded and zero-padded). Returns partials ``o [B, K, splits, Rp, Dp]``
    (normalised per split) and ``lse [B, K, splits, Rp]`` float32.
    """
    B, K, Rp, Dp = q_rows.shape
    S = k_cache.shape[1]
    kernel = functools.partial(
        _cache_kernel, capacity=S, head_dim=head_dim, block_k=block_k, block_d=Dp, num_splits=num_splits,
        scale2=float(scale) * LOG2E, precision=dot_precision(q_rows.dtype))
    # Grid (row block, split, kv head, batch): axis 0 varies fastest on the GPU, so the row blocks that read
    # the same K/V chunk run side by side and share it through L2.
    grid = (Rp // block_r, num_splits, K, B)
    in_specs = [
        pl.BlockSpec((None,), lambda r, s, h, b: (b,)),
        pl.BlockSpec((None, None, block_r, Dp), lambda r, s, h, b: (b, h, r, 0)),
        # The whole cache row of one kv head; the kernel reads only its chunk, with masked loads (the cache
        # may hold anything beyond the valid length, and its head dim may be narrower than Dp).
        pl.BlockSpec((None, S, None, Dp), lambda r, s, h, b: (b, 0, h, 0)),
        pl.BlockSpec((None, S, None, Dp), lambda r, s, h, b: (b, 0, h, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block_r, Dp), lambda r, s, h, b: (b, h, s, r, 0)),
        pl.BlockSpec((None, None, None, block_r), lambda r, s, h, b: (b, h, s, r)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, K, num_splits, Rp, Dp), partial_dtype),
                 jax.ShapeDtypeStruct((B, K, num_splits, Rp), jnp.float32)]
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        name="cache_attention", **pallas_call_options(backend, num_warps=num_warps, num_stages=num_stages),
    )(lengths, q_rows, k_cache, v_cache)


def combine_splits(o_part, lse_part):
    """Exact float32 merge over the split axis (2) of normalised partials; empty splits have lse = -inf."""
    m = jnp.max(lse_part, axis=2, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_part - m_safe)  # -inf -> 0
    denom = jnp.sum(w, axis=2)
    safe = jnp.where(denom > 0, denom, 1.0)
    o = jnp.sum(w[..., None] * o_part.astype(jnp.float32), axis=2) / safe[..., None]
    lse = jnp.where(denom > 0, m_safe[:, :, 0] + jnp.log(safe), -jnp.inf)
    return o, lse


def _fold_queries(q_BxMxHxD, K: int, rows_padded: int, block_d: int):
    """[B, M, H, D] -> [B, K, Rp, Dp]: row m * G + g of kv head k is query m of head k * G + g."""
    B, M, H, D = q_BxMxHxD.shape
    G = H // K
    q = q_BxMxHxD.reshape(B, M, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, M * G, D)
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows_padded - M * G), (0, block_d - D)))


def _check(q, k_cache, v_cache, lengths):
    B, M, H, D = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"cache_attention: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape} "
                         "do not match ([B, M, H, D] and [B, S, K, D])")
    if H % k_cache.shape[2]:
        raise ValueError(f"cache_attention: {H} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if lengths.shape != (B,):
        raise ValueError(f"cache_attention: lengths shape {lengths.shape} != {(B,)}")


def _resolve_config(B, K, M, G, S, block_r, block_k, num_splits, num_warps, num_stages):
    cfg = default_config(B, K, M, G, S)
    for name, val in (("block_r", block_r), ("block_k", block_k), ("num_splits", num_splits),
                      ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            cfg[name] = val
    for name in ("block_r", "block_k"):
        val = cfg[name]
        if val < 16 or val & (val - 1):
            raise ValueError(f"cache_attention: {name}={val} must be a power of two >= 16")
    if cfg["num_splits"] < 1:
        raise ValueError(f"cache_attention: num_splits={cfg['num_splits']} must be >= 1")
    return cfg


_STATIC = ("scale", "backend", "block_r", "block_k", "num_splits", "num_warps", "num_stages", "partial_dtype")


@functools.partial(jax.jit, static_argnames=_STATIC)
def cache_attention_partials(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None,
                             backend=None, block_r=None, block_k=None, num_splits=None, num_warps=None,
                             num_stages=None, partial_dtype=None):
    """Only the kernel (plus the query fold): per-split partials ``(o [B,K,splits,Rp,Dp], lse)``. For benchmarks."""
    _check(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B)
    B, M, H, D = q_BxMxHxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    cfg = _resolve_config(B, K, M, H // K, S, block_r, block_k, num_splits, num_warps, num_stages)
    block_d = next_pow2(D)
    rows_padded = pl.cdiv(M * (H // K), cfg["block_r"]) * cfg["block_r"]
    q_rows = _fold_queries(q_BxMxHxD, K, rows_padded, block_d)
    # A cache of another dtype is cast tile by tile inside the kernel (never copied here).
    return _lower_cache_attention(
        lengths_B.astype(jnp.int32), q_rows, k_cache_BxSxKxD, v_cache_BxSxKxD, scale=default_scale(D) if scale is None else scale,
        backend=resolve_backend(backend), block_r=cfg["block_r"], block_k=cfg["block_k"],
        num_splits=cfg["num_splits"], head_dim=D,
        partial_dtype=jnp.dtype(q_BxMxHxD.dtype if partial_dtype is None else partial_dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


@functools.partial(jax.jit, static_argnames=_STATIC)
def cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None, backend=None,
                    block_r=None, block_k=None, num_splits=None, num_warps=None, num_stages=None,
                    partial_dtype=None):
    """Attention of M queries over the valid cache prefix ``[0, lengths[b])`` (non-causal: every query sees it).

    Args:
      q_BxMxHxD: queries. k_cache_BxSxKxD / v_cache_BxSxKxD: the cache (S slots, K kv heads).
      lengths_B: int valid lengths, 0 <= lengths <= S (clipped into that range).
      scale: softmax scale (default ``D ** -0.5``). backend: None/"auto", "triton" or "interpret".
      block_r / block_k: query-row and key tiles (powers of two >= 16); num_splits: programs per (row block,
        kv head, sequence) along the keys; num_warps / num_stages: Triton launch parameters. Unset values
        come from :func:`default_config`.
      partial_dtype: dtype of the per-split partial outputs (default q.dtype; LSEs are always float32).
    Returns:
      ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``; rows with length 0 give o = 0, lse = -inf.
    """
    B, M, H, D = q_BxMxHxD.shape
    K = k_cache_BxSxKxD.shape[2]
    G = H // K
    o_part, lse_part = cache_attention_partials(
        q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale=scale, backend=backend,
        block_r=block_r, block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        partial_dtype=partial_dtype)
    o, lse = combine_splits(o_part, lse_part)  # [B, K, Rp, Dp], [B, K, Rp]
    o = o[:, :, :M * G, :D].reshape(B, K, M, G, D).transpose(0, 2, 1, 3, 4).reshape(B, M, H, D)
    lse = lse[:, :, :M * G].reshape(B, K, M, G).transpose(0, 2, 1, 3).reshape(B, M, H)
    return o.astype(q_BxMxHxD.dtype), lse
