"""The training recipe: anchor-offset positions, the target's K/V at those positions, flash noisy cross-attention
(its visibility and its gradients), and the draft's training forward against the torch reference layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from longspec_jax import load_target
from longspec_jax.target import causal_forward
from pallas.reference import masked_attention_reference
from tests.conftest import build_hf_model, save_hf_model
from tests.test_draft import WINDOW, random_draft, random_inputs, target_config, torch_draft
from tests.torch_reference_draft import draft_logits
from train.config import AnchorSection
from train.recipe import (anchor_offset_positions, draft_train_hidden, noise_shifts, offset_ceiling,
                          shifted_cross_attention)

MAX_POSITIONS = 32768


def _split_form(row: np.ndarray) -> tuple[int, int]:
    """(anchors, offset) of a row ``0..a-1, a+o, a+o+1, ...`` (a = first index where the row jumps)."""
    jumps = np.nonzero(np.diff(row) != 1)[0]
    assert len(jumps) <= 1 and (np.diff(row) >= 1).all(), row
    if row[0] != 0:  # no anchor: the whole row is shifted
        assert not len(jumps)
        return 0, int(row[0])
    if not len(jumps):
        return len(row), 0
    a = int(jumps[0]) + 1
    return a, int(row[a] - a)


def test_anchor_offset_positions_have_the_documented_form():
    anchor = AnchorSection()
    B, T = 2048, 64
    lengths = np.full(B, T)
    lengths[:256] = 1500  # over the 1200-token threshold: plain positions
    keys = jax.random.split(jax.random.PRNGKey(0), B)
    pos = np.asarray(anchor_offset_positions(keys, jnp.asarray(lengths), T, anchor, MAX_POSITIONS))
    assert pos.shape == (B, T) and pos.dtype == np.int32
    np.testing.assert_array_equal(pos[:256], np.broadcast_to(np.arange(T), (256, T)))
    max_off = min(anchor.offset_ceiling, MAX_POSITIONS - anchor.context_margin) - T
    anchors, offsets = zip(*(_split_form(row) for row in pos[256:]))
    offsets = np.asarray(offsets)
    # positions before the anchor count are 0..a-1; after it one constant offset in [0, max_off]
    assert offsets.min() >= 0 and offsets.max() <= max_off and offsets.max() > 0.95 * max_off
    shifted = np.asarray(anchors)[offsets > 0]
    assert set(np.unique(shifted)) == set(range(anchor.max_anchors + 1))  # 0..4 anchors, each drawn
    assert np.bincount(shifted).min() > 0.1 * len(shifted)
    # the ceiling binds long rows (max_off = 0 for a row at the ceiling) and the draws are per sequence
    at_ceiling = anchor_offset_positions(jax.random.split(jax.random.PRNGKey(1), 4), jnp.full((4,), 1000), 8,
                                         AnchorSection(offset_ceiling=1000, length_threshold=2000), MAX_POSITIONS)
    np.testing.assert_array_equal(at_ceiling, np.broadcast_to(np.arange(8), (4, 8)))
    assert len({tuple(r) for r in pos[256:264]}) == 8


def test_offsets_without_a_ceiling_cover_the_whole_window():
    """``offset_ceiling=None`` draws offsets over the target's whole window less the margin: at a 128k window,
    about half of the rows reach past 64k; the recipe's ceiling of 30000 keeps every row below it."""
    window, B, T = 131072, 4096, 64
    keys, lengths = jax.random.split(jax.random.PRNGKey(0), B), jnp.full((B,), T)
    whole = AnchorSection(offset_ceiling=None)
    assert offset_ceiling(whole, window) == window - whole.context_margin
    assert offset_ceiling(AnchorSection(), window) == 30000 and offset_ceiling(AnchorSection(), 20000) == 19000
    pos = np.asarray(anchor_offset_positions(keys, lengths, T, whole, window))
    offsets = np.asarray([_split_form(row)[1] for row in pos])
    max_off = window - whole.context_margin - T
    assert pos.dtype == np.int32 and offsets.max() <= max_off and offsets.max() > 0.99 * max_off
    assert pos.max() < window - whole.context_margin and 0.4 < (pos.max(axis=1) > 65536).mean() < 0.6
    assert np.asarray(anchor_offset_positions(keys, lengths, T, AnchorSection(), window)).max() < 30000


def test_noise_shifts_cover_one_to_max():
    s = np.asarray(noise_shifts(jax.random.split(jax.random.PRNGKey(0), 4000), 4))
    assert set(np.unique(s)) == {1, 2, 3, 4} and np.bincount(s)[1:].min() > 800


