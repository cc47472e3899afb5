"""``python -m infer.bench tasks``: method parsing, the metric arithmetic on hand-made runs, the table and plots
rendering, the HF baseline against our plain greedy output (a tiny HF Llama, float32 on the CPU), and a smoke
run (slow)."""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from infer import generate
from infer.bench.task_report import _speedup_figure, best_tree_shapes, markdown, plot, summarize_runs
from infer.bench.tasks import main, methods_at, parse_methods, probe_tokens
from longspec_jax import load_target
from tests.train_helpers import build_target_dir


def test_methods_expand_drafts_and_shapes():
    methods = parse_methods(["plain", "tree", "chain", "pld", "hf", "hf_pld"], ["ours", "ref"],
                            [(4, 16), (2, 8, 8)], (1, 1, 1), 10)
    # the shape sweep for the first draft, the first shape for the others
    assert [m.name for m in methods] == ["plain", "tree[ours]4,16", "tree[ours]2,8,8", "tree[ref]4,16",
                                         "chain[ours]3", "chain[ref]3", "pld10", "hf", "hf_pld"]
    assert methods[-1].hf_lookup == 10 and methods[-2].hf_lookup == 0 and methods[6].lookup.num_tokens == 10
    with pytest.raises(ValueError, match="start with plain"):
        parse_methods(["tree", "plain"], ["a"], [(2,)], (1,), 4)
    sampled = parse_methods(["plain", "schain"], ["ours"], [(2,)], (1, 1), 4)[1]
    assert (sampled.name, sampled.tree, sampled.draft_sampling) == ("schain[ours]2", (1, 1), True)
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        parse_methods(["plain", "medusa"], [], [], (1,), 4)


def test_summary_arithmetic():
    runs = [dict(generated=[10, 10], rounds=[4, 3], total_s=1.0, probe_generated=[6, 6], probe_rounds=[2, 2],
                 probe_s=0.7, accept_counts=[[1, 2], [0, 2]]),
            dict(generated=[8], rounds=[3], total_s=0.5, probe_generated=[5], probe_rounds=[1], probe_s=0.35,
                 accept_counts=[[1, 2]])]
    row = summarize_runs(runs)
    assert row["generated"] == 28 and row["rounds"] == 10 and row["sequences"] == 3
    assert row["tau"] == pytest.approx(28 / 13)                          # tokens / (rounds + 1 per sequence)
    assert row["idle_row_share"] == pytest.approx(1 / 11)  # passes 4 x 2 rows + 3 x 1 row; row 2 idle in one
    assert row["tokens_per_s"] == pytest.approx((28 - 17) / (0.3 + 0.15))  # between probe and full call
    assert row["call_s"] == pytest.approx(1.5)  # the full calls: prefill and every token
    assert row["pass_ms"] == pytest.approx(1e3 * 0.45 / 4)  # the window's passes: (4 - 2) + (3 - 1)
    assert row["window_tau"] == pytest.approx((28 - 17) / (2 * 2 + 1 * 2))  # per row: 2 rows x 2 passes, 1 x 2
    # prefill: probe time less its passes, at the cost per pass between probe and full call (the batch's longest
    # row: 0.3 s / (4 - 2) passes, 0.15 s / (3 - 1)); per token the first run's would be 0.7 - 5 * 0.3 / 4
    assert row["prefill_s"] == pytest.approx((0.7 - 2 * 0.15) + (0.35 - 1 * 0.075))
    # a probe that accepted more per pass than the full call: per pass stays positive, per token would not
    fast_probe = dict(generated=[10], rounds=[8], total_s=0.8, probe_generated=[8], probe_rounds=[2], probe_s=0.25)
    assert summarize_runs([fast_probe])["prefill_s"] == pytest.approx(0.25 - 2 * 0.55 / 6)
    # a long output (16 new tokens on a 20-token prompt): its passes cost more late than early, no estimate
    assert summarize_runs([dict(fast_probe, prompt_tokens=[20])])["prefill_s"] == pytest.approx(0.25 - 2 * 0.55 / 6)
    assert math.isnan(summarize_runs([dict(fast_probe, generated=[16], prompt_tokens=[20, 30])])["prefill_s"])
    assert row["accept_counts"] == [2, 6]
    hf = summarize_runs([dict(generated=[5], rounds=None, total_s=1.0, probe_generated=[1], probe_s=0.5)])
    assert math.isnan(hf["tau"]) and math.isnan(hf["pass_ms"])
    assert hf["tokens_per_s"] == pytest.approx(8.0) and hf["prefill_s"] == 0.5
    assert math.isnan(hf["idle_row_share"]) and summarize_runs([fast_probe])["idle_row_share"] == 0



