"""How speculation is chosen: the acceptance model (reach, best trees, shared level widths), the rank counts the
loop keeps, the cost model's choice per temperature and batch, and auto end to end (greedy equality)."""

from __future__ import annotations

import glob
import itertools
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from infer import generate
from infer.choice import main, speculation_table
from infer.main import DEFAULT_MODEL
from infer.speculation import (DEVICE_MODELS, FLAT, MAX_CHILDREN, ModelSizes, candidate_shapes, choose,
                               plain_step_seconds, round_seconds, sampling_kind)
from longspec_jax.config import TargetConfig
from longspec_jax.sampling import SamplingConfig
from longspec_jax.speculation_profile import (DEFAULT_PROFILE, RateTable, SpeculationProfile, allocate_branching,
                                              best_shape, expected_tokens, load_profile, profile_from_counts,
                                              save_profile)
from longspec_jax.tree import TreeSpec, rank_outcomes
from tests.spec_helpers import oracle_draft, random_draft, tiny_target

TABLE = RateTable("without_replacement", 1.0, ((0.6, 0.3, 0.2),))
# the 8B-cost pair of the benchmarks: the code-LM fixture padded to 72/18 heads of 64, hidden 4608, 32 layers
PADDED = TargetConfig(model_type="llama", vocab_size=16384, hidden_size=4608, intermediate_size=14336, num_layers=32,
                      num_heads=72, num_kv_heads=18, head_dim=64)


def _brute_reach(branching, table) -> float:
    """1 + sum over nodes of the product of marginals along the path, by walking the static topology."""
    spec = TreeSpec(tuple(sum(c) for c in branching)).with_branching(branching)
    depth, reach = spec.node_depths, np.ones(spec.num_nodes)
    for n in range(1, spec.num_nodes):
        d = depth[n] - 1
        reach[n] = reach[spec.static_parents[n]] * table.marginals(d)[spec.sibling_ranks[n]]
    return float(reach.sum())


def test_marginals_are_the_chance_of_passing_to_each_rank():
    m = TABLE.marginals(0, 4)
    np.testing.assert_allclose(m, [0.6, 0.4 * 0.3, 0.4 * 0.7 * 0.2, 0.4 * 0.7 * 0.8 * 0.2])
    rising = RateTable("beams", 0.0, ((0.1, 0.9),))
    assert rising.marginals(0, 2)[1] == pytest.approx(0.1)  # capped by the rank before it


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2), (4, 4), (4, 16, 16, 16, 16), (3, 1, 5)])
def test_expected_tokens_is_the_summed_reach(shape):
    branching = allocate_branching(shape, TABLE, 8)
    assert [sum(c) for c in branching] == list(shape)
    assert expected_tokens(branching, TABLE) == pytest.approx(_brute_reach(branching, TABLE))


def test_allocation_beats_every_other_topology_of_the_same_widths():
    """Brute force over all ways to share (3, 4)'s second level among three parents (at most 4 each)."""
    shape = (3, 4)
    best = expected_tokens(allocate_branching(shape, TABLE, 4), TABLE)
    for counts in itertools.product(range(5), repeat=3):
        if sum(counts) == 4:
            assert expected_tokens(((3,), counts), TABLE) <= best + 1e-12


def test_best_shape_is_the_best_tree_of_its_size():
    """For 7 nodes within 3 levels, no set of level widths gives more expected tokens than best_shape's."""
    shape = best_shape(TABLE, 7, 3, 4)
    assert sum(shape) == 6 and len(shape) <= 3
    best = expected_tokens(allocate_branching(shape, TABLE, 4), TABLE)
    for widths in itertools.product(range(7), repeat=3):
        widths = tuple(w for w in widths if w)
        if sum(widths) == 6 and all(b <= 4 * a for a, b in zip((1,) + widths, widths)):
            assert expected_tokens(allocate_branching(widths, TABLE, 4), TABLE) <= best + 1e-12


