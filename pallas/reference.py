"""Pure-jnp references for the Pallas kernels (same signatures and conventions).

Layouts: ``q_BxMxHxD``, keys/values ``[B, N, K, D]`` (K kv heads; query head ``h`` reads kv head
``h // (H // K)``). LSE is the float32 natural log of ``sum_j exp(scale * q.k_j)`` over allowed keys; a query
with no allowed key gets output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import jax.numpy as jnp


def default_scale(head_dim: int) -> float:
    return head_dim ** -0.5


def check_cache_operands(name: str, q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B) -> None:
    """Clear errors (prefixed with ``name``) for cache-half operands that do not fit together."""
    B, M, H, D = q_BxMxHxD.shape
    k, v = k_cache_BxSxKxD, v_cache_BxSxKxD
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"{name}: q {q_BxMxHxD.shape}, k_cache {k.shape}, v_cache {v.shape} "
                         "do not match ([B, M, H, D] and [B, S, K, D])")
    if H % k.shape[2]:
        raise ValueError(f"{name}: {H} query heads are not a multiple of {k.shape[2]} kv heads")
    if lengths_B.shape != (B,):
        raise ValueError(f"{name}: lengths shape {lengths_B.shape} != {(B,)}")


def masked_attention_reference(q_BxMxHxD, k_BxNxKxD, v_BxNxKxD, mask_BxMxN, scale=None):
    """Dense masked attention, float32 softmax. Returns ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``."""
    B, M, H, D = q_BxMxHxD.shape
    K = k_BxNxKxD.shape[2]
    scale = default_scale(D) if scale is None else scale
    q = q_BxMxHxD.reshape(B, M, K, H // K, D)
    s = jnp.einsum("bmkgd,bnkd->bkgmn", q, k_BxNxKxD, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask_BxMxN[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    denom = jnp.sum(p, axis=-1)
    o = jnp.einsum("bkgmn,bnkd->bmkgd", p.astype(v_BxNxKxD.dtype), v_BxNxKxD,
                   preferred_element_type=jnp.float32)
    denom_bmkg = jnp.moveaxis(denom, -1, 1)
    o = o / jnp.where(denom_bmkg > 0, denom_bmkg, 1.0)[..., None]
    lse = jnp.log(denom_bmkg) + jnp.moveaxis(m_safe[..., 0], -1, 1)
    return o.reshape(B, M, H, D).astype(q_BxMxHxD.dtype), lse.reshape(B, M, H)


def cache_attention_reference(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, scale=None):
    """Every query sees cache slots ``[0, lengths[b])``. Dense (memory ``B*H*M*S``)."""
    S = k_cache_BxSxKxD.shape[1]
    M = q_BxMxHxD.shape[1]
    valid_BxS = jnp.arange(S)[None, :] < lengths_B[:, None]
    mask = jnp.broadcast_to(valid_BxS[:, None, :], (q_BxMxHxD.shape[0], M, S))
    return masked_attention_reference(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, mask, scale)


def merge_partials(o_Px, lse_Px):
    """Exact softmax over the union of P disjoint key sets, from each set's normalised output ``o_Px [P, ..., D]``
    and float32 LSE ``lse_Px [P, ...]`` (an empty set has LSE ``-inf`` and weight 0). Returns float32
    ``(o [..., D], lse [...])``; the one LSE merge of the project (splits of the cache half, cache + tree halves).
    """
    m = jnp.max(lse_Px, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_Px - m_safe[None])  # -inf -> 0
    denom = jnp.sum(w, axis=0)
    safe = jnp.where(denom > 0, denom, 1.0)
    o = jnp.sum(w[..., None] * o_Px.astype(jnp.float32), axis=0) / safe[..., None]
    lse = jnp.where(denom > 0, m_safe + jnp.log(safe), -jnp.inf)
    return o, lse
