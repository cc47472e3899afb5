"""``python -m infer.bench decode --smoke``: the whole benchmark (JAX, HF eager, HF static) with tiny CPU shapes."""

from __future__ import annotations

import json

import pytest

from infer.bench import decode


def test_weight_and_kv_bytes_llama3_8b():
    w = decode.weight_bytes(decode.LLAMA3_8B)
    assert w["params"] == 8_030_261_248  # Llama-3-8B
    assert decode.kv_bytes(decode.LLAMA3_8B, 1024) == 1024 * 32 * 8 * 128 * 2 * 2


def test_markdown_ratios_and_errors():
    report = dict(records=[dict(kind="env", part="jax", device="H200", jax="0.11"), dict(kind="decode", part="hf",
                  context=8, error="OOM\nmore")], copy_bandwidth_bytes_per_s=4e12, date="today", shapes={},
                  weights=dict(bytes=1e9), new_tokens=4, hf_new_tokens=4, workers=[dict(part="jax", status="ok",
                  seconds=3.0)], rows=[dict(context=8, floor_ms=2.0, floor_strict_ms=1.5,
                                            jax_auto=dict(ms_per_token=3.0, tokens_per_s=333.3),
                                            hf=dict(ms_per_token=30.0, tokens_per_s=33.3))])
    md = decode.markdown(report)
    assert "| context | floor | ours auto | hf | ours auto / floor | hf / ours |" in md
    assert "| 8 | 2.00 | 3.00 (333.3/s) | 30.00 (33.3/s) | 1.50x | 10.00x |" in md
    assert "Copy bandwidth: 4.000 TB/s" in md and "- hf decode 8: OOM" in md


@pytest.mark.slow
def test_smoke_run_writes_json_and_markdown(tmp_path):
    report = decode.main(["--smoke", "--out", str(tmp_path), "--contexts", "64,128", "--new-tokens", "4",
                          "--reps", "1"])
    assert [w["status"] for w in report["workers"]] == ["ok", "ok", "ok"]
    saved = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [row["context"] for row in saved["rows"]] == [64, 128]
    assert saved["copy_bandwidth_bytes_per_s"] > 0
    assert saved["command"].startswith("python -m infer.bench decode --smoke")
    for row in saved["rows"]:
        assert row["floor_ms"] > 0 and row["floor_strict_ms"] < row["floor_ms"]
        for part in ("jax_auto", "hf", "hf_static"):
            assert "ms_per_token" in row[part], (part, row)  # CPU timings of 4 tiny steps are noise
    decode_records = [r for r in saved["records"] if r.get("kind") == "decode" and r["part"] == "jax"]
    assert all(r["repeat_identical"] for r in decode_records)
    md = (tmp_path / "bench_decode.md").read_text()
    assert "| context | floor | ours auto | hf | hf_static |" in md
    assert "| 64 |" in md and "| 128 |" in md
