"""The speculative-decoding benchmark runs end to end on tiny shapes (CPU) and reports sane numbers."""

from __future__ import annotations

import json

from infer import bench_spec


def test_bench_spec_smoke(tmp_path):
    assert bench_spec.main(["--out", str(tmp_path), "--smoke", "--contexts", "40", "--phase-contexts", "40",
                            "--e2e-contexts", "40", "--new-tokens", "12", "--reps", "1", "--phase-reps", "1",
                            "--stable-gap", "1e9", "--stable-search", "4096"]) == 0
    results = json.loads((tmp_path / "bench_spec.json").read_text())
    row = results["contexts"]["40"]
    for name in ("random_draft", "oracle_exact", "oracle_wrong_every_4th"):
        assert row[name]["first_mismatch_vs_greedy"] is None  # lossless
        assert sum(row[name]["accept_counts"]) == row[name]["rounds"]
    assert row["oracle_exact"]["tau"] > row["random_draft"]["tau"]
    # no continuation has a gap of 1e9: the offset with the largest smallest gap is taken
    assert row["prompt_offset"] % 2048 == 0 and 0 < row["min_f32_top2_gap"] < 1e9
    assert set(row["phases"]) >= {"draft_step0", "verify", "commit_all_layers", "full_round"}
    ring = results["draft_state_bytes"]
    assert len({v["ring_bytes"] for v in ring.values()}) == 1  # the draft state does not grow with context
    assert "| 40 |" in (tmp_path / "bench_spec.md").read_text()
