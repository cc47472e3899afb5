"""``python -m infer.bench_decode --smoke``: the whole benchmark (JAX, HF eager, HF static) with tiny CPU shapes."""

from __future__ import annotations

import json

from infer import bench_decode


def test_weight_and_kv_bytes_llama3_8b():
    w = bench_decode.weight_bytes(bench_decode.LLAMA3_8B)
    assert w["params"] == 8_030_261_248  # Llama-3-8B
    assert bench_decode.kv_bytes(bench_decode.LLAMA3_8B, 1024) == 1024 * 32 * 8 * 128 * 2 * 2


def test_smoke_run_writes_json_and_markdown(tmp_path):
    report = bench_decode.main(["--smoke", "--out", str(tmp_path), "--contexts", "64,128", "--new-tokens", "4",
                                "--reps", "1"])
    assert [w["status"] for w in report["workers"]] == ["ok", "ok", "ok"]
    saved = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [row["context"] for row in saved["rows"]] == [64, 128]
    assert saved["copy_bandwidth_bytes_per_s"] > 0
    for row in saved["rows"]:
        assert row["floor_ms"] > 0 and row["floor_strict_ms"] < row["floor_ms"]
        for part in ("jax_auto", "hf", "hf_static"):
            assert "ms_per_token" in row[part], (part, row)  # CPU timings of 4 tiny steps are noise
    decode = [r for r in saved["records"] if r.get("kind") == "decode" and r["part"] == "jax"]
    assert all(r["repeat_identical"] for r in decode)
    md = (tmp_path / "bench_decode.md").read_text()
    assert "| context | floor | ours auto | hf | hf_static |" in md
    assert "| 64 |" in md and "| 128 |" in md
