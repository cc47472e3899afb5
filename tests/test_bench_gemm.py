"""``python -m infer.bench gemm --smoke``: XLA's dot and the skinny matmul timed at tiny shapes on the CPU, both
recorded with their difference, and bad ``--configs`` named."""

import json

import pytest

from infer.bench.gemm import main, parse_configs


def test_gemm_smoke_times_xla_and_skinny(tmp_path):
    assert main(["--out", str(tmp_path), "--smoke"]) == 0
    report = json.loads((tmp_path / "bench_gemm.json").read_text())
    for shape in report["shapes"]:
        impls = {r["impl"]: r for r in shape["results"]}
        assert set(impls) == {"xla", "16x64x4x2", "32x128x4x2"}
        assert all(r["us"] > 0 and r["max_abs_diff_vs_xla"] < 0.05 for r in impls.values())
    assert "| smoke a 256->128 | 5 |" in (tmp_path / "bench_gemm.md").read_text()


def test_bad_configs_are_named():
    with pytest.raises(SystemExit, match="32x128x4"):
        parse_configs("32x128x4")
