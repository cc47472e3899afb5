"""The profile reader: HLO instructions mapped to the Python functions that built them, busy time, and a profiled
in-loop step on the CPU (host op events stand in for GPU kernels); the profile benchmark's smoke run (slow)."""

import json

import jax
import jax.numpy as jnp
import pytest

from tools import trace
from tests.spec_helpers import record_tree_passes


def _inner_matmul(x):
    return x @ x


def _outer(x):
    return jnp.sin(_inner_matmul(x)).sum() + x


def test_hlo_sources_names_function_and_caller():
    text = jax.jit(_outer).lower(jnp.ones((64, 64))).compile().as_text()
    sources = trace.hlo_sources(text)
    assert any(v.startswith("tests/test_tools_trace.py:_inner_matmul < tests/test_tools_trace.py:_outer")
               for v in sources.values()), sources


def test_busy_merges_overlaps():
    events = [dict(start=0.0, dur=10.0), dict(start=5.0, dur=10.0), dict(start=30.0, dur=5.0)]
    assert trace.busy_ns(events) == 20.0


def test_idle_gaps_charged_to_the_kernel_that_ends_them():
    a, b, c, d = (dict(start=0.0, dur=10.0), dict(start=4.0, dur=2.0), dict(start=13.0, dur=5.0),
                  dict(start=30.0, dur=1.0))
    assert trace.idle_gaps([d, b, c, a]) == [(c, 3.0), (d, 12.0)]  # b runs inside a: no gap before it


def test_summary_tables_idle_time_by_source():
    events = [dict(name="k", hlo_op="mm", start=0.0, dur=1e3), dict(name="k", hlo_op="add", start=3e3, dur=1e3),
              dict(name="k", hlo_op="mm", start=4e3, dur=1e3)]
    summary = trace.summarize(events, {"mm": "f.py:matmul", "add": "f.py:residual"}, reps=1, wall_s=6e-6)
    assert summary["idle_us"] == 2.0 and summary["busy_us"] == 3.0 and summary["longest_gap_us"] == 2.0
    twice = trace.summarize(events + [dict(name="k", hlo_op="mm", start=9e3, dur=1e3)], {}, reps=2, wall_s=1e-5)
    assert twice["idle_us"] == 3.0 and twice["longest_gap_us"] == 4.0  # per step / the call's longest
    assert summary["idle_before"] == [dict(what="f.py:residual", us=2.0, launches=1)]
    assert summary["idle_before_kernel"] == [dict(what="k", us=2.0, launches=1)]


def test_profile_loop_attributes_time(tmp_path):
    x = jnp.ones((256, 256)) / 256
    hlo = tmp_path / "loop.hlo.txt"
    summary, carry = trace.profile_loop(lambda c: _outer(c) / 1e3, x, (), reps=3, hlo_path=str(hlo))
    assert carry.shape == x.shape
    assert hlo.read_text().startswith("HloModule") and "_inner_matmul" in hlo.read_text()  # the compiled module
    assert summary["reps"] == 3 and summary["launches"] > 0 and summary["wall_us"] > 0
    assert summary["kernel_sum_us"] > 0 and 0 < summary["busy_us"] <= summary["kernel_sum_us"] + 1e-6
    assert summary["idle_us"] >= 0 and sum(r["us"] for r in summary["idle_before"]) <= summary["idle_us"] + 1e-6
    assert any("_inner_matmul" in row["what"] for row in summary["by_source"]), summary["by_source"]
    assert summary["temp_mib"] >= 0  # XLA's memory analysis of the loop (the CPU backend has one)


