"""Results of the tasks benchmark: one row per (task, bucket, temperature, batch, method) from the runs of its
sample batches, the markdown table, and the plots (tokens/s, tau and speedup against context length per method;
the acceptance-length histogram). The reports of several runs (one per context length, say) merge into one:

    python -m infer.bench.task_report --out DIR RUN1/bench_tasks.json RUN2/bench_tasks.json ...

Conventions (the PyTorch LongSpec evaluation's): tau = tokens generated / (rounds + 1); decode tokens/s = (tokens
generated - tokens of the probe call) / (generation time - probe time), summed over the batches, so prefill is left
out; prefill time = the probe's time less its own decoding at that rate; speedup against plain decoding of the same
samples in the same run; pass ms = the decode window's time per target pass (a round; plain: a step), and in
brackets that over plain's: a round's cost in plain steps, so that speedup = the window's tokens per pass / it (tau
counts the whole call's passes, whose acceptance can differ from the window's; a table of their own sets the cost
model's predictions against the window's tokens per pass, round cost and speedup); idle rows = the share of a
batch's row slots that rode along after their row was done.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from infer.bench.harness import md_header, md_row, write_report
from infer.bench.near_tie import lossless_cell


def summarize_runs(runs: list[dict]) -> dict:
    """Totals of one method over its batches; each run: ``generated`` [B], ``rounds`` [B] or None, ``total_s``,
    ``probe_generated`` [B], ``probe_s``, ``probe_rounds`` [B] or None, optional ``accept_counts`` [B, A].
    ``idle_row_share``: a batch's rows pass together until its last row is done, and a row done earlier rides
    along idle: the share of row slots in the full calls' passes that were idle (0 at batch 1; NaN for HF).
    ``call_s``: the full calls' seconds, prefill and every token (a long output's whole generation).
    ``pass_ms``: milliseconds a target pass (a round; plain: a token step) over the decode window, the passes
    between probe and full call, the window tokens/s is measured over (NaN for HF, which reports no passes);
    ``window_tau``: tokens a row emitted per pass over that window (a batch's rows pass side by side)."""
    generated = sum(int(np.sum(r["generated"])) for r in runs)
    known = all(r["rounds"] is not None for r in runs)  # HF does not report its rounds
    rounds = sum(int(np.sum(r["rounds"])) for r in runs) if known else None
    sequences = sum(len(r["generated"]) for r in runs)
    decoded = generated - sum(int(np.sum(r["probe_generated"])) for r in runs)
    decode_s = sum(r["total_s"] - r["probe_s"] for r in runs)
    passes = sum(len(r["rounds"]) * max(r["rounds"]) for r in runs) if known else 0  # row slots of the passes
    decode_passes = sum(window_passes(r) for r in runs) if known else 0
    row_passes = sum(len(r["rounds"]) * window_passes(r) for r in runs) if known else 0
    row = dict(sequences=sequences, generated=generated, rounds=rounds,
               tau=generated / (rounds + sequences) if known else float("nan"),
               idle_row_share=1 - rounds / passes if passes else float("nan"),
               decode_s=decode_s, prefill_s=sum(prefill_seconds(r) for r in runs),
               call_s=sum(r["total_s"] for r in runs),
               pass_ms=1e3 * decode_s / decode_passes if decode_passes > 0 else float("nan"),
               window_tau=decoded / row_passes if row_passes > 0 else float("nan"),
               tokens_per_s=decoded / decode_s if decode_s > 0 and decoded > 0 else float("nan"))
    counts = [np.sum(r["accept_counts"], axis=0) for r in runs if r.get("accept_counts") is not None]
    if counts:
        row["accept_counts"] = np.sum(counts, axis=0).tolist()
    return row


def window_passes(run: dict) -> int:
    """Target passes between the probe and the full call (the batch's rows pass side by side: its longest row's)."""
    return max(run["rounds"]) - max(run["probe_rounds"])


PREFILL_GROWTH = 0.5  # the most a call may grow its shortest prompt's context for a prefill estimate


def prefill_seconds(run: dict) -> float:
    """The probe's time less its decoding, at the rate between probe and full call. Our methods count target
    passes (``rounds``, ``probe_rounds``; the batch's rows pass side by side, so its longest row): every pass of a
    compiled program costs the same whatever it accepts, while tokens per pass vary (per token, a probe that
    accepted more than the full call came out with a negative prefill). HF reports no passes: per token. NaN
    where the call grows a prompt's context by over ``PREFILL_GROWTH`` (``prompt_tokens`` known): a pass then
    costs more in the window than in the probe (a 2k prompt with 16k new tokens came out at -3.4 s)."""
    prompts = run.get("prompt_tokens")
    if prompts and max(run["generated"]) > PREFILL_GROWTH * min(prompts):
        return float("nan")
    if run.get("rounds") is not None and run.get("probe_rounds") is not None:
        probe, window = max(run["probe_rounds"]), window_passes(run)
    else:
        probe, window = np.mean(run["probe_generated"]) - 1, np.mean(run["generated"]) - np.mean(run["probe_generated"])
    step_s = (run["total_s"] - run["probe_s"]) / window if window > 0 else 0.0
    return run["probe_s"] - probe * step_s


def failed_row(row: dict) -> dict:
    """A method's row whose runs raised (``row["error"]``): its numbers NaN, so that tables and rankings keep it
    and the plots leave it out."""
    nan = float("nan")
    return dict(row, tau=nan, tokens_per_s=nan, speedup=nan, call_speedup=nan, prefill_s=nan, peak_bytes=None)


def method_cell(row: dict) -> str:
    """The method's name; for ``auto``, with what it chose (``plain``, or the tree and whether it was sampled)."""
    chosen = row.get("speculation")
    if not row["method"].startswith("auto") or chosen is None:
        return row["method"]
    if chosen["tree_shape"] is None:
        return f"{row['method']}: plain"
    kind = {"without_replacement": "sampled ", "top_plus_one": "sampled +1 "}.get(chosen["draft_sampling"], "")
    return f"{row['method']}: {kind}{','.join(map(str, chosen['tree_shape']))}"


def pass_cell(row: dict) -> str:
    """A target pass's milliseconds over the decode window and, beside plain, its cost in plain steps."""
    ms, steps = row.get("pass_ms", math.nan), row.get("pass_steps", math.nan)
    if math.isnan(ms):
        return ""
    return f"{ms:.2f}" if math.isnan(steps) else f"{ms:.2f} ({steps:.2f})"


def markdown(rows: list[dict]) -> str:
    lines = md_header(["task", "bucket", "T", "batch", "method", "tau", "tok/s", "speedup", "whole call",
                       "pass ms (plain steps)", "idle rows", "prefill s", "peak GiB", "repeated 4-grams",
                       "T=0 equal to plain"])
    for r in rows:
        if "error" in r:
            lines.append(md_row([r["task"], r["bucket"], r["temperature"], r["batch"], r["method"], "failed", "",
                                 "", "", "", "", "", "", "", r["error"].splitlines()[0][:100].replace("|", "/")]))
            continue
        idle = r.get("idle_row_share", math.nan)
        equal = "" if r.get("partings") is None else lossless_cell(r["partings"])
        peak = "" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:.1f}"
        lines.append(md_row([r["task"], r["bucket"], r["temperature"], r["batch"], method_cell(r), f"{r['tau']:.2f}",
                             f"{r['tokens_per_s']:.1f}", f"{r.get('speedup', float('nan')):.2f}x",
                             "" if "call_speedup" not in r else f"{r['call_speedup']:.2f}x", pass_cell(r),
                             "" if math.isnan(idle) else f"{idle:.2f}",
                             "" if math.isnan(r["prefill_s"]) else f"{r['prefill_s']:.2f}", peak,
                             "" if "repeat_4gram_share" not in r else f"{r['repeat_4gram_share']:.2f}",
                             equal]))
    lines += cost_model_predictions(rows)
    best = best_tree_shapes(rows)
    if best:
        lines += ["", f"Fastest shape of the tree sweep ({best[0]['draft']}), per bucket, temperature and batch:", ""]
        lines += md_header(["task", "bucket", "T", "batch", "best shape", "speedup", "shapes tried"])
        lines += [md_row([b["task"], b["bucket"], b["temperature"], b["batch"], b["shape"], f"{b['speedup']:.2f}x",
                          b["tried"]]) for b in best]
    return "\n".join(lines) + "\n"


