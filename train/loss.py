"""Next-token losses through the shared (frozen) LM head, computed in chunks of tokens so that the logits of at
most ``chunk`` tokens exist at once, in the forward and in the backward pass (each chunk is rematerialised).

With a draft vocabulary (K sorted token ids) the draft's logits are the head's K columns, as it proposes at load
time. A token whose label is outside K adds no cross-entropy (it still counts, and is never correct), so the
optimum is the data's next-token distribution p restricted to K and renormalised: it puts q >= p on every id of
K, which maximises the T = 1 acceptance sum_K min(p, q). An extra bucket for the mass outside K would need a logit
the frozen head lacks (a new weight no export carries, or the V - K other columns this loss skips), and the
proposal renormalises over K anyway, so the bucket would only spend capacity on the split between K and the rest.
The KL term is that masked cross-entropy in expectation over the target's own next token, less its minimum:
sum_K p log(p / (P_K q)) = P_K KL(p_K || q), with p_K the target's p renormalised over K and P_K its mass there
(from the target's full logits). It is zero at q = p_K and weighs a position, as the labels do, by the chance that
its token is in K, the most it can accept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from longspec_jax.draft_vocab import DraftVocab, vocab_columns


@struct.dataclass
class TokenSums:
    """Sums over the counted tokens (float32 scalars); divide by ``count`` for means."""

    nll: jax.Array       # cross-entropy against the labels
    kl: jax.Array        # KL(target || draft), 0 when no target hidden states are given
    correct: jax.Array   # draft argmax == label
    count: jax.Array     # tokens counted (mask sum)

    def __add__(self, other: "TokenSums") -> "TokenSums":
        return jax.tree.map(jnp.add, self, other)


def _chunk_sums(h_Cxd, w_dxK, cols_C, mask_C, target_h_Cxd, w_dxV, ids_K):
    """The sums of C tokens; ``cols``: each label's column of ``w_dxK`` (-1: none), ``ids``: the columns' token
    ids (``None``: ``w_dxK`` is the whole head ``w_dxV``)."""
    logits_CxK = jnp.dot(h_Cxd, w_dxK, preferred_element_type=jnp.float32)
    logp_CxK = jax.nn.log_softmax(logits_CxK, axis=-1)
    picked_C = jnp.take_along_axis(logp_CxK, jnp.maximum(cols_C, 0)[:, None], axis=-1)[:, 0]
    m_C = mask_C.astype(jnp.float32)
    correct_C = (jnp.argmax(logits_CxK, axis=-1) == cols_C).astype(jnp.float32)
    kl = jnp.float32(0)
    if target_h_Cxd is not None:
        target_logp_CxV = jax.nn.log_softmax(jnp.dot(target_h_Cxd, w_dxV, preferred_element_type=jnp.float32), -1)
        target_logp_CxK, log_mass_Cx1 = target_logp_CxV, 0.0
        if ids_K is not None:
            target_logp_CxK = jnp.take(target_logp_CxV, ids_K, axis=1)
            log_mass_Cx1 = jax.nn.logsumexp(target_logp_CxK, axis=-1, keepdims=True)
        kl_C = jnp.sum(jnp.exp(target_logp_CxK) * (target_logp_CxK - log_mass_Cx1 - logp_CxK), axis=-1)
        kl = jnp.sum(kl_C * m_C)
    nll = -jnp.sum(jnp.where(cols_C >= 0, picked_C, 0.0) * m_C)
    return TokenSums(nll=nll, kl=kl, correct=jax.lax.stop_gradient(jnp.sum(correct_C * m_C)), count=jnp.sum(m_C))


def chunked_token_sums(h_NxD, w_dxV, labels_N, mask_N, chunk: int, target_h_NxD=None,
                       vocab: DraftVocab | None = None) -> TokenSums:
    """Sums of the next-token losses of N tokens: hidden states ``h`` (predicting ``labels``), LM-head kernel
    ``w [d, V]``, ``mask`` choosing the tokens that count; ``target_h`` (the target's final hidden states at the
    same tokens) adds the KL term; ``vocab`` puts every term over its columns (``vocab.head``, the module's
    docstring says how). Logits are float32 and exist for ``chunk`` tokens at a time."""
    w_dxK, cols_N, ids_K = (w_dxV, labels_N, None) if vocab is None else (
        vocab.head, vocab_columns(vocab.ids, labels_N), vocab.ids)
    xs = _chunks((h_NxD, cols_N, mask_N, target_h_NxD), chunk)
    body = jax.checkpoint(lambda x: _chunk_sums(x[0], w_dxK, x[1], x[2], x[3], w_dxV, ids_K))
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), jax.lax.map(body, xs))


def chunked_argmax(h_NxD, w_dxV, chunk: int, vocab: DraftVocab | None = None):
    """``argmax(h @ w)`` per token ``[N]`` (int32), the logits of ``chunk`` tokens at a time; with ``vocab``, the
    token id of the argmax over its columns."""
    N = h_NxD.shape[0]
    w_dxK = w_dxV if vocab is None else vocab.head
    best = jax.lax.map(lambda h_Cxd: jnp.argmax(jnp.dot(h_Cxd, w_dxK, preferred_element_type=jnp.float32), axis=-1),
                       _chunks(h_NxD, chunk))
    best_N = best.reshape(-1)[:N].astype(jnp.int32)
    return best_N if vocab is None else vocab.ids[best_N]


def _chunks(tree, chunk: int):
    """Leaves ``[N, ...]`` zero-padded to a multiple of ``min(chunk, N)`` and reshaped ``[n, chunk, ...]``."""
    N = jax.tree.leaves(tree)[0].shape[0]
    chunk = min(chunk, N)
    pad = -N % chunk

    def split(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a
        return a.reshape((a.shape[0] // chunk, chunk) + a.shape[1:])
    return jax.tree.map(split, tree)
