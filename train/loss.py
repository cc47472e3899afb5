"""Next-token losses through the shared (frozen) LM head, computed in chunks of tokens so that the logits of at
most ``chunk`` tokens exist at once, in the forward and in the backward pass (each chunk is rematerialised)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TokenSums:
    """Sums over the counted tokens (float32 scalars); divide by ``count`` for means."""

    nll: jax.Array       # cross-entropy against the labels
    kl: jax.Array        # KL(target || draft), 0 when no target hidden states are given
    correct: jax.Array   # draft argmax == label
    count: jax.Array     # tokens counted (mask sum)

    def __add__(self, other: "TokenSums") -> "TokenSums":
        return jax.tree.map(jnp.add, self, other)


def _chunk_sums(h_Cxd, w_dxV, labels_C, mask_C, target_h_Cxd):
    logits_CxV = jnp.dot(h_Cxd, w_dxV, preferred_element_type=jnp.float32)
    logp_CxV = jax.nn.log_softmax(logits_CxV, axis=-1)
    picked_C = jnp.take_along_axis(logp_CxV, labels_C[:, None], axis=-1)[:, 0]
    m_C = mask_C.astype(jnp.float32)
    correct_C = (jnp.argmax(logits_CxV, axis=-1) == labels_C).astype(jnp.float32)
    kl = jnp.float32(0)
    if target_h_Cxd is not None:
        target_logp_CxV = jax.nn.log_softmax(jnp.dot(target_h_Cxd, w_dxV, preferred_element_type=jnp.float32), -1)
        kl_C = jnp.sum(jnp.exp(target_logp_CxV) * (target_logp_CxV - logp_CxV), axis=-1)
        kl = jnp.sum(kl_C * m_C)
    return TokenSums(nll=-jnp.sum(picked_C * m_C), kl=kl, correct=jax.lax.stop_gradient(jnp.sum(correct_C * m_C)),
                     count=jnp.sum(m_C))


def chunked_token_sums(h_NxD, w_dxV, labels_N, mask_N, chunk: int, target_h_NxD=None) -> TokenSums:
    """Sums of the next-token losses of N tokens: hidden states ``h`` (predicting ``labels``), LM-head kernel
    ``w [d, V]``, ``mask`` choosing the tokens that count; ``target_h`` (the target's final hidden states at the
    same tokens) adds the KL term. Logits are float32 and exist for ``chunk`` tokens at a time."""
    xs = _chunks((h_NxD, labels_N, mask_N, target_h_NxD), chunk)
    body = jax.checkpoint(lambda x: _chunk_sums(x[0], w_dxV, x[1], x[2], x[3]))
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), jax.lax.map(body, xs))


def chunked_argmax(h_NxD, w_dxV, chunk: int):
    """``argmax(h @ w)`` per token ``[N]`` (int32), the logits of ``chunk`` tokens at a time."""
    N = h_NxD.shape[0]
    best = jax.lax.map(lambda h_Cxd: jnp.argmax(jnp.dot(h_Cxd, w_dxV, preferred_element_type=jnp.float32), axis=-1),
                       _chunks(h_NxD, chunk))
    return best.reshape(-1)[:N].astype(jnp.int32)


def _chunks(tree, chunk: int):
    """Leaves ``[N, ...]`` zero-padded to a multiple of ``min(chunk, N)`` and reshaped ``[n, chunk, ...]``."""
    N = jax.tree.leaves(tree)[0].shape[0]
    chunk = min(chunk, N)
    pad = -N % chunk

    def split(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a
        return a.reshape((a.shape[0] // chunk, chunk) + a.shape[1:])
    return jax.tree.map(split, tree)