def cost_model_predictions(rows: list[dict]) -> list[str]:
    """Markdown lines: what the cost model predicted for each speculative row that records a prediction (auto's
    choice, or a given shape) against the decode window's measurement (tokens per pass, a round's cost in plain
    steps, speedup); none where no row holds one."""
    rows = [r for r in rows if "error" not in r and (r.get("speculation") or {}).get("predicted_speedup")]
    if not rows:
        return []
    lines = ["", "The cost model's predictions (predicted / measured over the decode window):", ""]
    lines += md_header(["task", "bucket", "T", "batch", "method", "tokens per pass", "round in plain steps",
                        "speedup"])
    for r in rows:
        tokens, speedup = r["speculation"]["expected_tokens"], r["speculation"]["predicted_speedup"]
        lines.append(md_row([r["task"], r["bucket"], r["temperature"], r["batch"], method_cell(r),
                             _against(tokens, r.get("window_tau", math.nan)),
                             _against(tokens / speedup, r.get("pass_steps", math.nan)),
                             _against(speedup, r.get("speedup", math.nan), "x")]))
    return lines


def _against(predicted: float, measured: float, unit: str = "") -> str:
    """``predicted / measured``; the prediction alone where the row has no such measure (an older report)."""
    cell = f"{predicted:.2f}{unit}"
    return cell if math.isnan(measured) else f"{cell} / {measured:.2f}{unit}"


