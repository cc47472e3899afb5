"""``python -m infer.bench attention``: its inputs, the op loop's bookkeeping, the report, and a smoke run (tiny
shapes, Pallas interpret mode on the CPU)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tools import attention
from tools.attention_loop import L2_BYTES, cache_copies, l2_cell, l2_note, num_rotations, per_op
from tools.attention_ops import tree_masks
from tools.attention_report import markdown


def test_tree_masks_layout():
    (mask,) = tree_masks(np.random.default_rng(0), 1, 20, num_accepted=5, num_pad=5)
    np.testing.assert_array_equal(mask[:5, :5], np.tril(np.ones((5, 5), bool)))  # accepted: causal
    assert not mask[:5, 5:].any() and not mask[15:].any()  # accepted see no node; padding rows see nothing
    nodes = mask[5:15]
    assert nodes[:, :5].all() and np.diagonal(nodes[:, 5:15]).all()  # every node sees the accepted and itself
    assert not np.triu(nodes[:, 5:15], 1).any()  # ancestors only: parents come first


def test_rotation_and_l2_notes():
    assert num_rotations(10 * 2**20, smoke=False, max_rotate=32) == 18  # ceil(3 x 60 MiB / 10 MiB)
    assert num_rotations(10 * 2**20, smoke=False, max_rotate=16) == 16
    assert num_rotations(2**30, smoke=False, max_rotate=16) == 1
    assert num_rotations(2**30, smoke=True, max_rotate=16) == 2
    cold = l2_note(L2_BYTES, 3)
    assert cold["cold"] and cold["set_fits_l2"] and not cold["cycle_fits_l2"]
    assert l2_cell(cold) == f"no (3 x {L2_BYTES / 1e6:.3g} MB)"
    assert l2_cell(l2_note(1_000_000, 1)) == "yes (1 MB)"
    assert l2_cell(l2_note(L2_BYTES // 2, 3)) == f"partly (3 x {L2_BYTES / 2e6:.3g} MB)"
    assert l2_cell(None) == "-"


def test_cache_copies_finds_cache_shaped_copies_only():
    cache = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    hlo = "\n".join(["  %copy.3 = bf16[1,256,2,64]{3,2,1,0} copy(%p)", "  %add.1 = bf16[1,256,2,64]{3,2,1,0} add(%a)",
                     "  ROOT %transpose.7 = bf16[1,256,2,64]{3,2,1,0} transpose(%x)",
                     "  %copy.4 = f32[1,256,2,64]{3,2,1,0} copy(%q)"])
    assert cache_copies(hlo, cache) == ["copy.3", "transpose.7"]


def test_per_op_subtracts_the_empty_loop():
    t = dict(per_step_s=50e-6, n=10, steps_per_iter=2, call_s=1e-3, compile_s=1.234, num_cache_copies=0,
             cache_copies=[])
    r = per_op(t, dict(per_step_s=20e-6, num_cache_copies=0))
    assert r["us"] == pytest.approx(30.0) and r["raw_us"] == pytest.approx(50.0)
    assert r["overhead_us"] == pytest.approx(20.0) and r["loop"]["compile_s"] == 1.23
    assert r["loop"]["call_ms"] == pytest.approx(1.0)


def test_markdown_marks_skipped_rows():
    report = dict(date="d", device="H200", jax="0.11", table=[dict(model="vicuna-7b", B=4, S=65536, skipped=True)])
    assert "| vicuna-7b | 4 | 65536 | skipped (budget) |" in markdown(report)


def test_checks_are_not_a_section_any_more():
    with pytest.raises(SystemExit):
        attention.parse_args(["--out", "x", "--sections", "checks,copy"])


@pytest.mark.slow
def test_bench_attention_smoke(tmp_path):
    """The benchmark runs end to end on tiny shapes (interpret mode) and writes its report: every op timed inside
    a jitted loop (with the empty-loop overhead measured), K/V sets rotated, default sweep row."""
    report = attention.main(["--smoke", "--out", str(tmp_path)])
    assert report["copy"]["bytes_per_s"] > 0 and report["copy"]["dispatch"]["bytes_per_s"] > 0
    assert report["sweep"] and all("us" in r for r in report["sweep"]), report["sweep"]
    assert [r["default"] for r in report["sweep"]][0] is True  # the current default_config comes first
    assert [r["default"] for r in report["sweep_cudnn"]] == [True, False]
    assert all("us" in r for r in report["sweep_cudnn"])
    (row,) = report["table"]
    assert not row["errors"], row["errors"]
    names = {"gpu", "pallas", "xla", "naive", "cache", "kernel", "cache_cudnn", "tree", "decode", "decode_cudnn",
             "dpa"}  # cudnn and mgpu need a GPU
    assert set(row["us"]) == set(row["raw_us"]) == set(row["overhead_us"]) == names
    assert all(row["overhead_us"][k] > 0 and row["raw_us"][k] > 0 for k in names)
    assert all(abs(row["us"][k] - (row["raw_us"][k] - row["overhead_us"][k])) < 1e-6 for k in names)
    assert row["l2"]["rotate"] == 2 and row["loop"]["cache"]["steps_per_iter"] == 2  # rotation path runs
    assert row["loop"]["tree"]["steps_per_iter"] == 1
    assert all(v["empty_num_cache_copies"] == 0 for v in row["loop"].values())
    assert all(row["loop"][k]["num_cache_copies"] == 0 for k in ("xla", "naive", "dpa"))  # XLA-only ops
    saved = json.loads((tmp_path / "bench_attention.json").read_text())
    assert saved["table"][0]["us"].keys() == row["us"].keys()
    md = (tmp_path / "bench_attention.md").read_text()
    assert "| llama3-8b | 1 | 256 |" in md and "| K/V fits L2 |" in md and "| 1 (default) |" in md


def test_mosaic_variants_are_the_asked_one_step_changes():
    """``--mosaic-variants``: the default config first, then one-step changes of the kinds asked for only."""
    import argparse
    import dataclasses

    from tools.attention_mosaic import VARIANT_KINDS, variants
    from pallas.mosaic_cache_attention import MosaicConfig

    base = MosaicConfig(num_splits=12, stages=3)
    every = variants(base, 16384)
    assert every[0] == base and len(set(every)) == len(every)
    changed = lambda c: {f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(base, f.name)}
    assert all(len(changed(c)) == 1 or changed(c) == {"block_kv", "stages"} for c in every[1:])
    assert variants(base, 16384, ()) == [base]
    splits_only = variants(base, 16384, ("splits",))
    assert splits_only[1:] and all(changed(c) == {"num_splits"} for c in splits_only[1:])
    assert [c.num_splits for c in splits_only] == [12, 8, 10, 11, 13, 14, 18, 24]
    assert [c.num_splits for c in variants(dataclasses.replace(base, num_splits=2), 16384, ("splits",))] == [2, 1, 3, 4]
    assert attention.variant_kinds_arg("none") == () and attention.variant_kinds_arg("wgs,splits") == ("wgs", "splits")
    assert attention.variant_kinds_arg(",".join(VARIANT_KINDS)) == VARIANT_KINDS
    assert variants(base, 16384, ("schedule",)) == [base, dataclasses.replace(base, pingpong=False)]
    assert variants(dataclasses.replace(base, compute_wgs=3), 16384, ("schedule",))[1:] == []  # ping-pong needs two
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant kind"):
        attention.variant_kinds_arg("barrier")
    # the one-wave rule's light row block: beside it the same splits for every row block and the rule before it;
    # split neighbours keep the light row block within their count
    light = dataclasses.replace(base, num_splits=4, light_splits=3)
    before = dataclasses.replace(base, num_splits=11)
    assert variants(light, 16384, ("light",), before) == [light, dataclasses.replace(light, light_splits=None),
                                                          before]
    assert variants(base, 16384, ("light",), before) == [base]
    assert [(c.num_splits, c.light_splits) for c in variants(light, 16384, ("splits",))] == [
        (4, 3), (2, 2), (3, 3), (5, 3), (6, 3), (8, 3)]


def test_mosaic_table_shows_the_light_row_blocks_splits():
    from tools.attention_mosaic import mosaic_markdown
    row = dict(model="padded-8b", D=64, S=16384, B=1, impl="mosaic", default=True, us=71.0, frac_roofline=0.39,
               roofline_us=27.5, config=dict(num_splits=4, light_splits=3, block_kv=128, stages=3, compute_wgs=3,
                                             pingpong=True, accumulate="state"))
    text = "\n".join(mosaic_markdown([row, dict(row, default=False, config=dict(row["config"], light_splits=None))]))
    assert "| mosaic (default) | 4 | 3 | 128 |" in text and "| mosaic | 4 | - | 128 |" in text


def _trace(block: int, wg: int, compute_wgs: int, scopes: list) -> list:
    """Profiler events of one warpgroup: ``scopes`` = [(name, begin, end)] in thousands of cycles."""
    tid = 1 + block * (compute_wgs + 1) + wg
    events = []
    for name, begin, end in scopes:
        events += [dict(name=name, ph="B", ts=begin, pid=1, tid=tid), dict(name=name, ph="E", ts=end, pid=1, tid=tid)]
    return events


def test_phase_table_averages_the_compute_warpgroups_that_ran():
    from tools.mosaic_phases import phase_table, phases_markdown
    C = 2
    nested = _trace(1, 1, C, [("softmax", 10, 20)])
    nested[1:1] = _trace(1, 1, C, [("inner", 12, 13)])  # a scope inside softmax: its time is softmax's
    events = (_trace(0, 0, C, [("Init", 0, 1), ("load_q", 1, 3), ("scores", 3, 4), ("softmax", 4, 8),
                               ("pv", 8, 10), ("write_out", 11, 12)])
              + _trace(0, 1, C, [("Init", 0, 1), ("load_q", 1, 2), ("scores", 2, 5), ("softmax", 5, 7),
                                 ("pv", 7, 8), ("scores", 8, 9), ("softmax", 9, 11), ("write_out", 11, 12)])
              + _trace(0, 2, C, [("Init", 0, 1), ("softmax", 1, 2)])  # the memory warpgroup: not counted
              + _trace(1, 0, C, [("Init", 100, 101), ("load_q", 101, 140)])  # all padding (no softmax): not counted
              + nested)
    table = phase_table(events, C)
    assert table["traces"] == 3
    assert table["kcycles"] == pytest.approx(dict(load_q=1.0, scores=5 / 3, softmax=(4 + 4 + 10) / 3, pv=1.0,
                                                  write_out=2 / 3))
    assert table["span_kcycles"] == pytest.approx((12 + 12 + 10) / 3)
    assert table["other_kcycles"] == pytest.approx(table["span_kcycles"] - sum(table["kcycles"].values()))
    config = dict(num_splits=11, compute_wgs=3, block_kv=128, stages=3, pingpong=True, accumulate="state")
    row = dict(model="padded-8b", D=64, S=16384, B=1, rows=276, config=config, default=True, **table)
    failed = dict(model="padded-8b", D=64, S=16384, B=1, rows=276, default=False, error="boom",
                  config=dict(config, compute_wgs=2, pingpong=False, accumulate="fresh"))
    text = "\n".join(phases_markdown([row, failed]))
    assert ("| padded-8b | 64 | 16384 | 1 | 276 | 11 splits, 3 wgs, 128-key blocks, 3 stages (default) | 3 | 11.3 | "
            "1.0 (9%) | 1.7 (15%) | 6.0 (53%) |") in text
    assert "| 11 splits, 2 wgs, 128-key blocks, 3 stages, free, fresh | boom |" in text
    with pytest.raises(ValueError, match="no compute warpgroup"):
        phase_table(_trace(0, 2, C, [("Init", 0, 1)]), C)


def test_phases_section_is_gpu_only_and_profiling_needs_the_compiled_kernel(tmp_path, monkeypatch):
    from tools import mosaic_phases
    from pallas.mosaic_cache_attention import MosaicConfig, mosaic_cache_partials
    report = attention.main(["--sections", "phases", "--out", str(tmp_path)])
    assert "mosaic_phases" not in report and (tmp_path / "bench_attention.json").exists()  # skipped off a GPU
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="profile_dir needs the compiled kernel"):
        mosaic_cache_partials(q, kv, kv, jnp.array([128]), cfg=MosaicConfig(num_splits=1, compute_wgs=1), scale=0.1,
                              interpret=True, profile_dir=str(tmp_path))

    profiled = []
    monkeypatch.setattr(mosaic_phases, "make_inputs", lambda *a: {})
    monkeypatch.setattr(mosaic_phases, "profile_config", lambda inputs, cfg, K, rows: profiled.append((cfg, K, rows))
                        or dict(traces=1, span_kcycles=1.0, kcycles={}, other_kcycles=1.0))
    args = attention.parse_args(["--out", str(tmp_path), "--mosaic-shapes", "padded-8b:64:16384:1",
                                 "--mosaic-variants", "wgs"])
    recs = mosaic_phases.run_phases(args)
    assert [r["default"] for r in recs] == [True, False, False] and [p[1:] for p in profiled] == [(18, 296)] * 3
    assert [p[0].compute_wgs for p in profiled] == [3, 1, 2]  # the default (three above 128 rows), then the others

    def no_cpu(*_):
        raise RuntimeError("Unknown backend cpu")
    monkeypatch.setattr(mosaic_phases.jax, "devices", no_cpu)
    with pytest.raises(RuntimeError, match="JAX_PLATFORMS=cuda,cpu"):
        mosaic_phases.run_phases(args)