def test_target_kv_carry_rope_at_anchor_positions(tmp_path):
    """The K/V the draft cross-attends to are the target's own at the anchor-offset positions (transformers'
    cache keys after a forward with the same position ids)."""
    model = build_hf_model("llama-gqa-llama3", seed=3)
    target = load_target(save_hf_model(model, tmp_path / "t"), dtype=jnp.float32, load_tokenizer=False)
    B, T = 2, 24
    tokens = np.random.default_rng(0).integers(0, target.config.vocab_size, (B, T))
    positions = np.stack([np.r_[np.arange(2), 2 + 700 + np.arange(T - 2)], np.r_[0, 1 + 2500 + np.arange(T - 1)]])
    k, v, _ = causal_forward(target.params, target.config, jnp.asarray(tokens), jnp.asarray(positions))
    with torch.no_grad():
        out = model(torch.as_tensor(tokens), position_ids=torch.as_tensor(positions), use_cache=True)
    layer = out.past_key_values.layers[-1]
    np.testing.assert_allclose(k, layer.keys.transpose(1, 2).numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(v, layer.values.transpose(1, 2).numpy(), atol=1e-4, rtol=0)
    plain, _, _ = causal_forward(target.params, target.config, jnp.asarray(tokens),
                                 jnp.broadcast_to(jnp.arange(T), (B, T)))
    assert np.abs(np.asarray(plain)[:, 3:] - np.asarray(k)[:, 3:]).max() > 0.1  # the offset rotates the keys


def _random_qkv(seed: int, B=2, T=12, H=4, K=2, D=8):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, T, K, D)),
            jax.random.normal(kv, (B, T, K, D)))


@pytest.mark.slow
def test_noisy_cross_attention_sees_keys_up_to_t_minus_s():
    q, k, v = _random_qkv(0)
    B, T = q.shape[:2]
    shift = jnp.asarray([1, 4])
    o = shifted_cross_attention(q, k, v, shift, impl="xla")
    t, j = np.arange(T)[:, None], np.arange(T)[None]
    mask = jnp.asarray(np.stack([j <= t - s for s in (1, 4)]))
    ref, _ = masked_attention_reference(q, k, v, mask)
    np.testing.assert_allclose(o, ref, atol=1e-5, rtol=0)
    assert float(jnp.abs(o[1, :4]).max()) == 0.0 and float(jnp.abs(o[0, :1]).max()) == 0.0  # rows t < s are 0


@pytest.mark.parametrize("s", [1, 3])
def test_query_gets_no_gradient_from_keys_after_t_minus_s(s):
    q, k, v = _random_qkv(1, B=1)
    T = q.shape[1]
    shift = jnp.asarray([s])

    def out_row(k_, t):
        return jnp.sum(shifted_cross_attention(q, k_, v, shift, impl="xla")[0, t])

    for t in range(T):
        grad_k = np.asarray(jax.grad(out_row)(k, t))[0]  # [T keys, K, D]
        per_key = np.abs(grad_k).sum(axis=(1, 2))
        assert (per_key[max(t - s + 1, 0):] == 0).all(), (t, per_key)
        if t - s >= 1:
            assert (per_key[:t - s + 1] > 0).all(), (t, per_key)
    # and the queries before the shift get no gradient at all
    grad_q = jax.grad(lambda q_: jnp.sum(shifted_cross_attention(q_, k, v, shift, impl="xla") ** 2))(q)
    assert float(jnp.abs(grad_q[0, :s]).max()) == 0.0 and float(jnp.abs(grad_q[0, s:]).max()) > 0


@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-mqa"])
def test_draft_training_forward_matches_torch_reference(name, shift):
    """Whole-sequence training forward (windowed self-attention, noisy cross-attention, anchor-offset RoPE)
    against the torch layer written from the PyTorch LongSpec code with the same masks."""
    config = target_config(name)
    draft = random_draft(config, seed=2)
    from longspec_jax.draft_io import hf_config_from_target_config
    hf = hf_config_from_target_config(config)
    tokens, embed, lm_head, tk, tv = random_inputs(config, batch=2, length=40, seed=5)
    T = tokens.shape[1]
    positions = np.stack([np.r_[np.arange(3), 3 + 900 + np.arange(T - 3)], np.arange(T)])
    y = draft_train_hidden(draft.module, draft.variables, jnp.asarray(embed)[tokens], jnp.asarray(positions),
                           jnp.asarray(tk), jnp.asarray(tv), jnp.full((2,), shift), impl="xla")
    ours = np.asarray(jnp.dot(y, lm_head, precision="highest"))
    model = torch_draft(draft, hf)
    for b in range(2):
        ref = draft_logits(model, hf, tokens[b:b + 1], embed, lm_head.T.copy(), tk[b:b + 1], tv[b:b + 1],
                           window=WINDOW, cross_gap=shift, rope_positions_T=positions[b]).numpy()
        np.testing.assert_allclose(ours[b:b + 1], ref, atol=1e-4, rtol=0)
