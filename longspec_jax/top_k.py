"""Exact top-k over long rows in stages, for GPUs.

XLA's GPU top-k for small k runs one thread block per row, so a few rows of a 16k-128k vocabulary take
~120 us (H200, 16 rows x 16384, k = 16: docs/benchmarks.md section 7) while the bytes take ~1 us. Here each
row is cut into segments of ``SEGMENT`` values, the top-k of every segment is taken (many short rows: every SM
busy), and the top-k of the surviving ``segments x k`` candidates is taken again, recursively.

The result equals :func:`jax.lax.top_k`, order included: candidates keep the segment order, and within a
segment the order of ``lax.top_k`` (value descending, lower index first among equals), so among equal values
the lower original index still comes first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SEGMENT = 256      # values per segment in a stage
DIRECT_MAX = 2048  # rows up to this long go to lax.top_k in one call


def top_k(x_xV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``(values, indices)`` of the ``k`` largest entries of each row (last axis), exactly as
    :func:`jax.lax.top_k`."""
    V = x_xV.shape[-1]
    if V <= DIRECT_MAX or k > SEGMENT // 4:
        return jax.lax.top_k(x_xV, k)
    segments = -(-V // SEGMENT)
    padded_xV = jnp.pad(x_xV, [(0, 0)] * (x_xV.ndim - 1) + [(0, segments * SEGMENT - V)],
                        constant_values=-jnp.inf)
    seg_values, seg_local = jax.lax.top_k(padded_xV.reshape(*x_xV.shape[:-1], segments, SEGMENT), k)
    seg_index = seg_local + (jnp.arange(segments) * SEGMENT)[:, None]
    lead = x_xV.shape[:-1]
    values, picked = top_k(seg_values.reshape(*lead, segments * k), k)
    return values, jnp.take_along_axis(seg_index.reshape(*lead, segments * k), picked, axis=-1)