@pytest.mark.slow
def test_profile_smoke(tmp_path, monkeypatch):
    from tools.profile import main

    assert main(["--out", str(tmp_path), "--smoke", "--hlo"]) == 0
    assert (tmp_path / "hlo" / "40" / "default_verify.hlo.txt").read_text().startswith("HloModule")
    text = (tmp_path / "bench_profile.md").read_text()
    for phase in ("plain", "draft_step0", "tree_level2", "verify", "round"):
        assert f"| {phase} |" in text
    assert main(["--out", str(tmp_path / "random"), "--smoke", "--model", "llama3-8b", "--tree", "2,2",
                 "--temperature", "1", "--batch", "2"]) == 0
    text = (tmp_path / "random" / "bench_profile.md").read_text()
    assert "| verify |" in text and "| tree_level2 |" in text and "| tree_level3 |" not in text
    report = json.loads((tmp_path / "random" / "bench_profile.json").read_text())
    assert report["tree_shape"] == [2, 2] and report["temperature"] == 1.0 and report["batch"] == 2
    passes = record_tree_passes(monkeypatch)
    assert main(["--out", str(tmp_path / "nodes"), "--smoke", "--phases", "verify", "--verify-node-multiples",
                 "1"]) == 0
    assert passes[0] == 72 and passes[-1] == 69 and set(passes) == {69, 72}  # default's 72 nodes, then nodes_1's
    report = json.loads((tmp_path / "nodes" / "bench_profile.json").read_text())
    assert set(report["contexts"]["40"]) == {"default", "nodes_1"}


def test_profile_args_carry_what_the_padded_pair_loader_reads(monkeypatch):
    """``profile --model padded`` hands its parsed args to ``spec.load_pair``, which reads the attention impl among
    others (it once failed on the H200 with an AttributeError: only ``spec`` defined ``--attention``)."""
    from infer.bench import spec
    from tools import profile

    monkeypatch.setattr(spec, "build_padded_pair", lambda fixture, pad, work: ("target-dir", "draft-dir"))
    monkeypatch.setattr("longspec_jax.load_target", lambda path, dtype: type("T", (), {"tokenizer": None})())
    monkeypatch.setattr("longspec_jax.load_draft", lambda path, target: "draft")
    monkeypatch.setattr(spec, "dev_prompt_tokens", lambda tokenizer, count: [0] * count)
    common = ["--out", "unused", "--fixture", "F", "--pad-script", "P", "--contexts", "64"]
    assert spec.load_pair(profile.parse_args(common), 64)[3] == "auto"
    assert spec.load_pair(profile.parse_args(common + ["--attention", "mosaic"]), 64)[3] == "mosaic"


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode, bad, failing", [
    ("reproducible", "REPRODUCIBLE_OPTIONS", {"plain", "verify"}),
    ("autotuned", "REPRODUCIBLE_OPTIONS", set()),
    ("autotuned", "SPECULATIVE_OPTIONS", {"verify"}),
])
def test_profile_compiles_phases_as_generate_does(tmp_path, monkeypatch, compile_mode, bad, failing):
    """``profile --compile`` gives each phase generate()'s options for its loop: an option XLA does not know
    fails exactly the phases it reaches (and is named in their rows)."""
    import importlib

    from tools.profile import main

    monkeypatch.setattr(importlib.import_module("infer.generate"), bad, {"xla_no_such_option": 1})
    assert main(["--out", str(tmp_path), "--smoke", "--phases", "plain,verify", "--tree", "2,2", "--reps", "1",
                 "--compile", compile_mode]) == 0
    report = json.loads((tmp_path / "bench_profile.json").read_text())
    assert report["compile"] == compile_mode
    rows = report["contexts"]["40"]["default"]
    assert set(rows) == {"plain", "verify"}
    assert {name for name, row in rows.items() if "xla_no_such_option" in row.get("error", "")} == failing
    assert all("error" not in row for name, row in rows.items() if name not in failing)


@pytest.mark.slow
def test_profile_draft_vocab_variant_computes_k_logits_a_node(tmp_path):
    """``--draft-vocabs 16``: a variant whose tree levels multiply by 16 LM-head columns where the default's use the
    target's 512."""
    from tools.profile import main

    assert main(["--out", str(tmp_path), "--smoke", "--model", "llama3-8b", "--tree", "2,2", "--draft-vocabs", "16",
                 "--phases", "tree_level2,round", "--hlo"]) == 0
    report = json.loads((tmp_path / "bench_profile.json").read_text())
    assert set(report["contexts"]["40"]) == {"default", "vocab_16"}
    hlo = {v: (tmp_path / "hlo" / "40" / f"{v}_tree_level2.hlo.txt").read_text() for v in ("default", "vocab_16")}
    assert "f32[2,512]{1,0} dot(" in hlo["default"] and "f32[2,16]{1,0} dot(" not in hlo["default"]
    assert "f32[2,16]{1,0} dot(" in hlo["vocab_16"] and "f32[2,512]{1,0} dot(" not in hlo["vocab_16"]
