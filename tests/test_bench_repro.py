"""``python -m infer.bench repro`` and the reproducible compile of ``generate()``: the comparison arithmetic on
hand-made token lists, the compiler options reaching XLA, and a two-process smoke run (slow)."""

from __future__ import annotations

import importlib
import json

import pytest

from infer.bench import repro
from longspec_jax.testing import tiny_target

generate_module = importlib.import_module("infer.generate")


def test_compare_counts_equal_prompts_and_the_first_difference():
    a = {"on/plain/8": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}
    b = {"on/plain/8": [[1, 2, 3], [4, 0, 6], [7, 8, 9]]}
    c = {"on/plain/8": [[1, 2, 3], [4, 5, 0], [0, 8, 9]]}
    row = repro.compare([a, b, c])["on/plain/8"]
    assert row == dict(same=1, prompts=3, first_difference=[None, 1, 0])


def test_reproducible_options_reach_the_compiler(monkeypatch):
    """An option XLA does not know fails the compile only when it is passed, so the options are really used."""
    target = tiny_target(0)
    monkeypatch.setattr(generate_module, "REPRODUCIBLE_OPTIONS", {"xla_no_such_option": 1})
    out = generate_module.generate(target, [[1, 2, 3]], max_new_tokens=2, reproducible=False)
    assert out.tokens.shape == (1, 2)
    with pytest.raises(Exception, match="xla_no_such_option"):
        generate_module.generate(target, [[1, 2, 3]], max_new_tokens=2, reproducible=True)


@pytest.mark.slow
def test_smoke_two_processes(tmp_path):
    assert repro.main(["--out", str(tmp_path), "--smoke", "--processes", "2", "--modes", "on"]) == 0
    rows = json.loads((tmp_path / "bench_repro.json").read_text())["rows"]
    assert set(rows) == {"on/plain/40", "on/speculative/40"}
    assert all(r["same"] == r["prompts"] == 2 for r in rows.values())
