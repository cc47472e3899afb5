"""The speculative-decoding benchmark runs end to end on tiny shapes (CPU) and reports sane numbers."""

from __future__ import annotations

import importlib
import json

import pytest

from infer.bench import spec as bench_spec
from tests.spec_helpers import record_tree_passes

generate_module = importlib.import_module("infer.generate")


def test_markdown_rows():
    results = {"contexts": {40: {"vanilla": {"tokens_per_s": 100.0}, "decode_step_s": 0.01,
                                 "oracle_exact": dict(tau=4.0, tokens_per_s=250.0, speedup=2.5,
                                                      first_mismatch_vs_greedy=None)}}}
    assert "| 40 | 100.0 | oracle_exact | 4.00 | 250.0 | 2.50x | None |" in bench_spec.markdown(results)


@pytest.mark.slow
def test_bench_spec_smoke(tmp_path):
    """Batch 2 (the batch-1 case is the same code with one row)."""
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--contexts", "40", "--new-tokens", "12", "--reps",
                            "1", "--stable-gap", "1e9", "--stable-search", "4096", "--batch", "2"]) == 0
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
    ring = results["draft_state_bytes"]
    assert len({v["ring_bytes"] for v in ring.values()}) == 1  # the draft state does not grow with context
    assert "| 40 |" in (tmp_path / "bench_spec.md").read_text()


@pytest.mark.parametrize("compile_mode, bad, failed", [
    ("reproducible", ("REPRODUCIBLE_OPTIONS", "SPECULATIVE_OPTIONS"), {"vanilla_error": "reproducible"}),
    ("autotuned", ("REPRODUCIBLE_OPTIONS", "SPECULATIVE_OPTIONS"), {"oracle_exact_error": "speculative"}),
    ("reproducible", ("SPECULATIVE_OPTIONS",), {"random_draft_error": "speculative"}),
    ("autotuned", ("--xla-options",), {"oracle_exact_error": "speculative"}),
])
def test_compile_mode_reaches_every_loop(tmp_path, monkeypatch, compile_mode, bad, failed):
    """``--compile`` compiles the plain loop with generate()'s plain options and the speculative loops with its
    speculative ones, plus ``--xla-options``: an option XLA does not know fails exactly the
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


@pytest.mark.slow
def test_verify_node_multiple_reaches_the_round(tmp_path, monkeypatch):
    """``--verify-node-multiple 1`` verifies the default tree's 69 nodes as they are (the default pads them to 72),
    and the output stays lossless."""
    passes = record_tree_passes(monkeypatch)
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--new-tokens", "4", "--verify-node-multiple",
                            "1"]) == 0
    results = json.loads((tmp_path / "bench_spec.json").read_text())
    assert results["verify_node_multiple"] == 1 and set(passes) == {69}
    row = results["contexts"]["40"]
    assert all(row[name]["first_mismatch_vs_greedy"] is None for name in bench_spec.DRAFT_KINDS)


@pytest.mark.parametrize("argv, message", [
    (["--tree", "4,0"], "--tree: expected comma-separated positive integers, got '4,0'"),
    (["--contexts", "40,x"], "--contexts: expected comma-separated positive integers"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--xla-options", "{bad"], "--xla-options: not JSON"),
    (["--verify-node-multiple", "0"], "--verify-node-multiple must be >= 1, got 0"),
    (["--xla-options", "[1]"], "--xla-options: expected a JSON object {...}, got '[1]'"),
])
def test_round_arguments_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench_spec.main(["--out", "unused", "--smoke"] + argv)
    assert message in capsys.readouterr().err