def best_tree_shapes(rows: list[dict]) -> list[dict]:
    """Per (task, bucket, temperature, batch): the fastest tree shape of the sweep (the rows of the first draft's
    trees, ``tree[draft]shape``), its speedup and how many shapes were tried there. A speedup that could not be
    measured (NaN: a call too short to time) ranks last."""
    trees = [r for r in rows if r["method"].startswith("tree[")]
    if not trees:
        return []
    swept = trees[0]["method"].split("]")[0] + "]"  # "tree[<first draft>]"
    best: dict[tuple, dict] = {}
    for r in trees:
        if not r["method"].startswith(swept):
            continue
        key = (r["task"], r["bucket"], r["temperature"], r["batch"])
        entry = best.setdefault(key, dict(zip(("task", "bucket", "temperature", "batch"), key),
                                          draft=swept[len("tree["):-1], shape=None, speedup=math.nan, tried=0))
        entry["tried"] += 1
        if entry["shape"] is None or _rank(r["speedup"]) > _rank(entry["speedup"]):
            entry.update(shape=r["method"][len(swept):], speedup=r["speedup"])
    return list(best.values())


def _rank(speedup: float) -> float:
    return speedup if math.isfinite(speedup) else -math.inf


def plot(rows: list[dict], out_dir: str, bucket_order: list[str]) -> list[str]:
    """``tasks_speed.png`` (tokens/s and tau against bucket per method, one panel pair per temperature, batch 1
    or the smallest batch), ``tasks_speedup.png`` (speedup against bucket per method and batch size, one panel per
    temperature), ``tasks_accept_hist.png`` (share of rounds by tokens emitted, per method, one panel
    per temperature) and, where the rows hold several batch sizes, ``tasks_batch.png`` (speedup against batch
    size per method, one panel per temperature); failed rows left out, and no plots where every row failed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    if not rows:
        return []
    temps = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    figures = {"tasks_speed.png": _speed_figure(plt, rows, temps, methods, bucket_order),
               "tasks_speedup.png": _speedup_figure(plt, rows, temps, methods, bucket_order),
               "tasks_accept_hist.png": _accept_figure(plt, rows, temps, methods)}
    if len({r["batch"] for r in rows}) > 1:
        figures["tasks_batch.png"] = _batch_figure(plt, rows, temps, methods)
    paths = []
    for name, fig in figures.items():
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _speed_figure(plt, rows, temps, methods, bucket_order):
    batch = min(r["batch"] for r in rows)
    fig, axes = plt.subplots(2, len(temps), figsize=(6 * len(temps), 8), squeeze=False)
    for col, t in enumerate(temps):
        for method in methods:
            picked = [r for r in rows if r["temperature"] == t and r["batch"] == batch and r["method"] == method]
            xs = [b for b in bucket_order if any(r["bucket"] == b for r in picked)]
            for ax, key in ((axes[0, col], "tokens_per_s"), (axes[1, col], "tau")):
                ys = [np.mean([r[key] for r in picked if r["bucket"] == b]) for b in xs]
                ax.plot([bucket_order.index(b) for b in xs], ys, marker="o", label=method)
        for ax in axes[:, col]:
            _bucket_ticks(ax, bucket_order)
        axes[0, col].set_title(f"T={t}, batch {batch}: decode tokens/s")
        axes[1, col].set_title(f"T={t}, batch {batch}: tau")
        axes[1, col].set_xlabel("prompt length")
    axes[0, 0].legend(fontsize=7)
    return fig


def _speedup_figure(plt, rows, temps, methods, bucket_order):
    """Speedup against plain at each bucket, one line per (method, batch size) that is not plain."""
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for method in methods[1:]:
            for batch in sorted({r["batch"] for r in rows}):
                picked = [r for r in rows if r["temperature"] == t and r["batch"] == batch and r["method"] == method]
                xs = [b for b in bucket_order if any(r["bucket"] == b for r in picked)]
                if xs:
                    ax.plot([bucket_order.index(b) for b in xs],
                            [np.mean([r["speedup"] for r in picked if r["bucket"] == b]) for b in xs],
                            marker="o", label=f"{method}, batch {batch}")
        _bucket_ticks(ax, bucket_order)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_title(f"T={t}: decode speedup against plain")
        ax.set_xlabel("prompt length")
        ax.legend(fontsize=7)
    return fig


def _bucket_ticks(ax, bucket_order):
    """Every bucket at its place from the shortest prompts up, whichever lines were drawn first."""
    ax.set_xticks(range(len(bucket_order)), bucket_order)


def _accept_figure(plt, rows, temps, methods):
    fig, axes = plt.subplots(1, len(temps), figsize=(7 * len(temps), 4), squeeze=False)
    hist_methods = [m for m in methods if any(r.get("accept_counts") for r in rows if r["method"] == m)]
    width = 0.8 / max(len(hist_methods), 1)
    for ax, t in zip(axes[0], temps):
        for i, method in enumerate(hist_methods):
            picked = [r["accept_counts"] for r in rows
                      if r["method"] == method and r["temperature"] == t and r.get("accept_counts")]
            if picked:
                counts = np.sum(picked, axis=0)
                ax.bar(np.arange(1, len(counts) + 1) + i * width, counts / counts.sum(), width, label=method)
        ax.set_title(f"T={t}: tokens emitted per round (all buckets and batches)")
        ax.set_xlabel("tokens emitted per round")
        ax.set_ylabel("share of rounds")
        if hist_methods:
            ax.legend(fontsize=7)
    return fig


def _batch_figure(plt, rows, temps, methods):
    """Speedup against plain at each batch size (mean over the buckets that ran it), per method."""
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for method in methods:
            picked = [r for r in rows if r["temperature"] == t and r["method"] == method]
            xs = sorted({r["batch"] for r in picked})
            ax.plot(xs, [np.mean([r["speedup"] for r in picked if r["batch"] == b]) for b in xs], marker="o",
                    label=method)
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in rows})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_title(f"T={t}: speedup against plain decoding at the same batch")
        ax.set_xlabel("batch size (sequences decoded together)")
        ax.legend(fontsize=7)
    return fig


def bucket_order(names) -> list[str]:
    """Bucket names (``"60-64k"``, ``"16-32"``) from the shortest prompts up."""
    return sorted(set(names), key=lambda n: float(n.split("-")[0]) * (1024 if n.endswith("k") else 1))


def merge(reports: list[dict]) -> dict:
    """One report of the rows of several, in order, with each run's date and device."""
    rows = [row for report in reports for row in report["rows"]]
    return dict(runs=[{k: r.get(k) for k in ("date", "device", "jax", "new_tokens", "samples")} for r in reports],
                rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.bench.task_report", description="One table and one set of "
                                "plots over the rows of several bench_tasks.json reports.")
    p.add_argument("--out", required=True, help="directory for bench_tasks.json / .md and the plots")
    p.add_argument("reports", nargs="+", help="bench_tasks.json files")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    merged = merge(reports)
    os.makedirs(args.out, exist_ok=True)
    merged["plots"] = plot(merged["rows"], args.out, bucket_order(r["bucket"] for r in merged["rows"]))
    write_report(args.out, "bench_tasks", merged, markdown(merged["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
