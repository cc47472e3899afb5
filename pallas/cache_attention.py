"""Cache half of hybrid tree attention: split-K flash-decoding over a long KV cache with per-row valid length.

Bandwidth-bound. The M queries of a sequence are folded into the GQA head group, so one kv head has
``R = M * G`` query rows (row ``r`` is query ``r // G`` of head ``kvh * G + r % G``) and its K/V tiles are read
once per split for all of them. The valid prefix ``[0, lengths[b])`` of each row is cut into ``num_splits``
equal chunks at run time (rounded to ``block_k``), so the work of every program, and the total traffic,
scale with the valid length, not with the capacity S.

Two kernel launches and no other device op:
  1. main kernel, grid (row block, split, kv head, batch): gathers its query rows straight from
     ``q [B, M, H, D]``, runs an online softmax over its chunk and scatters a normalised partial output and
     its float32 LSE into ``[splits, B, Mp * H, D]`` / ``[splits, B, Mp * H]`` (the final row order; Mp >= M
     absorbs the padding rows, so every row the kernel owns is a distinct in-bounds row).
  2. combine kernel, grid (row block, column block, batch): exact float32 merge over the splits, written in
     ``[B, M, H, D]`` / ``[B, M, H]``. ``combine="xla"`` does this step with jnp instead.

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

from pallas.backend import (LOG2E, dot_f32, dot_precision, finalize_softmax, online_softmax_step, pallas_call_options,
                            resolve_backend)
from pallas.reference import check_cache_operands, default_scale, merge_partials
from pallas.sizes import NUM_SMS, ceil_div, next_pow2

__all__ = ["cache_attention", "cache_attention_partials", "default_config"]

COMBINES = ("pallas", "xla")


def _cache_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, num_queries: int, num_heads: int,
                  group: int, capacity: int, head_dim: int, block_r: int, block_k: int, block_d: int,
                  num_splits: int, scale2: float, precision):
    row_block, split, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = jnp.clip(len_ref[()], 0, capacity)
    # This program's chunk of the valid prefix: num_splits equal chunks, each a whole number of key blocks.
    chunk = ceil_div(ceil_div(length, num_splits), block_k) * block_k
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    num_blocks = ceil_div(jnp.maximum(end - start, 0), block_k)

    rows = row_block * block_r + jnp.arange(block_r)
    query = lax.div(rows, group)  # rows >= M * G are padding (query >= M)
    head = kv_head * group + lax.rem(rows, group)
    cols = jnp.arange(block_d)
    col_ok = cols < head_dim
    need_col_mask = block_d != head_dim
    q_ok = query < num_queries
    q_mask = q_ok[:, None] & col_ok[None, :] if need_col_mask else q_ok[:, None]
    q = plt.load(q_ref.at[query[:, None], head[:, None], cols[None, :]], mask=q_mask, other=0.0)

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
    flat = query * num_heads + head  # distinct and < Mp * H for every row of the grid
    plt.store(o_ref.at[flat[:, None], cols[None, :]], o.astype(o_ref.dtype))
    plt.store(lse_ref.at[flat], lse)


def _combine_kernel(o_part_ref, lse_part_ref, o_ref, lse_ref, *, num_splits: int, num_rows: int,
                    head_dim: int, split_pad: int, block_rows: int, block_cols: int):
    row_block, col_block = pl.program_id(0), pl.program_id(1)
    split_ok = jnp.arange(split_pad) < num_splits
    rows_ok = (row_block * block_rows + jnp.arange(block_rows)) < num_rows
    cols_ok = (col_block * block_cols + jnp.arange(block_cols)) < head_dim
    lse = plt.load(lse_part_ref.at[pl.ds(0, split_pad), pl.ds(0, block_rows)], mask=split_ok[:, None],
                   other=-jnp.inf)  # [splits, rows]
    o = plt.load(o_part_ref.at[pl.ds(0, split_pad), pl.ds(0, block_rows), pl.ds(0, block_cols)],
                 mask=split_ok[:, None, None], other=0.0).astype(jnp.float32)  # [splits, rows, cols]
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m_safe[None, :])  # empty splits (lse = -inf) -> 0
    denom = jnp.sum(w, axis=0)
    has = denom > 0.0
    denom_safe = jnp.where(has, denom, 1.0)
    out = jnp.sum(w[:, :, None] * o, axis=0) / denom_safe[:, None]
    plt.store(o_ref.at[pl.ds(0, block_rows), pl.ds(0, block_cols)], out.astype(o_ref.dtype),
              mask=rows_ok[:, None] & cols_ok[None, :])
    lse_out = jnp.where(has, m_safe + jnp.log(denom_safe), -jnp.inf)
    plt.store(lse_ref.at[pl.ds(0, block_rows)], lse_out, mask=rows_ok & (col_block == 0))


def default_config(batch: int, kv_heads: int, num_queries: int, group: int, capacity: int, *,
                   head_dim: int = 128, itemsize: int = 2, num_sms: int = NUM_SMS) -> dict:
    """Launch config used when the caller leaves block sizes / splits unset.

    Rows: one row block when ``M * G <= 128`` (K/V read once), else 128-row blocks (adjacent programs share
    K/V tiles through L2). Keys: tiles of at most 32 KiB (128 bf16 rows of 128) so that K and V for
    ``num_stages`` pipeline stages fit in shared memory. Splits: about two programs per SM in all (four when the
    rows need several blocks: those programs are compute-bound and short), capped so that a chunk of a full
    cache keeps >= 2 key blocks, and at 64. Two pipeline stages (on the H200, plain decoding's cache half at 32k
    took 41.6 us with two, 44.2 with three).
    """
    rows = num_queries * group
    block_r = next_pow2(rows, 16) if rows <= 128 else 128
    tile_rows = max(16, (32 * 1024) // (next_pow2(head_dim, 16) * itemsize))
    block_k = min(128, tile_rows)
    num_row_blocks = ceil_div(rows, block_r)
    programs = batch * kv_heads * num_row_blocks
    want = ceil_div((2 if num_row_blocks == 1 else 4) * num_sms, programs)
    max_splits = max(1, capacity // (2 * block_k))
    num_splits = int(max(1, min(want, max_splits, 64)))
    num_warps = 4 if block_r <= 32 else 8
    num_stages = 2
    return dict(block_r=block_r, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                num_stages=num_stages)


def combine_config(num_splits: int, num_rows: int, head_dim: int) -> dict:
    """Tiles of the combine kernel: all splits (padded to a power of two) x 16 rows x a column block of at
    least 16, about 8K float32 values per program."""
    split_pad = next_pow2(num_splits, minimum=2)
    block_rows = 16
    budget = max(1, 8192 // (split_pad * block_rows))
    block_cols = min(next_pow2(head_dim, 16), max(16, 1 << (budget.bit_length() - 1)))
    return dict(split_pad=split_pad, block_rows=block_rows, block_cols=block_cols)


def _lower_cache_attention(lengths, q, k_cache, v_cache, *, scale: float, backend: str, block_r: int,
                           block_k: int, num_splits: int, partial_dtype, num_warps: int | None,
                           num_stages: int | None, combine: str):
    """The one place that builds the cache-attention ``pallas_call`` s for a resolved backend.

    Returns the merged ``(o [B, M, H, D], lse [B, M, H])`` or, with ``combine=None``, the raw partials
    ``(o [splits, B, Mp*H, Dp], lse [splits, B, Mp*H])`` (only rows ``< M*H`` and columns ``< D`` matter).
    """
    B, M, H, D = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    block_d = next_pow2(D, 16)
    num_row_blocks = ceil_div(M * G, block_r)
    m_pad = ceil_div(num_row_blocks * block_r, G)  # queries incl. the padding rows' (distinct) slots
    kernel = functools.partial(
        _cache_kernel, num_queries=M, num_heads=H, group=G, capacity=S, head_dim=D, block_r=block_r,
        block_k=block_k, block_d=block_d, num_splits=num_splits, scale2=float(scale) * LOG2E,
        precision=dot_precision(q.dtype))
    # Grid (row block, split, kv head, batch): axis 0 varies fastest on the GPU, so the row blocks that read
    # the same K/V chunk run side by side and share it through L2. Blocks may overhang the arrays (head dim
    # padded to a power of two); every access past an array edge is masked or never happens.
    grid = (num_row_blocks, num_splits, K, B)
    in_specs = [
        pl.BlockSpec((None,), lambda r, s, h, b: (b,)),
        pl.BlockSpec((None, M, H, block_d), lambda r, s, h, b: (b, 0, 0, 0)),
        # The whole cache row of one kv head; the kernel reads only its chunk, with masked loads (the cache
        # may hold anything beyond the valid length).
        pl.BlockSpec((None, S, None, block_d), lambda r, s, h, b: (b, 0, h, 0)),
        pl.BlockSpec((None, S, None, block_d), lambda r, s, h, b: (b, 0, h, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, m_pad * H, block_d), lambda r, s, h, b: (s, b, 0, 0)),
        pl.BlockSpec((None, None, m_pad * H), lambda r, s, h, b: (s, b, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((num_splits, B, m_pad * H, block_d), partial_dtype),
                 jax.ShapeDtypeStruct((num_splits, B, m_pad * H), jnp.float32)]
    o_part, lse_part = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        name="cache_attention", **pallas_call_options(backend, num_warps=num_warps, num_stages=num_stages),
    )(lengths, q, k_cache, v_cache)
    if combine is None:
        return o_part, lse_part
    if combine == "xla":
        o, lse = merge_partials(o_part[:, :, :M * H, :D], lse_part[:, :, :M * H])
        return o.reshape(B, M, H, D).astype(q.dtype), lse.reshape(B, M, H)

    cc = combine_config(num_splits, M * H, D)
    split_pad, block_rows, block_cols = cc["split_pad"], cc["block_rows"], cc["block_cols"]
    combine_kernel = functools.partial(
        _combine_kernel, num_splits=num_splits, num_rows=M * H, head_dim=D, split_pad=split_pad,
        block_rows=block_rows, block_cols=block_cols)
    grid = (ceil_div(M * H, block_rows), ceil_div(D, block_cols), B)
    o, lse = pl.pallas_call(
        combine_kernel, grid=grid,
        in_specs=[pl.BlockSpec((split_pad, None, block_rows, block_cols), lambda r, c, b: (0, b, r, c)),
                  pl.BlockSpec((split_pad, None, block_rows), lambda r, c, b: (0, b, r))],
        out_specs=[pl.BlockSpec((None, block_rows, block_cols), lambda r, c, b: (b, r, c)),
                   pl.BlockSpec((None, block_rows), lambda r, c, b: (b, r))],
        out_shape=[jax.ShapeDtypeStruct((B, M * H, D), q.dtype), jax.ShapeDtypeStruct((B, M * H), jnp.float32)],
        name="cache_attention_combine", **pallas_call_options(backend, num_warps=4, num_stages=1),
    )(o_part, lse_part)
    return o.reshape(B, M, H, D), lse.reshape(B, M, H)


def _resolve_config(q, k_cache, block_r, block_k, num_splits, num_warps, num_stages):
    B, M, H, D = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    itemsize = max(jnp.dtype(q.dtype).itemsize, jnp.dtype(k_cache.dtype).itemsize)
    cfg = default_config(B, K, M, H // K, S, head_dim=D, itemsize=itemsize)
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


def _cache_attention(q, k_cache, v_cache, lengths, *, scale, backend, block_r, block_k, num_splits, num_warps,
                     num_stages, partial_dtype, combine):
    check_cache_operands("cache_attention", q, k_cache, v_cache, lengths)
    cfg = _resolve_config(q, k_cache, block_r, block_k, num_splits, num_warps, num_stages)
    # A cache of another dtype is cast tile by tile inside the kernel (never copied here).
    return _lower_cache_attention(
        lengths.astype(jnp.int32), q, k_cache, v_cache,
        scale=default_scale(q.shape[-1]) if scale is None else scale, backend=resolve_backend(backend),
        partial_dtype=jnp.dtype(q.dtype if partial_dtype is None else partial_dtype), combine=combine, **cfg)


_STATIC = ("scale", "backend", "block_r", "block_k", "num_splits", "num_warps", "num_stages", "partial_dtype")


@functools.partial(jax.jit, static_argnames=_STATIC)
def cache_attention_partials(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None,
                             backend=None, block_r=None, block_k=None, num_splits=None, num_warps=None,
                             num_stages=None, partial_dtype=None):
    """The main kernel alone (for tests and benchmarks): per-split partials ``(o [splits, B, Mp*H, Dp],
    lse [splits, B, Mp*H])``, normalised per split; rows ``m * H + h`` with ``m < M`` are the real ones."""
    return _cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale=scale, backend=backend,
                            block_r=block_r, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                            num_stages=num_stages, partial_dtype=partial_dtype, combine=None)


@functools.partial(jax.jit, static_argnames=_STATIC + ("combine",))
def cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None, backend=None,
                    block_r=None, block_k=None, num_splits=None, num_warps=None, num_stages=None,
                    partial_dtype=None, combine: str = "pallas"):
    """Attention of M queries over the valid cache prefix ``[0, lengths[b])`` (non-causal: every query sees it).

    Args:
      q_BxMxHxD: queries. k_cache_BxSxKxD / v_cache_BxSxKxD: the cache (S slots, K kv heads; another dtype
        than q is cast tile by tile in the kernel).
      lengths_B: int valid lengths, 0 <= lengths <= S (clipped into that range).
      scale: softmax scale (default ``D ** -0.5``). backend: None/"auto", "triton" or "interpret".
      block_r / block_k: query-row and key tiles (powers of two >= 16); num_splits: programs per (row block,
        kv head, sequence) along the keys; num_warps / num_stages: Triton launch parameters of the main
        kernel. Unset values come from :func:`default_config`.
      partial_dtype: dtype of the per-split partial outputs (default q.dtype; LSEs are always float32).
      combine: "pallas" (a second small kernel) or "xla" (jnp) for the merge over splits.
    Returns:
      ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``; rows with length 0 give o = 0, lse = -inf.
    """
    if combine not in COMBINES:
        raise ValueError(f"cache_attention: combine={combine!r}; choose one of {', '.join(COMBINES)}")
    return _cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale=scale, backend=backend,
                            block_r=block_r, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                            num_stages=num_stages, partial_dtype=partial_dtype, combine=combine)
