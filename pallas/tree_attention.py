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

__all__ = ["tree_attention"]


def _tree_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, num_queries: int, num_keys: int,
                 head_dim: int, block_m: int, block_n: int, block_d: int, num_key_blocks: int, scale2: float,
                 precision):
    row0 = pl.program_id(0) * block_m
    row_ok = (row0 + jnp.arange(block_m)) < num_queries  # [bm]
    col_ok = jnp.arange(block_d) < head_dim  # [bd]; all True unless head_dim is not a power of two
    need_col_mask = block_d != head_dim

    q_mask = row_ok[:, None] & col_ok[None, :] if need_col_mask else row_ok[:, None]
    q = plt.load(q_ref.at[pl.ds(0, block_m), pl.ds(0, block_d)], mask=q_mask, other=0.0)

    def body(j, carry):
        key0 = j * block_n
        key_ok = (key0 + jnp.arange(block_n)) < num_keys  # [bn]
        kv_mask = key_ok[:, None] & col_ok[None, :] if need_col_mask else key_ok[:, None]
        k = plt.load(k_ref.at[pl.ds(key0, block_n), pl.ds(0, block_d)], mask=kv_mask, other=0.0)
        v = plt.load(v_ref.at[pl.ds(key0, block_n), pl.ds(0, block_d)], mask=kv_mask, other=0.0)
        allowed = plt.load(mask_ref.at[pl.ds(0, block_m), pl.ds(key0, block_n)],
                           mask=row_ok[:, None] & key_ok[None, :], other=False)
        s2 = dot_f32(q, k, trans_b=True, precision=precision) * scale2
        s2 = jnp.where(allowed, s2, -jnp.inf)
        return online_softmax_step(carry, s2, v, precision=precision)

    init = (jnp.full((block_m,), -jnp.inf, jnp.float32), jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, block_d), jnp.float32))
    if num_key_blocks == 1:
        carry = body(0, init)
    else:
        carry = lax.fori_loop(0, num_key_blocks, body, init)
    o, lse = finalize_softmax(*carry)

    o_mask = row_ok[:, None] & col_ok[None, :] if need_col_mask else row_ok[:, None]
    plt.store(o_ref.at[pl.ds(0, block_m), pl.ds(0, block_d)], o.astype(o_ref.dtype), mask=o_mask)
    plt.store(lse_ref.at[pl.ds(0, block_m)], lse, mask=row_ok)


def _lower_tree_attention(q, k, v, mask, *, scale: float, backend: str, block_m: int, block_n: int,
                          num_warps: int | None, num_stages: int | None):
    """The one place that builds the tree-attention ``pallas_call`` for a resolved backend."""
    B, M, H, D = q.shape
    N, K = k.shape[1], k.shape[2]
    G = H // K
    block_d = next_pow2(D, 16)
    num_row_blocks = ceil_div(M, block_m)
    num_key_blocks = ceil_div(N, block_n)
    keys_padded = num_key_blocks * block_n

    kernel = functools.partial(
        _tree_kernel, num_queries=M, num_keys=N, head_dim=D, block_m=block_m, block_n=block_n,
        block_d=block_d, num_key_blocks=num_key_blocks, scale2=float(scale) * LOG2E,
        precision=dot_precision(q.dtype))
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
    block_m = min(next_pow2(M, 16), 64) if block_m is None else block_m
    block_n = min(next_pow2(N, 16), 128) if block_n is None else block_n
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"tree_attention: {name}={val} must be a power of two >= 16")
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 64 * 128 and D >= 128 else 4
    k = k_BxNxKxD.astype(q_BxMxHxD.dtype)
    v = v_BxNxKxD.astype(q_BxMxHxD.dtype)
    return _lower_tree_attention(q_BxMxHxD, k, v, mask_BxMxN.astype(jnp.bool_), scale=scale, backend=backend,
                                 block_m=block_m, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages)
