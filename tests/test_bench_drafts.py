"""``python -m infer.bench drafts``: prompt windows, the repeated-4-gram share and the summary arithmetic on
hand-made cases, and a smoke run end to end on the CPU."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from infer.bench import drafts
from longspec_jax.testing import random_draft, tiny_target


def test_prompt_windows_are_seeded_slices_of_long_enough_documents():
    docs = [list(range(5)), list(range(100, 160)), list(range(200, 230))]
    a = drafts.prompt_windows(docs, 20, 6, seed=1)
    assert a == drafts.prompt_windows(docs, 20, 6, seed=1) and a != drafts.prompt_windows(docs, 20, 6, seed=2)
    for w in a:
        assert len(w) == 20 and np.all(np.diff(w) == 1) and w[0] >= 100  # a contiguous slice, never the short doc
    with pytest.raises(ValueError, match="no prompt document has 100 tokens"):
        drafts.prompt_windows(docs, 100, 1, seed=0)


def test_repeat_4gram_share():
    assert drafts.repeat_4gram_share([1, 2, 3, 4] * 3, [1, 2, 3, 4] * 2) == 1.0  # a loop: every 4-gram seen
    # the 4-grams that end in the output count, those across the join too: 2341 3412 4123 are new, 1234 is not
    assert drafts.repeat_4gram_share([1, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(1 / 4)
    # prompt 1 2 3, output 4 1 2 3 4: output 4-grams (1234 at the join) 2341 3412 4123 1234 -> only 1234 repeats
    assert drafts.repeat_4gram_share([1, 2, 3], [4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    assert drafts.repeat_4gram_share([9, 9], [1, 2]) == 0.0


def test_summary_arithmetic():
    plain = [dict(seconds=2.0, steps=100), dict(seconds=2.0, steps=60)]
    spec = [dict(seconds=1.0, generated=101, rounds=24, accept_counts=[4, 20]),
            dict(seconds=1.0, generated=61, rounds=29, accept_counts=[29, 0])]
    assert drafts.summarize(plain) == {"tokens_per_s": 40.0}
    s = drafts.summarize(plain, spec)
    assert s["tau"] == pytest.approx(162 / 55) and s["tokens_per_s"] == pytest.approx(80.0)
    assert s["speedup"] == pytest.approx(2.0) and s["accept_counts"] == [33, 20]
    # per-prompt taus 101/25 = 4.04 and 61/30: their sample std / sqrt(2) is |4.04 - 61/30| / 2
    assert s["tau_se"] == pytest.approx(abs(101 / 25 - 61 / 30) / 2)


def test_paired_tau_difference():
    base = [dict(generated=20, rounds=9), dict(generated=30, rounds=14), dict(generated=9, rounds=2)]  # 2, 2, 3
    other = [dict(generated=25, rounds=9), dict(generated=30, rounds=9), dict(generated=9, rounds=2)]  # 2.5, 3, 3
    mean, se = drafts.paired_tau_difference(other, base)  # differences 0.5, 1, 0
    assert mean == pytest.approx(0.5) and se == pytest.approx(0.5 / np.sqrt(3))
    assert drafts.mean_and_se([4.0]) == (4.0, 0.0)


@pytest.mark.slow
def test_smoke_run(tmp_path):
    assert drafts.main(["--out", str(tmp_path), "--smoke"]) == 0
    report = json.loads((tmp_path / "bench_drafts.json").read_text())
    assert [(r["context"], r["temperature"]) for r in report["rows"]] == [(40, 0.0), (64, 0.0), (40, 1.0), (64, 1.0)]
    for row in report["rows"]:
        for name in ("a", "b"):
            assert row[name]["tau"] >= 1.0 and row[name]["tokens_per_s"] > 0
            if row["temperature"] == 0:
                assert row[name]["partings"] == [None, None]  # float32 on the CPU: exactly plain greedy
        assert len(row["b"]["paired_tau_difference"]) == 2 and "paired_tau_difference" not in row["a"]
    md = (tmp_path / "bench_drafts.md").read_text()
    assert "| 40 | 0.0 |" in md and "b - a tau (paired)" in md and "| 2/2 | 2/2 |" in md


@pytest.mark.parametrize("compile_mode, bad, failing", [
    ("reproducible", "REPRODUCIBLE_OPTIONS", {"plain", "speculative"}),
    ("autotuned", "REPRODUCIBLE_OPTIONS", set()),
    ("autotuned", "SPECULATIVE_OPTIONS", {"speculative"}),
])
def test_runner_compiles_as_generate_does(monkeypatch, compile_mode, bad, failing):
    """The drafts bench times generate()'s loops: its plain and speculative loops get generate()'s XLA options
    for ``--compile`` (infer.bench.loops), so an option XLA does not know fails exactly the loops it reaches."""
    monkeypatch.setattr(importlib.import_module("infer.generate"), bad, {"xla_no_such_option": 1})
    target, draft = tiny_target(0), random_draft(1)
    runner = drafts.Runner(target, draft, 12, 4, drafts.SamplingConfig(), (2, 2), "xla", 1, compile_mode)
    prompt = list(range(3, 15))
    for loop, run in (("plain", lambda: runner.plain(prompt, 0)),
                      ("speculative", lambda: runner.speculative(draft.weights, prompt, 0))):
        if loop in failing:
            with pytest.raises(Exception, match="xla_no_such_option"):
                run()
        else:
            assert run()["generated"] == 4