def test_reports_of_several_runs_merge_into_one_table_and_plots(tmp_path):
    from infer.bench import task_report

    def report(bucket, speedup, date):
        rows = [dict(task="t", bucket=bucket, temperature=1.0, batch=1, method=m, tau=t, tokens_per_s=100.0 * s,
                     speedup=s, call_speedup=s, prefill_s=1.0, peak_bytes=None)
                for m, t, s in (("plain", 1.0, 1.0), ("auto[a]", 2.5, speedup))]
        path = tmp_path / f"{bucket}.json"
        path.write_text(json.dumps(dict(date=date, device="D", rows=rows)))
        return str(path)

    runs = [report("120-126k", 2.6, "d2"), report("60-64k", 2.1, "d1")]
    assert task_report.main(["--out", str(tmp_path / "merged"), *runs]) == 0
    merged = json.loads((tmp_path / "merged" / "bench_tasks.json").read_text())
    assert [r["date"] for r in merged["runs"]] == ["d2", "d1"] and len(merged["rows"]) == 4
    table = (tmp_path / "merged" / "bench_tasks.md").read_text()
    assert "| t | 60-64k | 1.0 | 1 | auto[a] | 2.50 | 210.0 | 2.10x | 2.10x |" in table
    assert (tmp_path / "merged" / "tasks_speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert task_report.bucket_order(["120-126k", "16-32", "60-64k", "1-2k"]) == ["16-32", "1-2k", "60-64k",
                                                                                 "120-126k"]

def test_probe_reuses_the_full_calls_program():
    from longspec_jax.testing import random_draft, tiny_target
    from infer.generate import plan_lookup, plan_shapes, plan_speculative
    from infer.lookup import PromptLookup
    from longspec_jax.sampling import SamplingConfig

    assert [probe_tokens(n) for n in (256, 200, 160, 16, 10, 1)] == [129, 129, 1, 9, 1, 1]
    target, draft, sampling = tiny_target(0), random_draft(1), SamplingConfig(temperature=0.0, top_p=1.0)
    for n in (256, 200, 16):
        assert plan_shapes(300, n, 1, 256) == plan_shapes(300, probe_tokens(n), 1, 256)
        assert (plan_speculative(target, draft, 300, n, sampling, (2, 4), 256, "xla")
                == plan_speculative(target, draft, 300, probe_tokens(n), sampling, (2, 4), 256, "xla"))
        assert (plan_lookup(target, PromptLookup(num_tokens=4), 300, n, sampling, 256, "xla")
                == plan_lookup(target, PromptLookup(num_tokens=4), 300, probe_tokens(n), sampling, 256, "xla"))


