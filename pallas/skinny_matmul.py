"""Weight-streaming matmul for a few rows: ``x [..., K] @ w [K, N]`` with at most 128 rows of x.

A verification pass multiplies ~70 tree tokens by every weight matrix; XLA splits K for such shapes (to fill the
GPU) and writes float32 partials that later kernels sum. Here one program owns a block of output columns and all
rows: it streams its ``[K, block_n]`` slice of the weights once, accumulates in float32 registers and writes the
output in x's dtype. The column blocks are the parallelism (``N / block_n`` programs), so nothing is written twice.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas.backend import dot_f32, dot_precision, pallas_call_options, resolve_backend
from pallas.sizes import next_pow2

__all__ = ["MAX_ROWS", "SkinnyConfig", "skinny_matmul", "skinny_supported"]

MAX_ROWS = 128  # all rows live in one register tile


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: output columns and reduction depth per step (powers of two >= 16), Triton warps and
    pipeline stages."""
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"skinny_matmul: {name}={val} must be a power of two >= 16")


def skinny_supported(rows: int, in_features: int, out_features: int, config: SkinnyConfig | None = None) -> bool:
    """Whether :func:`skinny_matmul` takes this shape: 1..128 rows and K, N multiples of the config's blocks."""
    cfg = SkinnyConfig() if config is None else config
    return 0 < rows <= MAX_ROWS and in_features % cfg.block_k == 0 and out_features % cfg.block_n == 0


def _kernel(x_ref, w_ref, o_ref, *, rows: int, block_m: int, block_k: int, num_k_blocks: int, precision):
    row_ok = (jnp.arange(block_m) < rows)[:, None]

    def step(i, acc_MxN):
        k0 = pl.multiple_of(i * block_k, block_k)
        x_MxB = plt.load(x_ref.at[pl.ds(0, block_m), pl.ds(k0, block_k)], mask=row_ok, other=0.0)
        w_BxN = plt.load(w_ref.at[pl.ds(k0, block_k), :])
        return acc_MxN + dot_f32(x_MxB, w_BxN, precision=precision)

    acc_MxN = lax.fori_loop(0, num_k_blocks, step, jnp.zeros((block_m, o_ref.shape[1]), jnp.float32))
    plt.store(o_ref.at[pl.ds(0, block_m), :], acc_MxN.astype(o_ref.dtype), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def skinny_matmul(x, w_KxN, *, config: SkinnyConfig | None = None, backend: str | None = None):
    """``x @ w`` for ``x [..., K]`` with at most 128 rows in all (the leading dims' product) and a 2-D weight:
    float32 accumulation, the result in x's dtype (as ``jnp.dot`` of two bf16 arrays).

    config: :class:`SkinnyConfig` (default: 32 columns, 128-deep steps, 4 warps, 4 stages); K and N must be
    multiples of its blocks (:func:`skinny_supported`). backend: None/"auto", "triton" or "interpret".
    """
    *lead, K = x.shape
    rows = math.prod(lead)
    cfg = SkinnyConfig() if config is None else config
    if w_KxN.ndim != 2 or w_KxN.shape[0] != K:
        raise ValueError(f"skinny_matmul: x {x.shape} and weight {w_KxN.shape} do not chain")
    if not skinny_supported(rows, K, w_KxN.shape[1], cfg):
        raise ValueError(f"skinny_matmul: {rows} rows x {K} -> {w_KxN.shape[1]} needs 1..{MAX_ROWS} rows and K, N "
                         f"multiples of {cfg.block_k}, {cfg.block_n}")
    N = w_KxN.shape[1]
    block_m = next_pow2(rows, 16)
    kernel = functools.partial(_kernel, rows=rows, block_m=block_m, block_k=cfg.block_k,
                               num_k_blocks=K // cfg.block_k, precision=dot_precision(x.dtype))
    out = pl.pallas_call(
        kernel, grid=(N // cfg.block_n,),
        in_specs=[pl.BlockSpec((block_m, K), lambda j: (0, 0)),  # overhangs the rows: loads and stores are masked
                  pl.BlockSpec((K, cfg.block_n), lambda j: (0, j))],
        out_specs=pl.BlockSpec((block_m, cfg.block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, N), x.dtype), name="skinny_matmul",
        **pallas_call_options(resolve_backend(backend), num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(x.reshape(rows, K), w_KxN.astype(x.dtype))
    return out.reshape(*lead, N)
