"""infer.bench.near_tie: first divergence of two token streams and the float32 top-2 logit gap after a prefix."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from infer.bench.near_tie import (earliest_parting, first_divergence, float32_reference, greedy_top2_gaps,
                                  lossless_cell, parting, partings, top2_logit_gap)
from longspec_jax.testing import tiny_target
from longspec_jax.kv_cache import init_cache
from longspec_jax.target import forward, lm_head_logits


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3, 4], [1, 2, 3]) is None  # common length only
    assert first_divergence([1, 5, 3], [1, 2, 4]) == 1
    assert first_divergence(np.array([7, 2]), np.array([1, 2])) == 0


def test_top2_logit_gap_is_the_gap_after_the_last_prefix_token():
    target = tiny_target(0)
    cfg = target.config
    prefix = np.random.default_rng(3).integers(0, cfg.vocab_size, 37).tolist()
    gap = top2_logit_gap(target, prefix, chunk=16)  # 3 chunks, the last one mostly padding
    # Direct: one causal forward over exactly the prefix, dense attention.
    T = len(prefix)
    cache = init_cache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    hidden, _ = forward(target.params, cfg, jnp.asarray([prefix], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
                        cache, jnp.tril(jnp.ones((1, T, T), bool)), impl="naive")
    logits = np.asarray(lm_head_logits(target.params, hidden[:, -1:])[0, 0])
    top2 = np.sort(logits)[-2:]
    assert gap > 0
    np.testing.assert_allclose(gap, top2[1] - top2[0], rtol=1e-5, atol=1e-5)


def test_greedy_top2_gaps_follow_the_greedy_path():
    """Each step's token is the greedy one and its gap the top-2 gap after the prompt plus the tokens before it."""
    target = tiny_target(1)
    prompt = np.random.default_rng(4).integers(0, target.config.vocab_size, 21).tolist()
    tokens, gaps = greedy_top2_gaps(target, prompt, 5, chunk=16)
    assert tokens.shape == gaps.shape == (5,)
    from infer import generate
    ref = generate(target, [prompt], max_new_tokens=5, eos_token_id=[], attention="xla")
    np.testing.assert_array_equal(tokens, np.asarray(ref.tokens[0][:5]))
    for i in (0, 4):
        np.testing.assert_allclose(gaps[i], top2_logit_gap(target, prompt + tokens[:i].tolist(), chunk=16),
                                   rtol=1e-5, atol=1e-5)


def test_parting_measures_the_gap_where_an_output_leaves_the_reference():
    target = tiny_target(2)
    prompt = np.random.default_rng(5).integers(0, target.config.vocab_size, 19).tolist()
    ref, gaps = greedy_top2_gaps(target, prompt, 6, chunk=16)
    assert parting(target, prompt, ref.tolist(), ref.tolist()) is None
    ours = ref.tolist()
    ours[3] = (ours[3] + 1) % target.config.vocab_size
    p = parting(target, prompt, ours, ref.tolist(), tolerance=float(gaps[3]) + 1e-3)
    assert p["at"] == 3 and p["near_tie"]
    np.testing.assert_allclose(p["f32_top2_gap"], gaps[3], rtol=1e-5, atol=1e-5)
    assert not parting(target, prompt, ours, ref.tolist(), tolerance=float(gaps[3]) - 1e-3)["near_tie"]


def test_lossless_cell():
    near, bad = dict(at=3, f32_top2_gap=0.01, near_tie=True), dict(at=9, f32_top2_gap=2.0, near_tie=False)
    assert lossless_cell([None, None]) == "2/2"
    assert lossless_cell([None, near]) == "1/2 (1 near-tie)"
    assert lossless_cell([near, bad, None]) == "1/3 (1 near-tie, 1 NOT a near-tie)"


def test_partings_earliest_and_the_lazy_reference():
    target = tiny_target(2)
    prompt = np.random.default_rng(6).integers(0, target.config.vocab_size, 11).tolist()
    ref = greedy_top2_gaps(target, prompt, 5, chunk=16)[0].tolist()
    loads = []
    load = float32_reference(None, target)
    counted = lambda: loads.append(1) or load()  # noqa: E731
    assert partings(counted, [prompt] * 2, [ref, ref], [ref, ref]) == [None, None] and not loads  # never loaded
    late, early = list(ref), list(ref)
    V = target.config.vocab_size
    late[4], early[1] = (ref[4] + 1) % V, (ref[1] + 1) % V
    rows = partings(counted, [prompt] * 3, [ref, late, early], [ref] * 3)
    assert rows[0] is None and rows[1]["at"] == 4 and rows[2]["at"] == 1 and len(loads) == 1
    assert earliest_parting(rows) is rows[2] and earliest_parting([None, None]) is None
    assert load() is target  # path None: the (float32) model itself