def test_table_and_plots_render(tmp_path):
    rows = []
    for bucket, tps in (("2-4k", 100.0), ("4-8k", 90.0)):
        base = dict(task="t", bucket=bucket, temperature=0.0, batch=1, prefill_s=0.1, peak_bytes=2**31)
        rows.append(dict(base, method="plain", tau=1.0, tokens_per_s=tps, speedup=1.0, repeat_4gram_share=0.5))
        rows.append(dict(base, method="tree[a]4", tau=3.0, tokens_per_s=2 * tps, speedup=2.0, idle_row_share=0.25,
                         call_speedup=1.25, pass_ms=12.5, pass_steps=1.25, accept_counts=[1, 2, 3],
                         partings=[None, dict(at=7, f32_top2_gap=0.02, near_tie=True)]))
        rows.append(dict(base, method="tree[a]2,2", tau=2.0, tokens_per_s=tps * (2.5 if bucket == "4-8k" else 1.5),
                         speedup=2.5 if bucket == "4-8k" else 1.5))
        rows.append(dict(base, method="tree[b]4", tau=3.0, tokens_per_s=9 * tps, speedup=9.0))  # not swept
    table = markdown(rows)
    assert "| t | 2-4k | 0.0 | 1 | tree[a]4 | 3.00 | 200.0 | 2.00x | 1.25x | 12.50 (1.25) | 0.25 | 0.10 | 2.0 |  | " \
           "1/2 (1 near-tie) |" in table
    no_idle_share_nor_call = "| t | 2-4k | 0.0 | 1 | tree[a]2,2 | 2.00 | 150.0 | 1.50x |  |  |  | 0.10 | 2.0 |  |  |"
    assert no_idle_share_nor_call in table
    no_prefill = "| t | 2-4k | 0.0 | 1 | tree[a]2,2 | 2.00 | 150.0 | 1.50x |  |  |  |  | 2.0 |  |  |"  # a long output
    assert no_prefill in markdown([dict(rows[2], prefill_s=float("nan"))])
    assert "predictions" not in table  # no row records a prediction
    auto = dict(rows[1], method="auto[a]", window_tau=2.5, speculation=dict(
        tree_shape=[4], draft_sampling=None, expected_tokens=3.0, predicted_speedup=2.4))
    assert "| t | 2-4k | 0.0 | 1 | auto[a]: 4 | 3.00 / 2.50 | 1.25 / 1.25 | 2.40x / 2.00x |" in markdown(rows + [auto])
    older = {k: v for k, v in auto.items() if k not in ("window_tau", "pass_steps")}  # a report before them
    assert "| t | 2-4k | 0.0 | 1 | auto[a]: 4 | 3.00 | 1.25 | 2.40x / 2.00x |" in markdown(rows + [older])
    assert [(b["bucket"], b["shape"], b["speedup"], b["tried"]) for b in best_tree_shapes(rows)] == [
        ("2-4k", "4", 2.0, 2), ("4-8k", "2,2", 2.5, 2)]
    assert "| t | 4-8k | 0.0 | 1 | 2,2 | 2.50x | 2 |" in table
    for path in plot(rows, str(tmp_path), ["2-4k", "4-8k"]):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "tasks_batch.png").exists()  # one batch size: no batch plot
    batch2 = [dict(r, batch=2, speedup=r["speedup"] / 2) for r in rows]
    paths = plot(rows + batch2 + [dict(rows[0], method="hf", error="OutOfMemoryError", tokens_per_s=float("nan"))],
                 str(tmp_path), ["2-4k", "4-8k"])
    assert paths[-1] == str(tmp_path / "tasks_batch.png") and len(paths) == 4
    import matplotlib.pyplot as plt
    late_short = [dict(r, batch=8, bucket="1-2k") for r in rows if r["bucket"] == "2-4k"]  # drawn last, shortest
    fig = _speedup_figure(plt, rows + late_short, [0.0], ["plain", "tree[a]4"], ["1-2k", "2-4k", "4-8k"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1-2k", "2-4k", "4-8k"]
    assert [list(line.get_xdata()) for line in ax.get_lines()[:2]] == [[1, 2], [0]]
    plt.close(fig)
    with open(paths[-1], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_best_tree_shape_ranks_an_untimed_speedup_last():
    nan = float("nan")
    rows = [dict(task="t", bucket=bucket, temperature=0.0, batch=1, method=f"tree[a]{shape}", speedup=speedup)
            for bucket, runs in (("2-4k", (("4", nan), ("2,2", 1.2), ("8", nan))), ("4-8k", (("4", nan),)))
            for shape, speedup in runs]
    best = best_tree_shapes(rows)
    assert [(b["bucket"], b["shape"], b["tried"]) for b in best] == [("2-4k", "2,2", 3), ("4-8k", "4", 1)]
    assert best[0]["speedup"] == 1.2 and math.isnan(best[1]["speedup"])
    assert "| t | 4-8k | 0.0 | 1 | 4 | nanx | 1 |" in markdown([dict(r, tau=1.0, tokens_per_s=nan, prefill_s=0.1)
                                                              for r in rows])


def test_hf_baseline_matches_our_greedy_output(tmp_path):
    from infer.bench.task_hf import HFRunner

    path = build_target_dir(tmp_path / "target")
    target = load_target(path, dtype=jnp.float32)
    prompt = np.random.default_rng(0).integers(4, target.config.vocab_size, 40).tolist()
    ours = generate(target, [prompt], max_new_tokens=12, eos_token_id=[]).tokens[0].tolist()
    runner = HFRunner(str(path))
    for lookup in (0, 4):
        run = runner.run([prompt], 12, 0.0, lookup, seed=0, eos_ids=[])
        assert run["tokens"] == [ours] and run["generated"] == [12]
        assert run["total_s"] > 0 and run["probe_s"] > 0 and run["probe_generated"] == [1]


def test_hf_baseline_batches_left_padded_rows_like_our_greedy_output(tmp_path):
    from infer.bench.task_hf import HFRunner

    path = build_target_dir(tmp_path / "target")
    target = load_target(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, target.config.vocab_size, n).tolist() for n in (40, 29, 33)]
    prompts[1][:3] = [0, 0, 0]  # the padding id inside a prompt: only the attention mask tells them apart
    runner = HFRunner(str(path))
    ours = generate(target, prompts, max_new_tokens=12, eos_token_id=[])
    run = runner.run(prompts, 12, 0.0, 0, seed=0, eos_ids=[])
    assert run["tokens"] == ours.tokens.tolist() and run["generated"] == [12, 12, 12]
    assert run["probe_generated"] == [1, 1, 1]
    eos = ours.tokens[1, 4].item()  # row 1 ends at its 5th token (the others where, or if, they reach it)
    ours = generate(target, prompts, max_new_tokens=12, eos_token_id=eos)
    run = runner.run(prompts, 12, 0.0, 0, seed=0, eos_ids=[eos])
    assert run["generated"] == ours.num_generated.tolist() and run["generated"][1] == 5
    assert run["tokens"] == [ours.tokens[b, :n].tolist() for b, n in enumerate(ours.num_generated)]
    with pytest.raises(ValueError, match="batch 1 only"):
        runner.run(prompts, 12, 0.0, 4, seed=0, eos_ids=[])


@pytest.mark.slow
def test_smoke_run(tmp_path):
    assert main(["--out", str(tmp_path), "--smoke", "--reps", "1"]) == 0
    report = json.loads((tmp_path / "bench_tasks.json").read_text())
    methods = {r["method"] for r in report["rows"]}
    assert methods == {"plain", "auto[a]", "tree[a]2,4,4", "chain[a]4", "pld10"}
    assert all(r["speculation"]["reason"] for r in report["rows"] if r["method"] == "auto[a]")
    assert {r["batch"] for r in report["rows"]} == {1, 2}
    assert all(r["partings"] == [None] * 2 for r in report["rows"] if r["method"] != "plain")
    peak = {(r["method"], r["batch"]): r["peak_bytes"] for r in report["rows"]}  # per program, not per process
    assert peak["plain", 1] < peak["plain", 2] and peak["plain", 1] < peak["tree[a]2,4,4", 1]
    assert [r["prefill_s"] > 0 for r in report["rows"]] == [True] * len(report["rows"])
    assert [(b["batch"], b["shape"], b["tried"]) for b in report["best_tree_shapes"]] == [(1, "2,4,4", 1),
                                                                                          (2, "2,4,4", 1)]
    names = ["tasks_speed.png", "tasks_speedup.png", "tasks_accept_hist.png", "tasks_batch.png"]  # batches 1, 2
    assert report["plots"] == [str(tmp_path / name) for name in names]
    assert all((tmp_path / name).exists() for name in names)


def test_rope_parameters_option_wants_a_json_object(capsys):
    for bad in ("[1]", "{factor: 2}"):
        with pytest.raises(SystemExit):
            main(["--smoke", "--rope-parameters", bad])
        assert "--rope-parameters" in capsys.readouterr().err


def canned_run(batch: list, method, fail: set[str]) -> dict:
    """What ``Runner`` returns for a batch (10 tokens in 4 passes, 6 of them in the probe's 2; pld's calls 0.2 s
    shorter, its decoding as fast), or the error of a method named in ``fail``."""
    if method.name in fail:
        raise RuntimeError(f"RESOURCE_EXHAUSTED: out of memory | {method.name}")
    b, shorter = len(batch), 0.2 if method.name == "pld10" else 0.0
    return dict(generated=[10] * b, rounds=[4] * b, total_s=1.0 - shorter, probe_generated=[6] * b,
                probe_rounds=[2] * b, probe_s=0.6 - shorter, peak_bytes=None, accept_counts=None,
                tokens=[list(s.tokens[:10]) for s in batch])


@pytest.mark.parametrize("fail", [{"tree[a]2,4,4"}, {"plain"}])
def test_a_failing_method_gets_a_failed_row_and_the_run_goes_on(tmp_path, monkeypatch, capsys, fail):
    from infer.bench import tasks

    monkeypatch.setattr(tasks.Runner, "__call__", lambda self, method, batch, t, pad: canned_run(batch, method, fail))
    assert main(["--out", str(tmp_path), "--smoke", "--reps", "1"]) == 0
    bar = capsys.readouterr().err.split("\r")[-1]  # the progress bar's last state: every planned row counted,
    assert bar.startswith("tasks: 100%") and "| 10/10 [" in bar  # those a failed plain skipped too (2 batches x 5)
    report = json.loads((tmp_path / "bench_tasks.json").read_text())
    table = (tmp_path / "bench_tasks.md").read_text()
    rows = {(r["method"], r["batch"]): r for r in report["rows"]}
    for batch in (1, 2):
        (name,) = fail
        assert rows[name, batch]["error"] == f"RuntimeError: RESOURCE_EXHAUSTED: out of memory | {name}"
        assert math.isnan(rows[name, batch]["tokens_per_s"])
        assert f"| {batch} | {name} | failed |  |  |  |  |  |  |  |  | RuntimeError: RESOURCE_EXHAUSTED: out of " \
               f"memory / {name} |" in table
        if name == "plain":  # no baseline: nothing else of the group runs
            assert [m for m, b in rows if b == batch] == ["plain"]
        else:  # the methods after the failed one ran and were compared with plain
            assert rows["chain[a]4", batch]["speedup"] == 1.0 and rows["pld10", batch]["tau"] == 2.0
            assert rows["chain[a]4", batch]["call_speedup"] == 1.0
            assert rows["pld10", batch]["speedup"] == pytest.approx(1.0)
            assert rows["pld10", batch]["call_speedup"] == pytest.approx(1.0 / 0.8)  # plain's call over pld's
            assert rows["pld10", batch]["pass_ms"] == pytest.approx(200.0)  # 0.4 s over the window's 2 passes
            assert rows["pld10", batch]["pass_steps"] == pytest.approx(1.0)  # plain's pass costs as much
    plots = [] if fail == {"plain"} else ["tasks_speed.png", "tasks_speedup.png", "tasks_accept_hist.png",
                                          "tasks_batch.png"]
    assert report["plots"] == [str(tmp_path / name) for name in plots]


def test_hf_methods_leave_gpu_memory_to_torch(monkeypatch):
    from infer.bench import tasks
    from infer.bench.task_hf import JAX_ALLOCATOR_SETTINGS, leave_gpu_memory_to_torch

    env = {}
    assert leave_gpu_memory_to_torch(env) and env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    for key in JAX_ALLOCATOR_SETTINGS:  # the user's own setting stays
        env = {key: "0.5"}
        assert not leave_gpu_memory_to_torch(env) and env == {key: "0.5"}
    monkeypatch.setattr(tasks, "run", lambda args: dict(rows=[]))
    for methods, expected in (("plain,tree", None), ("plain,hf", "false"), ("plain,hf_pld", "false")):
        for key in JAX_ALLOCATOR_SETTINGS:  # set, then deleted: monkeypatch restores the process's own at the end
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)
        main(["--out", "unused", "--target", "t", "--repo-docs", "d.jsonl", "--methods", methods])
        assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == expected


@pytest.mark.parametrize("argv, message", [
    (["--tree-shapes", "4,8;2,x"], "--tree-shapes: expected comma-separated positive integers, got '2,x'"),
    (["--temperatures", "0,-1"], "--temperatures: must be >= 0, got -1"),
    (["--buckets", "1024-x"], "--buckets: invalid literal for int()"),
    (["--batch-sizes", "1,two"], "--batch-sizes: invalid literal for int()"),
    (["--chain", "1,0"], "--chain: expected comma-separated positive integers, got '1,0'"),
])
def test_list_arguments_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--target", "t", "--repo-docs", "r.jsonl"] + argv)
    assert message in capsys.readouterr().err


def test_methods_at_batch_and_temperature():
    """HF's prompt lookup runs at batch 1 only, trees sampled from the draft at T > 0 only, auto everywhere."""
    methods = parse_methods(["plain", "auto", "chain", "schain", "stree", "hf_pld"], ["ours"], [(2,)], (1, 1), 4,
                            [(2, 2)], "top_plus_one")
    names = lambda batch, t: [m.name for m in methods_at(methods, batch, t)]
    assert names(1, 0.0) == ["plain", "auto[ours]", "chain[ours]2", "hf_pld"]
    assert names(1, 1.0) == ["plain", "auto[ours]", "chain[ours]2", "schain[ours]2", "stree+1[ours]2,2", "hf_pld"]
    assert names(2, 1.0) == ["plain", "auto[ours]", "chain[ours]2", "schain[ours]2", "stree+1[ours]2,2"]


def test_runner_asks_generate_for_what_each_method_is(monkeypatch):
    """A sampled chain reaches generate() as draft_sampling=True with its chain, a sampled tree with its kind, the
    argmax chain as draft_sampling=False, and auto with neither option (generate chooses)."""
    import argparse

    from infer.bench import tasks
    from infer.bench.task_data import Sample
    from infer.generate import GenerateOutput

    calls = []

    def fake_generate(target, prompts, max_new_tokens, **kwargs):
        calls.append(kwargs)
        shape = (len(prompts), max_new_tokens)
        return GenerateOutput(tokens=np.zeros(shape, np.int32), num_generated=np.full(len(prompts), max_new_tokens),
                              num_rounds=np.full(len(prompts), max_new_tokens), mean_accepted=1.0)

    monkeypatch.setattr(tasks, "generate", fake_generate)
    args = argparse.Namespace(new_tokens=8, reps=1, ignore_eos=True, seed=0)
    runner = tasks.Runner(target=None, drafts={"ours": "draft"}, hf=None, args=args)
    sample = Sample("synthetic", "0", "", [], [1, 2, 3])
    schain, chain, stree, auto = parse_methods(["plain", "schain", "chain", "stree", "auto"], ["ours"], [(2,)],
                                               (1, 1), 4, [(2, 2)], "top_plus_one")[1:]
    for method, expected in ((schain, dict(draft_sampling=True, tree_shape=(1, 1))),
                             (chain, dict(draft_sampling=False, tree_shape=(1, 1))),
                             (stree, dict(draft_sampling="top_plus_one", tree_shape=(2, 2)))):
        calls.clear()
        runner(method, [sample], 1.0, 16)
        assert calls and all({k: c.get(k) for k in expected} == expected for c in calls)
    calls.clear()
    runner(auto, [sample], 1.0, 16)
    assert calls and all("draft_sampling" not in c and "tree_shape" not in c for c in calls)


def test_runner_compiles_in_the_probe_and_retimes_a_full_call_that_compiled(monkeypatch):
    """The warm-up is the probe (it runs the full call's program); where the full call compiled anyway (auto
    choosing another shape for its longer context), probe and full call are timed again with that choice."""
    import types

    from infer.bench import tasks
    from infer.bench.harness import backend_compiles
    from infer.bench.task_data import Sample
    from longspec_jax.testing import random_draft, tiny_target

    target = tiny_target(0)
    args = types.SimpleNamespace(new_tokens=16, reps=1, ignore_eos=True, seed=0)
    runner = tasks.Runner(target, {"a": random_draft(1)}, None, args)
    assert runner.warmup_tokens == (9,)
    batch = [Sample("t", "0", "", [], list(range(3, 40)))]
    calls = []
    generate = tasks.generate
    monkeypatch.setattr(tasks, "generate", lambda *a, **k: calls.append(k["max_new_tokens"]) or generate(*a, **k))
    chain = tasks.Method("chain[a]2", draft="a", tree=(1, 1), draft_sampling=False)
    runner(chain, batch, 0.0, 64)  # compiles in the warm-up
    compiled = backend_compiles()
    run = runner(chain, batch, 0.0, 64)
    assert backend_compiles() == compiled and calls == [9, 9, 16, 9, 16]  # warm-up, probe, full; then probe, full
    assert run["generated"] == [16] and run["probe_generated"] == [9]
    counts = iter([0, 1])  # the full call compiled
    monkeypatch.setattr(tasks, "backend_compiles", lambda: next(counts))
    calls.clear()
    runner(chain, batch, 0.0, 64)
    assert calls == [9, 16, 9, 16]  # probe and full call again, with the full call's choice


def test_chosen_repeats_what_a_call_speculated_with():
    from infer.bench.tasks import chosen
    from infer.speculation import Speculation

    assert chosen(Speculation((8, 8, 7), "without_replacement", "auto")) == dict(
        tree_shape=(8, 8, 7), draft_sampling="without_replacement")
    assert chosen(Speculation((3, 4), None, "auto")) == dict(tree_shape=(3, 4), draft_sampling=False)
    assert chosen(Speculation(None, None, "auto: plain")) == dict(draft=None)
    assert chosen(None) == {}  # plain or prompt lookup: the call's own arguments
