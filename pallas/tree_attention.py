"""Speculative half of hybrid tree attention: M new queries over N new keys under an arbitrary boolean mask.

Small and latency-bound (M, N <= ~128). One program per (row block, query head, batch) holds its query rows
and loops over key blocks (usually a single one) with an online softmax in float32. Nothing is padded or
transposed outside the kernel: ragged rows / keys / head-dim columns are handled by masked loads and stores
on power-of-two tiles, so a call is a single kernel launch.

Returns ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``, the same contract as
:func:`pallas.reference.masked_attention_reference`.
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
from pallas.reference import default_scale
from pallas.sizes import ceil_div, next_pow2

__all__ = ["tree_attention", "tree_attention_merged"]


def _tree_softmax(q, k_ref, v_ref, mask_ref, row_ok, col_ok, *, num_keys: int, block_m: int, block_n: int,
                  num_key_blocks: int, scale2: float, precision):
    """Online softmax of the query tile ``q [bm, bd]`` over the new keys its rows of ``mask_ref`` allow:
    ``(o [bm, bd] float32, lse [bm] float32)``, o = 0 and lse = -inf for rows that see no key."""
    need_col_mask = not isinstance(col_ok, bool)

    def body(j, carry):
        key0 = j * block_n
        key_ok = (key0 + jnp.arange(block_n)) < num_keys  # [bn]
        kv_mask = key_ok[:, None] & col_ok[None, :] if need_col_mask else key_ok[:, None]
        k = plt.load(k_ref.at[pl.ds(key0, block_n), pl.ds(0, q.shape[1])], mask=kv_mask, other=0.0)
        v = plt.load(v_ref.at[pl.ds(key0, block_n), pl.ds(0, q.shape[1])], mask=kv_mask, other=0.0)
        allowed = plt.load(mask_ref.at[pl.ds(0, block_m), pl.ds(key0, block_n)],
                           mask=row_ok[:, None] & key_ok[None, :], other=False)
        s2 = dot_f32(q, k, trans_b=True, precision=precision) * scale2
        s2 = jnp.where(allowed, s2, -jnp.inf)
        return online_softmax_step(carry, s2, v, precision=precision)

    init = (jnp.full((block_m,), -jnp.inf, jnp.float32), jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, q.shape[1]), jnp.float32))
    carry = body(0, init) if num_key_blocks == 1 else lax.fori_loop(0, num_key_blocks, body, init)
    return finalize_softmax(*carry)


def _tile_masks(row0: int, rows: int, block_m: int, head_dim: int, block_d: int):
    """(rows in range [bm], columns in range [bd] or True when the head_dim is a power of two, load/store mask)."""
    row_ok = (row0 + jnp.arange(block_m)) < rows
    if block_d == head_dim:
        return row_ok, True, row_ok[:, None]
    col_ok = jnp.arange(block_d) < head_dim
    return row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def _tree_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, num_queries: int, head_dim: int, block_m: int,
                 block_d: int, **softmax):
    row_ok, col_ok, tile_ok = _tile_masks(pl.program_id(0) * block_m, num_queries, block_m, head_dim, block_d)
    q = plt.load(q_ref.at[pl.ds(0, block_m), pl.ds(0, block_d)], mask=tile_ok, other=0.0)
    o, lse = _tree_softmax(q, k_ref, v_ref, mask_ref, row_ok, col_ok, block_m=block_m, **softmax)
    plt.store(o_ref.at[pl.ds(0, block_m), pl.ds(0, block_d)], o.astype(o_ref.dtype), mask=tile_ok)
    plt.store(lse_ref.at[pl.ds(0, block_m)], lse, mask=row_ok)


def _merged_kernel(q_ref, k_ref, v_ref, mask_ref, o_parts_ref, lse_parts_ref, o_ref, lse_ref, *, rows: int,
                   num_parts: int, head_dim: int, block_m: int, block_d: int, **softmax):
    """The tree half of a tile of folded rows, merged in float32 with the cache half's split partials."""
    row_ok, col_ok, tile_ok = _tile_masks(pl.program_id(0) * block_m, rows, block_m, head_dim, block_d)
    q = plt.load(q_ref.at[pl.ds(0, block_m), pl.ds(0, block_d)], mask=tile_ok, other=0.0)
    o_tree, lse_tree = _tree_softmax(q, k_ref, v_ref, mask_ref, row_ok, col_ok, block_m=block_m, **softmax)
    lse_parts = [plt.load(lse_parts_ref.at[jnp.int32(p), pl.ds(0, block_m)], mask=row_ok, other=-jnp.inf)
                 for p in range(num_parts)]
    m = functools.reduce(jnp.maximum, lse_parts, lse_tree)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w_tree = jnp.exp(lse_tree - m)
    acc, denom = w_tree[:, None] * o_tree, w_tree
    for p, lse_p in enumerate(lse_parts):
        w = jnp.exp(lse_p - m)[:, None]  # an empty split (-inf) weighs 0, whatever its output holds
        o_p = plt.load(o_parts_ref.at[jnp.int32(p), pl.ds(0, block_m), pl.ds(0, block_d)], mask=tile_ok, other=0.0)
        acc = acc + jnp.where(w > 0.0, w * o_p.astype(jnp.float32), 0.0)
        denom = denom + w[:, 0]
    has = denom > 0.0
    denom_safe = jnp.where(has, denom, 1.0)
    plt.store(o_ref.at[pl.ds(0, block_m), pl.ds(0, block_d)], (acc / denom_safe[:, None]).astype(o_ref.dtype),
              mask=tile_ok)
    plt.store(lse_ref.at[pl.ds(0, block_m)], jnp.where(has, m + jnp.log(denom_safe), -jnp.inf), mask=row_ok)


