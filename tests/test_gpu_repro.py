"""GPU: the same greedy ``generate()`` (plain and speculative, bf16 fixture pair) gives the same tokens in two
fresh processes (``reproducible=True``, the default). Run with JAX_PLATFORMS=cuda."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import jax
import pytest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda)")]

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures")
TARGET = os.environ.get("LONGSPEC_FIXTURE", os.path.join(FIXTURES, "code-lm"))
DRAFT = os.environ.get("LONGSPEC_FIXTURE_DRAFT", os.path.join(FIXTURES, "code-lm-draft-ref"))


@pytest.mark.skipif(not (os.path.isdir(TARGET) and os.path.isdir(DRAFT)), reason="fixture pair not present")
def test_two_fresh_processes_give_the_same_tokens(tmp_path):
    sources = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    text = "\n".join(open(path, encoding="utf-8").read() for path in sources)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "infer.bench", "repro", "--out", str(out), "--target", TARGET,
                    "--draft", DRAFT, "--prompts", str(prompts), "--contexts", "4096", "--num-prompts", "4",
                    "--new-tokens", "96", "--modes", "on", "--processes", "2"], check=True)
    rows = json.loads((out / "bench_repro.json").read_text())["rows"]
    assert set(rows) == {"on/plain/4096", "on/speculative/4096"}
    for key, row in rows.items():
        assert row["same"] == row["prompts"] == 4, f"{key}: processes differ at {row['first_difference']}"