def test_rank_outcomes_by_hand():
    """Root with children 1, 2 (ranks 0, 1); node 2 with children 3, 4, 5. Row 0 accepts node 2 then node 5 and
    stops at the leaf; row 1 accepts nothing (tried both root children)."""
    parents = jnp.asarray([[0, 0, 0, 2, 2, 2]] * 2)
    path = jnp.asarray([[0, 2, 5], [0, 0, 0]])
    tried, accepted = rank_outcomes(parents, path, jnp.asarray([3, 1]), depth=2)
    assert tried.shape == (2, 2, 8)
    np.testing.assert_array_equal(tried[0, :, :3], [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(accepted[0, :, :3], [[0, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(tried[1, :, :3], [[1, 1, 0], [0, 0, 0]])
    assert int(accepted[1].sum()) == 0


def test_profile_from_counts_shrinks_towards_the_prior_and_round_trips(tmp_path):
    tried = np.array([[100, 10, 0]])
    accepted = np.array([[80, 5, 0]])
    profile = profile_from_counts({("without_replacement", 1.0): (tried, accepted)}, "test")
    prior = DEFAULT_PROFILE.table("without_replacement", 1.0).row(0)
    rates = profile.table("without_replacement", 1.0).row(0)
    assert rates[0] == pytest.approx((80 + 4 * prior[0]) / 104, abs=1e-4)
    assert rates[2] == pytest.approx(prior[2], abs=1e-4)  # never tried: the prior's
    save_profile(profile, tmp_path)
    assert load_profile(tmp_path) == profile
    assert load_profile(tmp_path / "none") is None


def test_temperatures_between_tables_interpolate_towards_greedy():
    profile = SpeculationProfile((RateTable("beams", 0.0, ((0.9,),)), RateTable("without_replacement", 1.0, ((0.5,),))),
                                 "test")
    assert profile.table("without_replacement", 0.5).row(0)[0] == pytest.approx(0.7)
    assert profile.table("without_replacement", 2.0).row(0)[0] == pytest.approx(0.5)
    default = DEFAULT_PROFILE.table("top_plus_one", 1.0)
    assert SpeculationProfile((RateTable("beams", 0.0, ((0.9,),)),), "x").table("top_plus_one", 1.0) == default


@pytest.mark.parametrize("data, words", [({"tables": [{"kind": "beams", "temperature": 0, "rates": [[1.5]]}]},
                                          "in \\[0, 1\\]"),
                                         ({"tables": [{"kind": "nope", "temperature": 0, "rates": [[0.5]]}]},
                                          "unknown tree kind"),
                                         ({"rows": []}, "malformed")])
def test_bad_profiles_are_named(data, words):
    with pytest.raises(ValueError, match=words):
        SpeculationProfile.from_json(data, "p.json")


def test_sampling_kind_accepts_bools_and_kinds_only():
    assert [sampling_kind(x) for x in (None, False, True, "top_plus_one")] == [None, False, "without_replacement",
                                                                               "top_plus_one"]
    with pytest.raises(ValueError, match="draft_sampling must be"):
        sampling_kind("yes")


def test_round_cost_grows_with_nodes_and_batch():
    sizes, device = ModelSizes.of(PADDED), DEVICE_MODELS["H200"]
    small, big = (round_seconds(sizes, device, shape, 8, 16384) for shape in ((1, 1, 1, 1), (4, 16, 16, 16, 16)))
    assert big > 3 * small
    assert round_seconds(sizes, device, (1, 1, 1, 1), 1, 16384) < small


def _measured_pass_costs() -> list[tuple[str, tuple[int, ...], int, float]]:
    """(method, shape, batch, target passes in plain steps) of every chain and tree row of the kept H200 tasks
    reports (the 8B-cost pair at 16k): tau x (1 - idle row share) / speedup, rows without an idle share left out."""
    rows = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "results", "tasks_16k_*.json"))):
        report = json.load(open(path))
        assert "H200" in report["device"], path
        for row in report["rows"]:
            method = re.fullmatch(r"s?(chain|tree)\[\w+\]([\d,]+)", row["method"])
            if method and row.get("idle_row_share") is not None:
                shape = ((1,) * int(method[2]) if method[1] == "chain" else tuple(map(int, method[2].split(","))))
                cost = row["tau"] * (1 - row["idle_row_share"]) / row["speedup"]
                rows.append((row["method"], shape, row["batch"], cost))
    return rows


def test_the_h200_cost_model_predicts_the_measured_rounds():
    """Chains, (4,8,8) and the 69-node tree at batches 1-8: the model's round, in plain steps, is within 20% of
    the measured one (-8% .. +17% over the 16 rows), so its choice between them rests on the device's costs."""
    sizes, device = ModelSizes.of(PADDED), DEVICE_MODELS["H200"]
    measured = _measured_pass_costs()
    assert len(measured) >= 12 and {len(shape) for _, shape, _, _ in measured} >= {3, 4, 5}
    for method, shape, batch, cost in measured:
        predicted = round_seconds(sizes, device, shape, batch, 16384) / plain_step_seconds(sizes, device, batch, 16384)
        assert abs(predicted / cost - 1) < 0.2, (method, batch, predicted, cost)


def test_a_draft_vocabulary_shrinks_the_draft_head_and_caps_children():
    """The cost model reads K columns of the LM head per draft step, and no sampled node gets more than K
    children."""
    full, small = ModelSizes.of(PADDED), ModelSizes.of(PADDED, draft_vocab_size=4096)
    assert full.draft_params - small.draft_params == (16384 - 4096) * 4608
    assert small.target_params == full.target_params
    s = choose(PADDED, None, SamplingConfig(1.0), 1, 16384, tree_shape=(3, 9, 9), device=DEVICE_MODELS["H200"],
               draft_vocab_size=3)
    assert max(max(counts) for counts in s.branching) <= 3


# What auto does for the 8B-cost pair on an H200 with the default rates (docs/results.md, "Choosing the
# speculation"): at 12k tokens of context, and at 512 with a batch of 256, where verification would be bound by its
# GEMMs and plain decoding wins.
AUTO_TABLE = {
    (0.0, 1, 12288): ((2, 3, 4, 5, 6, 7, 2, 1, 1), None),
    (0.0, 2, 12288): ((2, 3, 4, 2, 1, 1, 1, 1), None),
    (0.0, 8, 12288): ((2, 3, 4, 2, 1, 1, 1, 1), None),
    (0.0, 16, 12288): ((1, 1, 1, 1, 1, 1, 1), None),
    (1.0, 1, 12288): ((4, 7, 7, 5), "without_replacement"),
    (1.0, 2, 12288): ((4, 7, 4), "without_replacement"),
    (1.0, 8, 12288): ((4, 5, 4, 2), "without_replacement"),
    (1.0, 16, 12288): ((3, 3, 1), "without_replacement"),
    (0.0, 256, 512): (None, None),
    (1.0, 256, 512): (None, None),
}


@pytest.mark.parametrize("temperature, batch", [(0.0, 1), (0.0, 8), (1.0, 1), (1.0, 2), (1.0, 16)])
def test_auto_takes_the_smallest_of_the_shapes_predicted_alike(temperature, batch):
    """Auto's shape is predicted within FLAT of the fastest candidate, and no candidate in that band has fewer
    nodes, or as many nodes in fewer levels."""
    sampling = SamplingConfig(temperature)
    device = DEVICE_MODELS["H200"]
    kind = "without_replacement" if temperature else "beams"
    table = DEFAULT_PROFILE.table(kind, temperature)
    speedups = {s: choose(PADDED, None, sampling, batch, 12288, tree_shape=s, device=device).predicted_speedup
                for s in candidate_shapes(table, MAX_CHILDREN)}
    best = max(speedups.values())
    chosen = choose(PADDED, None, sampling, batch, 12288, device=device).tree_shape
    assert speedups[chosen] >= best * (1 - FLAT)
    alike = [s for s, v in speedups.items() if v >= best * (1 - FLAT)]
    assert min((sum(s), len(s)) for s in alike) == (sum(chosen), len(chosen))
    assert len(alike) > 1 or chosen == max(speedups, key=speedups.get)


def test_auto_choice_per_temperature_and_batch():
    got = {}
    for context, batches in ((12288, [1, 2, 8, 16]), (512, [256])):
        for r in speculation_table(PADDED, None, [0.0, 1.0], batches, context, DEVICE_MODELS["H200"]):
            got[r["temperature"], r["batch"], context] = (r["tree_shape"], r["draft_sampling"])
    assert got == AUTO_TABLE


def test_cli_prints_the_choice_table_of_a_pair(capsys, tmp_path):
    """``python -m infer.choice`` reads the target's config and the draft's profile (no weights) and prints
    one row per (T, batch): the shapes ``speculation_table`` gives; a missing draft directory is named."""
    target_dir, draft_dir = DEFAULT_MODEL / "target", DEFAULT_MODEL / "draft"
    assert main(["--target", str(target_dir), "--draft", str(draft_dir), "--context", "4096", "--batches", "1,8",
                 "--temperatures", "0,1"]) == 0
    out = capsys.readouterr().out
    assert load_profile(str(draft_dir)).source in out.splitlines()[0]
    rows = speculation_table(TargetConfig.from_dir(target_dir), load_profile(str(draft_dir)), [0.0, 1.0], [1, 8], 4096,
                             DEVICE_MODELS["H200"])
    printed = [line.split(" | ")[2] for line in out.splitlines() if re.match(r"\| [01] \| \d", line)]
    assert printed == [",".join(map(str, r["tree_shape"])) if r["tree_shape"] else "plain" for r in rows]
    with pytest.raises(SystemExit):
        main(["--target", str(target_dir), "--draft", str(tmp_path / "none")])
    assert "draft directory not found" in capsys.readouterr().err


def test_fixed_parts_are_kept_and_plain_needs_a_free_choice():
    greedy, sampled = SamplingConfig(0.0), SamplingConfig(1.0)
    s = choose(PADDED, None, sampled, 1, 16384, tree_shape=(4, 16, 16, 16, 16), device=DEVICE_MODELS["H200"])
    assert s.tree_shape == (4, 16, 16, 16, 16) and s.draft_sampling == "without_replacement"
    assert "tree_shape given" in s.reason
    s = choose(PADDED, None, sampled, 1, 16384, draft_sampling=False, device=DEVICE_MODELS["H200"])
    assert s.draft_sampling is None and s.tree_shape is not None
    s = choose(PADDED, None, greedy, 256, 512, draft_sampling=False, device=DEVICE_MODELS["H200"])
    assert s.tree_shape is not None, "an explicit draft_sampling keeps speculation on"
    s = choose(PADDED, None, greedy, 256, 512, device=DEVICE_MODELS["H200"])
    assert s.tree_shape is None and "plain" in s.describe()


def test_auto_greedy_equals_plain_and_says_what_it_chose():
    target = tiny_target(1)
    prompts = [[3, 4, 5] * 6, list(range(10, 34))]
    plain = generate(target, prompts, max_new_tokens=40, eos_token_id=[])
    draft = oracle_draft(random_draft(2), prompts, plain.tokens, wrong_every=4)
    out = generate(target, prompts, draft=draft, max_new_tokens=40, eos_token_id=[])
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    s = out.speculation
    assert s.tree_shape is not None and s.draft_sampling is None and s.reason.startswith("auto: T=0, batch 2")
    assert out.accept_counts.shape[1] == len(s.tree_shape) + 1
    accepted_nodes = (out.accept_counts * np.arange(out.accept_counts.shape[1])).sum()  # every round's path
    assert out.rank_accepted.sum() == accepted_nodes
    assert plain.speculation is None


def test_auto_at_temperature_samples_a_tree_and_counts_its_ranks():
    target = tiny_target(1)
    out = generate(target, [[3, 4, 5] * 6], draft=random_draft(2), max_new_tokens=24, eos_token_id=[],
                   temperature=1.0)
    s = out.speculation
    assert s.draft_sampling == "without_replacement" and s.branching is not None
    assert [sum(c) for c in s.branching] == list(s.tree_shape)
    assert (out.rank_tried >= out.rank_accepted).all() and out.rank_tried[0, 0] == out.num_rounds[0]