def _softmax_params(num_keys: int, block_n: int, scale: float, dtype) -> dict:
    return dict(num_keys=num_keys, block_n=block_n, num_key_blocks=ceil_div(num_keys, block_n), scale2=scale * LOG2E,
                precision=dot_precision(dtype))


def _lower_tree_attention(q, k, v, mask, *, scale: float, backend: str, block_m: int, block_n: int,
                          num_warps: int | None, num_stages: int | None):
    """The one place that builds the tree-attention ``pallas_call`` for a resolved backend."""
    B, M, H, D = q.shape
    N, K = k.shape[1], k.shape[2]
    G = H // K
    block_d = next_pow2(D, 16)
    num_row_blocks = ceil_div(M, block_m)
    keys_padded = ceil_div(N, block_n) * block_n

    kernel = functools.partial(
        _tree_kernel, num_queries=M, head_dim=D, block_m=block_m, block_d=block_d,
        **_softmax_params(N, block_n, float(scale), q.dtype))
    # Grid (row block, query head, batch): axis 0 varies fastest on the GPU, so the programs that share a
    # head's keys run together. Blocks may overhang the arrays; every load / store below is masked.
    grid = (num_row_blocks, H, B)
    in_specs = [
        pl.BlockSpec((None, block_m, None, block_d), lambda r, h, b: (b, r, h, 0)),
        pl.BlockSpec((None, keys_padded, None, block_d), lambda r, h, b: (b, 0, h // G, 0)),
        pl.BlockSpec((None, keys_padded, None, block_d), lambda r, h, b: (b, 0, h // G, 0)),
        pl.BlockSpec((None, block_m, keys_padded), lambda r, h, b: (b, r, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, block_m, None, block_d), lambda r, h, b: (b, r, h, 0)),
        pl.BlockSpec((None, block_m, None), lambda r, h, b: (b, r, h)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, M, H, D), q.dtype), jax.ShapeDtypeStruct((B, M, H), jnp.float32)]
    o, lse = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        name="tree_attention", **pallas_call_options(backend, num_warps=num_warps, num_stages=num_stages),
    )(q, k, v, mask)
    return o, lse


def _tiles(who: str, rows: int, keys: int, head_dim: int, block_m, block_n, num_warps):
    """Row / key tiles (powers of two >= 16; default: the sizes rounded up to a power of two, capped at 64 rows
    and 128 keys) and warps of a tree-attention launch."""
    block_m = min(next_pow2(rows, 16), 64) if block_m is None else block_m
    block_n = min(next_pow2(keys, 16), 128) if block_n is None else block_n
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{who}: {name}={val} must be a power of two >= 16")
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 64 * 128 and head_dim >= 128 else 4
    return block_m, block_n, num_warps


@functools.partial(jax.jit, static_argnames=("scale", "backend", "block_m", "block_n", "num_warps",
                                             "num_stages"))
def tree_attention(q_BxMxHxD, k_BxNxKxD, v_BxNxKxD, mask_BxMxN, *, scale=None, backend=None,
                   block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None):
    """Masked attention of the round's new tokens over the new keys (the speculative half).

    Args:
      q_BxMxHxD: queries. k_BxNxKxD / v_BxNxKxD: new keys / values (K kv heads; query head ``h`` reads kv head
        ``h // (H // K)``). mask_BxMxN: bool, True = may attend (any pattern; all-False rows give o = 0 and
        lse = -inf).
      scale: softmax scale (default ``D ** -0.5``). backend: None/"auto", "triton" or "interpret".
      block_m / block_n: query-row / key tile (powers of two >= 16; default: M and N rounded up to a power of
        two, capped at 64 rows and 128 keys). num_warps / num_stages: Triton launch parameters.
    Returns:
      ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``.
    """
    B, M, H, D = q_BxMxHxD.shape
    _, N, K, Dk = k_BxNxKxD.shape
    if v_BxNxKxD.shape != k_BxNxKxD.shape or Dk != D or k_BxNxKxD.shape[0] != B:
        raise ValueError(f"tree_attention: shapes q {q_BxMxHxD.shape}, k {k_BxNxKxD.shape}, "
                         f"v {v_BxNxKxD.shape} do not match")
    if H % K:
        raise ValueError(f"tree_attention: {H} query heads are not a multiple of {K} kv heads")
    if mask_BxMxN.shape != (B, M, N):
        raise ValueError(f"tree_attention: mask shape {mask_BxMxN.shape} != {(B, M, N)}")
    backend = resolve_backend(backend)
    scale = default_scale(D) if scale is None else scale
    block_m, block_n, num_warps = _tiles("tree_attention", M, N, D, block_m, block_n, num_warps)
    k = k_BxNxKxD.astype(q_BxMxHxD.dtype)
    v = v_BxNxKxD.astype(q_BxMxHxD.dtype)
    return _lower_tree_attention(q_BxMxHxD, k, v, mask_BxMxN.astype(jnp.bool_), scale=scale, backend=backend,
                                 block_m=block_m, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("rows", "scale", "backend", "block_m", "num_warps"))
def tree_attention_merged(q_BxRxKxD, k_BxNxKxD, v_BxNxKxD, mask_BxRxN, o_parts_PxBxRxKxD, lse_parts_PxBxKxR, *,
                          rows: int, scale=None, backend=None, block_m: int | None = None,
                          num_warps: int | None = None):
    """The tree half of folded query rows (:func:`pallas.folding.fold_group`), merged in the same kernel with P
    partial results of the cache half over disjoint key sets (its splits): attention over the cache and the tree.

    Args:
      q_BxRxKxD: folded queries (row ``m * G + g`` of kv head k is query m of head ``k * G + g``); only the
        first ``rows`` rows are used (more may be there: padding for the cache half's row blocks).
      k_BxNxKxD / v_BxNxKxD: the new keys / values. mask_BxRxN: bool, each folded row's row of the tree mask.
      o_parts_PxBxRxKxD: each split's normalised output (any float dtype); lse_parts_PxBxKxR: its float32 LSE,
        ``-inf`` for a split with no keys (its output is then ignored, whatever it holds).
    Returns:
      ``(o_BxRxKxD in q.dtype, lse_BxKxR float32)`` for the first ``rows`` rows.
    """
    B, Rq, K, D = q_BxRxKxD.shape
    N = k_BxNxKxD.shape[1]
    P = o_parts_PxBxRxKxD.shape[0]
    if (k_BxNxKxD.shape != (B, N, K, D) or v_BxNxKxD.shape != k_BxNxKxD.shape or mask_BxRxN.shape != (B, rows, N)
            or o_parts_PxBxRxKxD.shape[1] != B or o_parts_PxBxRxKxD.shape[3:] != (K, D)
            or lse_parts_PxBxKxR.shape[:3] != (P, B, K) or min(Rq, o_parts_PxBxRxKxD.shape[2],
                                                                  lse_parts_PxBxKxR.shape[3]) < rows):
        raise ValueError(f"tree_attention_merged: shapes q {q_BxRxKxD.shape}, k {k_BxNxKxD.shape}, v "
                         f"{v_BxNxKxD.shape}, mask {mask_BxRxN.shape}, o_parts {o_parts_PxBxRxKxD.shape}, "
                         f"lse_parts {lse_parts_PxBxKxR.shape} do not match {rows} rows")
    backend = resolve_backend(backend)
    scale = default_scale(D) if scale is None else scale
    block_m, block_n, num_warps = _tiles("tree_attention_merged", rows, N, D, block_m, None, num_warps)
    block_d = next_pow2(D, 16)
    keys_padded = ceil_div(N, block_n) * block_n
    kernel = functools.partial(_merged_kernel, rows=rows, num_parts=P, head_dim=D, block_m=block_m,
                               block_d=block_d, **_softmax_params(N, block_n, float(scale), q_BxRxKxD.dtype))
    # Grid (row block, kv head, batch): a program's rows share one kv head, so it reads that head's keys once.
    in_specs = [
        pl.BlockSpec((None, block_m, None, block_d), lambda r, k, b: (b, r, k, 0)),
        pl.BlockSpec((None, keys_padded, None, block_d), lambda r, k, b: (b, 0, k, 0)),
        pl.BlockSpec((None, keys_padded, None, block_d), lambda r, k, b: (b, 0, k, 0)),
        pl.BlockSpec((None, block_m, keys_padded), lambda r, k, b: (b, r, 0)),
        pl.BlockSpec((P, None, block_m, None, block_d), lambda r, k, b: (0, b, r, k, 0)),
        pl.BlockSpec((P, None, None, block_m), lambda r, k, b: (0, b, k, r)),
    ]
    out_specs = [
        pl.BlockSpec((None, block_m, None, block_d), lambda r, k, b: (b, r, k, 0)),
        pl.BlockSpec((None, None, block_m), lambda r, k, b: (b, k, r)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, rows, K, D), q_BxRxKxD.dtype),
                 jax.ShapeDtypeStruct((B, K, rows), jnp.float32)]
    dtype = q_BxRxKxD.dtype
    return pl.pallas_call(
        kernel, grid=(ceil_div(rows, block_m), K, B), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        name="tree_attention_merged", **pallas_call_options(backend, num_warps=num_warps),
    )(q_BxRxKxD, k_BxNxKxD.astype(dtype), v_BxNxKxD.astype(dtype), mask_BxRxN.astype(jnp.bool_),
      o_parts_PxBxRxKxD, lse_parts_PxBxKxR.astype(jnp.float32))
