"""Lowering choice and small in-kernel helpers shared by the Pallas attention kernels.

Every kernel in this package builds its ``pallas_call`` through :func:`pallas_call_options`, so the choice of
lowering (Triton on GPU, the HLO interpreter on CPU, later Mosaic GPU) lives in one place. All differences
between the JAX versions we support (0.10 and 0.11) are guarded here too.

Backends:
  ``"triton"``     Pallas Triton lowering (GPU). Deprecated in JAX 0.11 in favour of Mosaic GPU, but present.
  ``"interpret"``  ``interpret=True``: the kernel body runs as ordinary XLA ops (any device; used on CPU).
A Mosaic GPU version of the kernels would be added here as a third backend (not written yet).
``None`` / ``"auto"`` picks ``"triton"`` when JAX's default backend is a GPU and ``"interpret"`` otherwise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

BACKENDS = ("triton", "interpret")

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

__all__ = ["BACKENDS", "resolve_backend", "pallas_call_options", "triton_compiler_params",
           "dot_f32", "dot_precision", "online_softmax_step", "finalize_softmax"]


def resolve_backend(backend: str | None = None) -> str:
    """``None``/``"auto"`` -> ``"triton"`` on GPU, ``"interpret"`` elsewhere; validates explicit names."""
    if backend is None or backend == "auto":
        return "triton" if jax.default_backend() == "gpu" else "interpret"
    if backend not in BACKENDS:
        raise ValueError(f"unknown Pallas backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    return backend


def triton_compiler_params(num_warps: int | None = None, num_stages: int | None = None):
    """Triton ``CompilerParams`` (the class lives in ``jax.experimental.pallas.triton`` in 0.10 and 0.11).

    Passing this object is also what selects the Triton lowering on JAX 0.11, where a ``pallas_call``
    without compiler params may default to Mosaic GPU (``jax_pallas_use_mosaic_gpu``).
    """
    try:
        from jax.experimental.pallas import triton as plt
        cls = plt.CompilerParams
    except (ImportError, AttributeError):  # older spellings, kept for safety
        from jax.experimental import pallas as pl
        cls = getattr(pl, "TritonCompilerParams", None) or getattr(pl, "GPUCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def pallas_call_options(backend: str, *, num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """Keyword arguments for ``pl.pallas_call`` that select the lowering of a resolved ``backend``."""
    if backend == "interpret":
        return {"interpret": True}
    if backend == "triton":
        return {"compiler_params": triton_compiler_params(num_warps, num_stages)}
    raise ValueError(f"backend {backend!r} has no pallas_call lowering here")


# ----------------------------------------------------------------------------------------------------------
# In-kernel helpers (traced inside the kernel bodies; restricted to ops the Triton lowering supports).


def dot_precision(dtype):
    """float32 operands get full-precision (IEEE) dots; Triton would otherwise use TF32 for them."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot_f32(a, b, *, trans_b: bool = False, precision=None):
    """2-D ``a @ b`` (or ``a @ b.T``) with float32 accumulation, written with ``lax.dot_general`` directly
    (``pl.dot`` is deprecated in JAX 0.11; ``dot_general`` lowers the same way on Triton)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(carry, s2, v, *, precision=None):
    """One FlashAttention-2 update with base-2 scores ``s2`` ([rows, keys], float32, -inf = masked).

    ``carry = (m, l, acc)`` with ``m`` the running max of ``s2`` (-inf while nothing was seen), ``l`` the
    running sum of ``exp2(s2 - m)`` and ``acc`` the unnormalised output. NaN-free when whole rows are masked.
    """
    m_prev, l_prev, acc = carry
    m_new = jnp.maximum(m_prev, jnp.max(s2, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_use)  # m_prev = -inf -> 0
    p = jnp.exp2(s2 - m_use[:, None])  # masked (-inf) -> 0
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v, precision=precision)
    return m_new, l_new, acc


def finalize_softmax(m, l, acc):
    """``(o, lse)`` from an online-softmax carry: normalised output (0 for empty rows) and the natural-log
    LSE of the *unscaled-by-log2e* scores (``-inf`` for empty rows)."""
    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    o = acc / l_safe[:, None]
    lse = jnp.where(has, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
    return o, lse
