"""Greedy losslessness: speculative output equals plain greedy decoding token for token (float32, CPU).

The property test runs seeded cases per shape bucket, stratified over the draft (from a perfect oracle to the
random draft: the oracle left unsteered at a share of positions, so that acceptance lengths vary) and over where
EOS first appears (nowhere, or in the early, middle or late third of the output). It counts what the cases
exercised (speculative rounds, full-depth acceptance, every acceptance length, where EOS stopped) and asserts
the shares, so the cases cannot quietly stop reaching them.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from infer import generate
from infer.decoding import StopCriteria
from infer.generate import pad_prompts, plan_speculative, run_speculative
from infer.speculative import (VERIFY_NODE_MULTIPLE, exact_acceptance, pad_tree_nodes, speculative_start, verify,
                               verify_and_commit)
from longspec_jax.draft import draft_root
from longspec_jax.sampling import MIN_TEMPERATURE, SamplingConfig
from longspec_jax.tree import build_tree
from tests.spec_helpers import noisy_oracle_draft, oracle_draft, random_draft, record_tree_passes, tiny_target


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One compiled shape bucket."""

    tree_shape: tuple[int, ...]
    batch: int
    prompt_lengths: tuple[int, int]
    max_new: tuple[int, int]


SCENARIOS = {
    "default-tree-b1": Scenario((4, 16, 16, 16, 16), 1, (1, 16), (33, 64)),
    "chain-b2": Scenario((1, 1, 1, 1), 2, (1, 16), (33, 64)),
    "narrow-b3": Scenario((3, 2, 4), 3, (17, 32), (33, 64)),
    "wide-shallow-b2": Scenario((8, 8), 2, (1, 16), (33, 64)),
}
WRONG_RATES = (0.0, 0.1, 0.3, 1.0)  # share of positions where the draft is not steered to the answer (1: random)
EOS_THIRDS = (None, 0, 1, 2)        # the third of the output where the EOS first appears (None: no EOS)
CASES = 32                          # per scenario: each (wrong rate, EOS third) twice
# Asserted over each scenario's cases.
MIN_SHARE_3_ROUNDS = 0.75    # cases with >= 3 speculative rounds (not all can: an early EOS after a good draft)
MIN_SHARE_FULL_DEPTH = 0.3   # cases with a round that accepted a whole root-to-leaf path
MIN_EOS_PER_THIRD = 6        # cases whose EOS row stopped in each third of max_new_tokens (8 are aimed at each)


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int  # target, draft, prompts, unsteered positions, EOS row and step
    wrong_rate: float
    eos_third: int | None
    max_new: int


@dataclasses.dataclass(frozen=True)
class CaseStats:
    rounds: int                # speculative rounds of the longest-running row
    full_depth: bool
    eos_at: float | None       # where the EOS row stopped, as a fraction of max_new_tokens
    accept_counts: np.ndarray  # [depth + 1]: rounds that emitted 1, 2, ... tokens, over the batch


def _cases(name: str) -> list[Case]:
    rng = np.random.default_rng(sorted(SCENARIOS).index(name))
    strata = itertools.islice(itertools.cycle(itertools.product(WRONG_RATES, EOS_THIRDS)), CASES)
    lo, hi = SCENARIOS[name].max_new
    return [Case(int(rng.integers(2**16)), rate, third, int(rng.integers(lo, hi + 1))) for rate, third in strata]


def _check_output(out, max_new, ref):
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.num_generated, ref.num_generated)
    assert out.tokens.shape == (len(ref.tokens), max_new)
    for row, n in zip(out.tokens, out.num_generated):
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()
    np.testing.assert_array_equal(out.accept_counts.sum(axis=1), out.num_rounds)
    emitted = (out.accept_counts * np.arange(1, out.accept_counts.shape[1] + 1)).sum(axis=1)
    assert (emitted + 1 >= out.num_generated).all()  # EOS / max_new may cut the last round short


