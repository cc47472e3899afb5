"""tools.spec_phases: every phase of a round timed on the tiny pair, against its floor."""

from __future__ import annotations

import json

import pytest

from tools import spec_phases


def test_markdown_marks_phases_without_a_floor():
    results = {"contexts": {40: {"plain_step": dict(seconds=0.01),
                                 "verify": dict(seconds=0.002, floor_seconds=0.001, bound="bytes")}}}
    md = spec_phases.markdown(results)
    assert "| plain_step | 10.000 |  |  |  |" in md
    assert "| verify | 2.000 | 1.000 | bytes | 2.00x |" in md


@pytest.mark.slow
def test_phases_of_the_default_tree(tmp_path):
    assert spec_phases.main(["--out", str(tmp_path), "--smoke", "--tree", "2,2,2"]) == 0
    results = json.loads((tmp_path / "bench_spec_phases.json").read_text())
    row = results["contexts"]["40"]
    assert set(row) == {"plain_step", "draft_step0", "tree_level1_topk", "tree_level2", "tree_level3", "verify",
                        "accept", "commit", "full_round"}
    assert all(r["seconds"] > 0 for r in row.values())
    floors = {name for name, r in row.items() if "floor_seconds" in r}
    assert floors == {"plain_step", "draft_step0", "tree_level2", "tree_level3", "verify", "full_round"}
    assert all(row[n]["floor_seconds"] > 0 and row[n]["bound"] in ("bytes", "FLOPs") for n in floors)
    assert results["copy"]["bytes_per_s"] > 0  # the floors' byte ceiling, measured in the same run


@pytest.mark.slow
def test_phases_of_a_sampled_chain(tmp_path, monkeypatch):
    """--tree, --temperature and --draft-sampling reach the timed round: its settings sample a chain at T=1 and
    verify it by recursive rejection sampling."""
    planned, original = [], spec_phases.plan_speculative

    def plan(*args):
        planned.append(args)
        return original(*args)

    monkeypatch.setattr(spec_phases, "plan_speculative", plan)
    assert spec_phases.main(["--out", str(tmp_path), "--smoke", "--tree", "1,1,1", "--temperature", "1",
                             "--draft-sampling"]) == 0
    (_, _, _, _, sampling, tree, _, _, draft_sampling), = planned
    assert sampling.temperature == 1.0 and tree == (1, 1, 1) and draft_sampling is True
    results = json.loads((tmp_path / "bench_spec_phases.json").read_text())
    assert results["tree_shape"] == [1, 1, 1] and results["temperature"] == 1.0 and results["draft_sampling"]
    assert {k for k in results["contexts"]["40"] if k.startswith("tree_level")} == {"tree_level1_topk",
                                                                                   "tree_level2", "tree_level3"}


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "--temperature: must be >= 0, got -1"),
    (["--draft-sampling", "--tree", "1,1"], "--draft-sampling needs --temperature > 0"),
    (["--xla-options", "[1]"], "--xla-options: expected a JSON object {...}, got '[1]'"),
])
def test_arguments_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit):
        spec_phases.main(["--out", "unused", "--smoke"] + argv)
    assert message in capsys.readouterr().err
