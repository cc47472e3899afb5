"""Rotary position embeddings (HF "rotate_half" convention) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from longspec_jax.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies ``[head_dim // 2]`` (float32), scaled as the config says."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (rope.theta ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, rope)
    return inv_freq.astype(np.float32)


def _llama3_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables ``[..., head_dim]`` (float32) for integer ``positions [...]``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxTxHxD: jnp.ndarray, cos_BxTxD: jnp.ndarray, sin_BxTxD: jnp.ndarray) -> jnp.ndarray:
    """Rotates ``x`` by the tables (computed in float32, returned in x's dtype)."""
    x = x_BxTxHxD.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BxTxD[:, :, None, :] + rotated * sin_BxTxD[:, :, None, :]
    return out.astype(x_BxTxHxD.dtype)