def _pick_eos(tokens_BxT: np.ndarray, third: int | None, rng) -> tuple[int, int] | None:
    """``(EOS id, row)``: a token that first appears in a random row in the given third of the output (so it stops
    the row there), or None."""
    if third is None:
        return None
    B, n = tokens_BxT.shape
    row = int(rng.integers(B))
    tokens = tokens_BxT[row]
    firsts = [s for s in range(max(1, -(-third * n // 3)), (third + 1) * n // 3) if tokens[s] not in tokens[:s]]
    return (int(tokens[rng.choice(firsts)]), row) if firsts else None


def _run_case(scenario: Scenario, case: Case) -> CaseStats:
    rng = np.random.default_rng(case.seed)
    target = tiny_target(case.seed % 7)
    lo, hi = scenario.prompt_lengths
    prompts = [rng.integers(0, 64, rng.integers(lo, hi + 1)).tolist() for _ in range(scenario.batch)]
    free_run = generate(target, prompts, max_new_tokens=case.max_new, eos_token_id=[])
    eos = _pick_eos(free_run.tokens, case.eos_third, rng)
    eos_ids = [] if eos is None else [eos[0]]
    ref = free_run if eos is None else generate(target, prompts, max_new_tokens=case.max_new, eos_token_id=eos_ids)

    draft = noisy_oracle_draft(random_draft(case.seed % 5), prompts, free_run.tokens, case.wrong_rate, case.seed)
    out = generate(target, prompts, draft=draft, max_new_tokens=case.max_new, eos_token_id=eos_ids,
                   tree_shape=scenario.tree_shape)
    _check_output(out, case.max_new, ref)
    return CaseStats(rounds=int(out.num_rounds.max()), full_depth=bool(out.accept_counts[:, -1].any()),
                     eos_at=None if eos is None else (ref.num_generated[eos[1]] - 1) / case.max_new,
                     accept_counts=out.accept_counts.sum(axis=0))


def _assert_coverage(name: str, stats: list[CaseStats]) -> None:
    n = len(stats)
    several_rounds = sum(s.rounds >= 3 for s in stats) / n
    full_depth = sum(s.full_depth for s in stats) / n
    thirds = np.bincount([min(int(3 * s.eos_at), 2) for s in stats if s.eos_at is not None], minlength=3)
    lengths = sum(s.accept_counts for s in stats)
    summary = (f"{name}: {n} cases, {several_rounds:.0%} with >= 3 rounds, {full_depth:.0%} reach full depth, "
               f"EOS stopped early/mid/late {thirds.tolist()}, rounds that emitted 1, 2, ... tokens "
               f"{lengths.tolist()}")
    print(summary)
    assert several_rounds >= MIN_SHARE_3_ROUNDS and full_depth >= MIN_SHARE_FULL_DEPTH, summary
    assert (thirds >= MIN_EOS_PER_THIRD).all() and (lengths > 0).all(), summary


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "default-tree-b1" else pytest.mark.slow)
                                  for n in sorted(SCENARIOS)])  # the default tree in the default suite
def test_speculative_greedy_equals_plain_greedy(name):
    stats = []
    for case in _cases(name):
        try:
            stats.append(_run_case(SCENARIOS[name], case))
        except AssertionError as e:
            raise AssertionError(f"{name}: {case}") from e
    _assert_coverage(name, stats)


# The tests below share compiled programs with the property test where they can (same batch, prompt, output
# and tree buckets).


def test_oracle_draft_accepts_whole_paths():
    """A perfect draft accepts a full root-to-leaf path every round (and the output is still exact)."""
    target = tiny_target(3)
    prompts = [[5, 9, 2, 7]]
    ref = generate(target, prompts, max_new_tokens=61, eos_token_id=[])
    draft = oracle_draft(random_draft(0), prompts, ref.tokens)
    out = generate(target, prompts, draft=draft, max_new_tokens=61, eos_token_id=[], tree_shape=(4, 16, 16, 16, 16))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    # 61 tokens = 1 from prefill + 10 rounds of 6 (5 drafted + bonus): every round accepted the full depth.
    np.testing.assert_array_equal(out.num_rounds, [10])
    np.testing.assert_array_equal(out.accept_counts[:, -1], [10])
    assert out.mean_accepted == pytest.approx(61 / 11)


def test_speculative_options_reach_the_speculative_compile_only(monkeypatch):
    """An option XLA does not know fails the speculative loop's compile and not the plain loop's, so the speculative
    loop's own XLA options are really used, and used for it alone (they slow plain decoding by
    2.5% on the H200); the real ones compile here too (every speculative test)."""
    generate_module = importlib.import_module("infer.generate")  # the package's ``generate`` is the function
    target = tiny_target(3)
    monkeypatch.setattr(generate_module, "SPECULATIVE_OPTIONS", {"xla_no_such_option": 1})
    for reproducible in (True, False):
        out = generate(target, [[5, 9, 2]], max_new_tokens=3, eos_token_id=[], reproducible=reproducible)
        assert out.tokens.shape == (1, 3)
        with pytest.raises(Exception, match="xla_no_such_option"):
            generate(target, [[5, 9, 2]], draft=random_draft(0), max_new_tokens=3, eos_token_id=[],
                     tree_shape=(2, 2), reproducible=reproducible)


PROMPTS = [[3, 4, 5] * 6, list(range(10, 34)), [7, 1] * 16]  # as narrow-b3: 3 prompts of 17 to 32 tokens
MAX_NEW = 40


@pytest.fixture(scope="module")
def greedy_case():
    """A target, its greedy continuation of PROMPTS and an oracle draft wrong at every 4th position."""
    target = tiny_target(1)
    free = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])
    return target, free, oracle_draft(random_draft(2), PROMPTS, free.tokens, wrong_every=4)


