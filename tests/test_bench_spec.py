"""The speculative-decoding benchmark runs end to end on tiny shapes (CPU) and reports sane numbers."""

from __future__ import annotations

import importlib
import json

import pytest

from infer.bench import spec as bench_spec
from tests.spec_helpers import record_tree_passes

generate_module = importlib.import_module("infer.generate")


def test_markdown_rows_and_phases():
    results = {"contexts": {40: {"vanilla": {"tokens_per_s": 100.0}, "decode_step_s": 0.01,
                                 "oracle_exact": dict(tau=4.0, tokens_per_s=250.0, speedup=2.5,
                                                      first_mismatch_vs_greedy=None),
                                 "phases": {"verify": 0.002, "samples": {"verify": [0.002]}},
                                 "floors": {"verify": dict(bytes=4e9, flops=1e12, seconds=0.001, bound="bytes")}}}}
    md = bench_spec.markdown(results)
    assert "| 40 | 100.0 | oracle_exact | 4.00 | 250.0 | 2.50x | None |" in md
    assert "| plain_step | 10.000 |  |  |  |" in md  # no floor counted for it in this row
    assert "| verify | 2.000 | 1.000 | bytes | 2.00x |" in md and "samples" not in md


@pytest.mark.slow
def test_bench_spec_smoke(tmp_path):
    """Batch 2 (the batch-1 case is the same code with one row)."""
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--contexts", "40", "--phase-contexts", "40",
                            "--e2e-contexts", "40", "--new-tokens", "12", "--reps", "1", "--phase-reps", "1",
                            "--stable-gap", "1e9", "--stable-search", "4096", "--batch", "2"]) == 0
    results = json.loads((tmp_path / "bench_spec.json").read_text())
    assert results["batch"] == 2
    row = results["contexts"]["40"]
    for name in ("random_draft", "oracle_exact", "oracle_wrong_every_4th"):
        assert row[name]["partings"] == [None, None]  # lossless in every row
        assert row[name]["first_mismatch_vs_greedy"] is None
        assert sum(row[name]["accept_counts"]) == row[name]["rounds"]
    assert row["oracle_exact"]["tau"] > row["random_draft"]["tau"]
    # no continuation has a gap of 1e9: the offset with the largest smallest gap is taken
    # each row searched on its own, from its own start
    assert [s % 2048 for s in row["prompt_starts"]] == [0, bench_spec.BATCH_STRIDE % 2048]
    assert len(row["min_f32_top2_gaps"]) == 2 and all(0 < g < 1e9 for g in row["min_f32_top2_gaps"])
    assert set(row["phases"]) >= {"draft_step0", "verify", "commit_all_layers", "full_round"}
    assert set(row["phases"]["samples"]) == {"verify", "verify_with_recompute", "commit_all_layers",
                                             "commit_last_layer"}
    assert all(len(v) == 3 for v in row["phases"]["samples"].values())  # --commit-repeats 3
    assert set(row["floors"]) == {"plain_step", "draft_step0", "verify", "tree_level2", "tree_level3", "tree_level4",
                                  "tree_level5", "full_round"}
    assert all(f["seconds"] > 0 and f["bound"] in ("bytes", "FLOPs") for f in row["floors"].values())
    assert results["copy"]["bytes_per_s"] > 0  # the floors' byte ceiling, measured in the same run
    ring = results["draft_state_bytes"]
    assert len({v["ring_bytes"] for v in ring.values()}) == 1  # the draft state does not grow with context
    assert "| 40 |" in (tmp_path / "bench_spec.md").read_text()


