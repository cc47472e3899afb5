"""Small building blocks shared by the target and the draft: RMSNorm and linear maps."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
    """HF Llama/Qwen2 RMSNorm: normalise in float32, cast back to x's dtype, then scale by ``weight``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x, kernel_INxOUT, bias_OUT=None):
    """``x @ kernel (+ bias)``; kernels are stored ``[in, out]``."""
    y = jnp.dot(x, kernel_INxOUT)
    return y if bias_OUT is None else y + bias_OUT