def test_padding_nodes_see_only_themselves():
    mask_BxNxN = jnp.asarray(np.tril(np.ones((1, 3, 3), bool)))
    tokens_BxM, depths_M, mask_BxMxM = pad_tree_nodes(jnp.asarray([[7, 8, 9]]), jnp.asarray([0, 1, 2]), mask_BxNxN, 4)
    np.testing.assert_array_equal(tokens_BxM, [[7, 8, 9, 0]])
    np.testing.assert_array_equal(depths_M, [0, 1, 2, 0])
    np.testing.assert_array_equal(mask_BxMxM[0], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]])
    assert pad_tree_nodes(tokens_BxM, depths_M, mask_BxMxM, 2)[2] is mask_BxMxM  # already a multiple
    with pytest.raises(ValueError, match="verify_node_multiple must be >= 1, got 0"):
        dataclasses.replace(plan_speculative(tiny_target(0), random_draft(0), 4, 4, SamplingConfig(), (2, 2), 512,
                                             "xla"), verify_node_multiple=0)


@pytest.mark.slow
def test_verification_of_a_padded_tree_is_the_same_pass(greedy_case, monkeypatch):
    """``verify_node_multiple`` (by default 8) pads the verified tree (10 nodes to 16 here): the real nodes' logits
    and K/V equal the unpadded pass's, and the output stays plain greedy."""
    target, free, draft = greedy_case
    passes = record_tree_passes(monkeypatch)
    stop = StopCriteria.make(MAX_NEW, [])
    settings = plan_speculative(target, draft, max(map(len, PROMPTS)), MAX_NEW, SamplingConfig(),
                                SCENARIOS["narrow-b3"].tree_shape, 512, "xla")
    assert settings.verify_node_multiple == VERIFY_NODE_MULTIPLE == 8  # the default pads
    settings, padded = (dataclasses.replace(settings, verify_node_multiple=m) for m in (1, 8))
    tokens, lengths = pad_prompts(PROMPTS, settings.base.prompt_len)

    @jax.jit
    def first_tree(params, weights):  # the state after prefill and the first round's tree, as the loop builds them
        state = speculative_start(settings, params, weights, tokens, lengths, stop, jax.random.PRNGKey(0))
        logp_root_BxV, ring = draft_root(settings.draft, weights, params, state.cache, state.ring, state.pending,
                                         state.num_pending)
        return state.cache, build_tree(settings.tree, settings.draft, weights, params, state.cache, ring,
                                       state.pending[:, 0], logp_root_BxV)

    cache, tree = first_tree(target.params, draft.weights)
    assert tree.tokens.shape[1] == 10
    (logits, kv), (padded_logits, padded_kv) = (jax.jit(verify, static_argnums=0)(s, target.params, cache, tree)
                                                for s in (settings, padded))
    assert passes == [10, 16]
    assert padded_logits.shape == logits.shape and padded_kv.k[0].shape == kv.k[0].shape
    np.testing.assert_allclose(padded_logits, logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(padded_kv.k + padded_kv.v, kv.k + kv.v):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    out = run_speculative(padded, target, draft, PROMPTS, MAX_NEW, stop, 0)
    np.testing.assert_array_equal(out.tokens, free.tokens)
    assert out.mean_accepted > 2


@pytest.mark.slow
def test_a_finished_row_attends_to_none_of_its_cache(greedy_case):
    """Verification with a finished row: the active rows' logits are the full pass's, the finished row's those of
    an empty cache (its cache is not read), and the commit leaves the finished row's length as it was."""
    target, _, draft = greedy_case
    stop = StopCriteria.make(MAX_NEW, [])
    settings = plan_speculative(target, draft, max(map(len, PROMPTS)), MAX_NEW, SamplingConfig(),
                                SCENARIOS["narrow-b3"].tree_shape, 512, "xla")
    tokens, lengths = pad_prompts(PROMPTS, settings.base.prompt_len)
    state = speculative_start(settings, target.params, draft.weights, tokens, lengths, stop, jax.random.PRNGKey(0))
    logp_root_BxV, ring = draft_root(settings.draft, draft.weights, target.params, state.cache, state.ring,
                                     state.pending, state.num_pending)
    tree = build_tree(settings.tree, settings.draft, draft.weights, target.params, state.cache, ring,
                      state.pending[:, 0], logp_root_BxV)
    seen = []

    def recorded(tree, logits, key, settings):
        seen.append(logits)
        return exact_acceptance(tree, logits, key, settings)

    active_B = jnp.asarray([True, False, True])
    _, cache = verify_and_commit(settings, target.params, state.cache, tree, jax.random.PRNGKey(1), active_B,
                                 recorded)
    full = verify(settings, target.params, state.cache, tree)[0]
    empty = verify(settings, target.params, state.cache.replace(lengths=state.cache.lengths.at[1].set(0)), tree)[0]
    np.testing.assert_array_equal(seen[0][::2], full[::2])
    np.testing.assert_array_equal(seen[0][1], empty[1])
    assert np.abs(np.asarray(full[1] - empty[1])).max() > 1e-3  # the row's cache does change its logits
    assert int(cache.lengths[1]) == int(state.cache.lengths[1]) > 0


def test_rows_stop_independently_at_eos(greedy_case):
    target, free, draft = greedy_case
    eos = int(free.tokens[0, 6])
    ref = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[eos])
    out = generate(target, PROMPTS, draft=draft, max_new_tokens=MAX_NEW, eos_token_id=[eos],
                   tree_shape=SCENARIOS["narrow-b3"].tree_shape)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.num_generated[0] <= 7 and out.tokens[0, out.num_generated[0] - 1] == eos