@pytest.mark.parametrize("compile_mode, bad, failed", [
    ("reproducible", ("REPRODUCIBLE_OPTIONS", "SPECULATIVE_OPTIONS"), {"vanilla_error": "reproducible"}),
    ("autotuned", ("REPRODUCIBLE_OPTIONS", "SPECULATIVE_OPTIONS"),
     {"phases_error": "speculative", "oracle_exact_error": "speculative"}),
    ("reproducible", ("SPECULATIVE_OPTIONS",), {"phases_error": "speculative", "random_draft_error": "speculative"}),
    ("autotuned", ("--xla-options",), {"phases_error": "speculative", "oracle_exact_error": "speculative"}),
])
def test_compile_mode_reaches_every_loop(tmp_path, monkeypatch, compile_mode, bad, failed):
    """``--compile`` compiles the plain loop with generate()'s plain options and the phases and speculative
    loops with its speculative ones, plus ``--xla-options``: an option XLA does not know fails exactly the
    compiles it reaches (a failed plain run skips the rest of its context)."""
    extra = []
    for name in bad:
        if name == "--xla-options":
            extra = [name, '{"xla_no_such_speculative_option": 1}']
        else:
            kind = name.split("_")[0].lower()
            monkeypatch.setattr(generate_module, name, {f"xla_no_such_{kind}_option": 1})
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--new-tokens", "4", "--compile", compile_mode]
                           + extra) == 0
    results = json.loads((tmp_path / "bench_spec.json").read_text())
    assert results["compile"] == compile_mode
    row = results["contexts"]["40"]
    errors = {k: v for k, v in row.items() if k.endswith("_error")}
    assert set(errors) >= set(failed)
    assert all(f"xla_no_such_{failed[k] if k in failed else 'speculative'}_option" in v for k, v in errors.items())
    assert not any("reproducible_option" in v for k, v in errors.items() if compile_mode == "autotuned")


def test_verify_node_multiple_reaches_the_round(tmp_path, monkeypatch):
    """``--verify-node-multiple 1`` verifies the default tree's 69 nodes as they are (the default pads them to 72),
    and the output stays lossless."""
    passes = record_tree_passes(monkeypatch)
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--new-tokens", "4", "--phase-contexts", "",
                            "--verify-node-multiple", "1"]) == 0
    results = json.loads((tmp_path / "bench_spec.json").read_text())
    assert results["verify_node_multiple"] == 1 and set(passes) == {69}
    row = results["contexts"]["40"]
    assert all(row[name]["first_mismatch_vs_greedy"] is None for name in bench_spec.DRAFT_KINDS)


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "1"], '--temperature > 0 times the phases only: pass --e2e-contexts ""'),
    (["--tree", "4,0"], "--tree: expected comma-separated positive integers, got '4,0'"),
    (["--temperature", "-1", "--e2e-contexts", ""], "--temperature: must be >= 0, got -1"),
    (["--draft-sampling", "--temperature", "1", "--e2e-contexts", ""], "--draft-sampling needs --temperature > 0 "
                                                                       "and a chain --tree"),
    (["--draft-sampling", "--tree", "1,1"], "--draft-sampling needs --temperature > 0"),
    (["--xla-options", "{bad"], "--xla-options: not JSON"),
    (["--verify-node-multiple", "0"], "--verify-node-multiple must be >= 1, got 0"),
    (["--xla-options", "[1]"], "--xla-options: expected a JSON object {...}, got '[1]'"),
])
def test_round_arguments_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench_spec.main(["--out", "unused", "--smoke"] + argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_spec_phases_of_a_sampled_chain(tmp_path, monkeypatch):
    """--tree, --temperature and --draft-sampling reach the timed round: its settings sample a chain at T=1 and
    verify it by speculative sampling, and the phases and floors are those of a three-token chain."""
    planned, original = [], bench_spec.plan_speculative

    def plan(*args):
        planned.append(args)
        return original(*args)

    monkeypatch.setattr(bench_spec, "plan_speculative", plan)
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--tree", "1,1,1", "--temperature", "1",
                            "--draft-sampling", "--e2e-contexts", "", "--commit-repeats", "1"]) == 0
    (_, _, _, _, sampling, tree, _, _, draft_sampling), = planned
    assert sampling.temperature == 1.0 and tree == (1, 1, 1) and draft_sampling is True
    results = json.loads((tmp_path / "bench_spec.json").read_text())
    assert results["tree_shape"] == [1, 1, 1] and results["temperature"] == 1.0 and results["draft_sampling"]
    row = results["contexts"]["40"]
    assert {k for k in row["phases"] if k.startswith("tree_level")} == {"tree_level1_topk", "tree_level2",
                                                                         "tree_level3"}
    assert set(row["floors"]) == {"plain_step", "draft_step0", "verify", "tree_level2", "tree_level3", "full_round"}
    assert not any(name in row for name in bench_spec.DRAFT_KINDS)  # no end-to-end runs at T > 0
