"""``python -m infer.bench shard``: the report, and a smoke run on 2 fake CPU devices (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infer.bench import shard
from tests.conftest import REPO_ROOT


def test_markdown_rows():
    results = {"date": "d", "device": "cpu", "jax": "0", "context": 64, "new_tokens": 8, "tree_shape": [2, 2],
               "runs": {1: {"plain": dict(tokens_per_s=100.0, ms_per_token=10.0, first_mismatch_vs_1_device=None),
                            "speculative": dict(tokens_per_s=150.0, tau=2.0, speedup_vs_plain=1.5),
                            "fit": dict(largest_context=64, contexts={64: dict(ms_per_token=1.0),
                                                                      128: dict(error="x", oom=True)})},
                        2: {"error": "boom", "fit": dict(largest_context=128, contexts={64: dict(ms_per_token=0.5),
                                                                                        128: dict(ms_per_token=0.7)})}}}
    md = shard.markdown(results)
    assert "| 1 | 100.0 | 10.00 | 150.0 | 2.00 | 1.50x | - | 64 |" in md
    assert "| 2 | error | - | - | - | - | - | 128 |" in md
    assert "| 1 | 1.00 | OOM |" in md and "| 2 | 0.50 | 0.70 |" in md


@pytest.mark.slow
def test_bench_shard_smoke(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "infer.bench", "shard", "--smoke", "--out", str(tmp_path),
                           "--compile", "reproducible"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_shard.json").read_text())
    runs = report["runs"]
    assert report["compile"] == "reproducible"
    assert set(runs) == {"1", "2"}
    for row in runs.values():
        assert row["speculative"]["first_mismatch_vs_plain"] is None  # lossless (float32 tiny model)
        assert row["speculative"]["tau"] > 1 and row["fit"]["largest_context"] == 256
    assert runs["2"]["plain"]["first_mismatch_vs_1_device"] is None
