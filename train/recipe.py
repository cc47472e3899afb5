"""The LongSpec training recipe: anchor-offset positions, flash noisy cross-attention and
the draft's training forward over whole sequences.

Draws are per sequence, from a key of its own (the reference draws once per forward call for the whole
micro-batch; per-sequence draws cover the same ranges and do not depend on how a batch is split into
micro-batches or over devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longspec_jax.attention import causal_attention
from longspec_jax.draft import DraftLayer
from train.config import AnchorSection


def offset_ceiling(anchor: AnchorSection, max_positions: int) -> int:
    """The bound of a row's offset plus its length: ``min(offset_ceiling, max_positions - context_margin)``, or
    the whole window ``max_positions - context_margin`` where ``offset_ceiling`` is None."""
    window = max_positions - anchor.context_margin
    return window if anchor.offset_ceiling is None else min(anchor.offset_ceiling, window)


def anchor_offset_positions(keys_B, lengths_B, seq_len: int, anchor: AnchorSection, max_positions: int):
    """Position ids ``[B, T]``: ``0 .. T-1``, except that for sequences of at most ``length_threshold`` tokens
    every position from the anchor count ``a ~ U{0..max_anchors}`` on is shifted by ``o ~ U{0..max_off}``,
    ``max_off = max(offset_ceiling(anchor, max_positions) - length, 0)``. The first ``a`` tokens (the anchors)
    keep positions ``0..a-1``; the rest start at ``a + o``. One key per sequence."""
    ceiling = offset_ceiling(anchor, max_positions)
    t_T = jnp.arange(seq_len, dtype=jnp.int32)

    def one(key, length):
        k_anchor, k_offset = jax.random.split(key)
        anchors = jax.random.randint(k_anchor, (), 0, anchor.max_anchors + 1)
        offset = jax.random.randint(k_offset, (), 0, jnp.maximum(ceiling - length, 0) + 1)
        offset = jnp.where(length <= anchor.length_threshold, offset, 0)
        return t_T + jnp.where(t_T >= anchors, offset, 0)

    return jax.vmap(one)(keys_B, lengths_B)


def noise_shifts(keys_B, max_shift: int):
    """Flash-noise shifts ``s ~ U{1..max_shift}``, one per sequence key, ``[B]`` int32."""
    return jax.vmap(lambda key: jax.random.randint(key, (), 1, max_shift + 1))(keys_B)


def roll_rows(x_BxTx, shift_B):
    """``out[b, t] = x[b, (t + shift[b]) mod T]`` (a negative shift rolls the other way)."""
    T = x_BxTx.shape[1]
    index_BxT = (jnp.arange(T)[None] + shift_B[:, None]) % T
    return jnp.take_along_axis(x_BxTx, index_BxT.reshape(index_BxT.shape + (1,) * (x_BxTx.ndim - 2)), axis=1)


def shifted_cross_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, shift_B, *, impl: str = "auto"):
    """Flash noisy cross-attention: the query at t attends to target keys ``0 .. t - shift[b]``; queries with
    ``t < shift[b]`` see nothing and give 0. Computed as plain causal attention over queries rolled by the
    shift (row i holds query i + s, which may see keys 0..i), rolled back afterwards."""
    o_BxTxHxD = causal_attention(roll_rows(q_BxTxHxD, shift_B), k_BxTxKxD, v_BxTxKxD, impl=impl)
    T = q_BxTxHxD.shape[1]
    seen_BxT = jnp.arange(T)[None] >= shift_B[:, None]
    return jnp.where(seen_BxT[:, :, None, None], roll_rows(o_BxTxHxD, -shift_B), 0).astype(q_BxTxHxD.dtype)


def draft_train_hidden(module: DraftLayer, variables, x_BxTxd, positions_BxT, target_k_BxTxKxD, target_v_BxTxKxD,
                       shift_B, *, impl: str = "auto"):
    """The draft layer over whole sequences: windowed causal self-attention, flash noisy cross-attention into
    the target's last-layer K/V (the same positions as the target's). Returns ``y_BxTxd`` (no final norm)."""
    window = module.config.window
    k_self, v_self = module.apply(variables, x_BxTxd, positions_BxT, method=DraftLayer.self_kv)

    def attend_self(q_BxTxHxD):
        return causal_attention(q_BxTxHxD, k_self, v_self, window=window, impl=impl)

    def attend_cross(q_BxTxHxD):
        return shifted_cross_attention(q_BxTxHxD, target_k_BxTxKxD.astype(q_BxTxHxD.dtype),
                                       target_v_BxTxKxD.astype(q_BxTxHxD.dtype), shift_B, impl=impl)

    return module.apply(variables, x_BxTxd, positions_BxT, attend_self, attend_cross)
