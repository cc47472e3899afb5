"""Greedy losslessness: speculative output equals plain greedy decoding token for token (float32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer import generate
from tests.spec_helpers import oracle_draft, random_draft, tiny_target

# Each scenario is one compiled shape bucket: (tree_shape, batch, prompt lengths, max_new_tokens range).
SCENARIOS = {
    "default-tree-b1": ((4, 16, 16, 16, 16), 1, (1, 16), (33, 64)),
    "chain-b2": ((1, 1, 1, 1), 2, (1, 16), (1, 16)),
    "narrow-b3": ((3, 2, 4), 3, (17, 32), (33, 64)),
    "wide-shallow-b2": ((8, 8), 2, (1, 16), (33, 64)),
}
DRAFT_KINDS = ("random", "oracle", "oracle-noisy")


def _check_output(out, max_new, ref):
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.num_generated, ref.num_generated)
    assert out.tokens.shape == (len(ref.tokens), max_new)
    for row, n in zip(out.tokens, out.num_generated):
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()
    np.testing.assert_array_equal(out.accept_counts.sum(axis=1), out.num_rounds)
    emitted = (out.accept_counts * np.arange(1, out.accept_counts.shape[1] + 1)).sum(axis=1)
    assert (emitted + 1 >= out.num_generated).all()  # EOS / max_new may cut the last round short


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_speculative_greedy_equals_plain_greedy(scenario, data):
    tree_shape, batch, (len_lo, len_hi), (new_lo, new_hi) = SCENARIOS[scenario]
    seed = data.draw(st.integers(0, 2**16), label="seed")
    kind = data.draw(st.sampled_from(DRAFT_KINDS), label="draft")
    max_new = data.draw(st.integers(new_lo, new_hi), label="max_new_tokens")
    rng = np.random.default_rng(seed)
    target = tiny_target(seed % 7)
    prompts = [rng.integers(0, 64, rng.integers(len_lo, len_hi + 1)).tolist() for _ in range(batch)]

    free_run = generate(target, prompts, max_new_tokens=max_new, eos_token_id=[])
    eos = []
    if data.draw(st.booleans(), label="use_eos"):
        row = data.draw(st.integers(0, batch - 1), label="eos_row")
        col = data.draw(st.integers(0, max_new - 1), label="eos_col")
        eos = [int(free_run.tokens[row, col])]
    ref = generate(target, prompts, max_new_tokens=max_new, eos_token_id=eos)

    draft = random_draft(seed % 5)
    if kind != "random":
        draft = oracle_draft(draft, prompts, free_run.tokens, wrong_every=3 if kind == "oracle-noisy" else 0,
                             phase=seed % 3)
    out = generate(target, prompts, draft=draft, max_new_tokens=max_new, eos_token_id=eos, tree_shape=tree_shape)
    _check_output(out, max_new, ref)


def test_oracle_draft_accepts_whole_paths():
    """A perfect draft accepts a full root-to-leaf path every round (and the output is still exact)."""
    target = tiny_target(3)
    prompts = [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    ref = generate(target, prompts, max_new_tokens=61, eos_token_id=[])
    draft = oracle_draft(random_draft(0), prompts, ref.tokens)
    out = generate(target, prompts, draft=draft, max_new_tokens=61, eos_token_id=[], tree_shape=(4, 16, 16, 16, 16))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    # 61 tokens = 1 from prefill + 10 rounds of 6 (5 drafted + bonus): every round accepted the full depth.
    np.testing.assert_array_equal(out.num_rounds, [10, 10])
    np.testing.assert_array_equal(out.accept_counts[:, -1], [10, 10])
    assert out.mean_accepted == pytest.approx(61 / 11)


def test_rows_stop_independently_at_eos():
    target = tiny_target(1)
    prompts = [[3, 4, 5], [10, 20, 30, 40, 50, 60, 1, 2]]
    free = generate(target, prompts, max_new_tokens=40, eos_token_id=[])
    eos = int(free.tokens[0, 6])
    ref = generate(target, prompts, max_new_tokens=40, eos_token_id=[eos])
    draft = oracle_draft(random_draft(2), prompts, free.tokens, wrong_every=4)
    out = generate(target, prompts, draft=draft, max_new_tokens=40, eos_token_id=[eos], tree_shape=(3, 2, 4))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.num_generated[0] <= 7 and out.tokens[0, out.num_generated[0] - 1] == eos