@pytest.mark.parametrize("temperature", [1e-30, float(np.nextafter(MIN_TEMPERATURE, 0)),
                                         pytest.param(MIN_TEMPERATURE, marks=pytest.mark.slow)])
def test_tiny_temperature_equals_greedy(greedy_case, temperature):
    """Below MIN_TEMPERATURE both decoders are greedy (at T = 1e-30, logits / T used to overflow and both emitted
    token 0 forever); at it they sample, and their draws on these well-separated logits are the greedy tokens."""
    target, free, draft = greedy_case
    for d in (None, draft):
        out = generate(target, PROMPTS, draft=d, max_new_tokens=MAX_NEW, eos_token_id=[], temperature=temperature,
                       tree_shape=SCENARIOS["narrow-b3"].tree_shape, seed=5)
        np.testing.assert_array_equal(out.tokens, free.tokens)


@pytest.mark.slow
def test_pallas_speculative_equals_plain_greedy(greedy_case):
    """Every attention of the speculative loop (prefill, draft, verification) through the Pallas kernels, in
    interpret mode on the CPU, against plain greedy decoding through XLA."""
    target, free, draft = greedy_case
    out = generate(target, PROMPTS, draft=draft, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=(2, 2),
                   attention="pallas")
    _check_output(out, MAX_NEW, free)
    assert out.accept_counts[:, 1:].sum() > 0  # multi-token rounds: accepted nodes' K/V were committed
