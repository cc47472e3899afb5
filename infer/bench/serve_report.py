"""The report of ``python -m infer.bench serve``: the ratios between the servers and the in-process baseline, the
markdown tables and the plots."""

from __future__ import annotations

import os

from infer.bench.harness import md_header, md_row
from infer.bench.serve_load import STATS

SERVERS = ("draft", "plain")  # with the draft, and with --no-draft


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _level(report: dict, server: str, kind: str, value: float) -> dict | None:
    levels = report.get("servers", {}).get(server, {}).get("levels", [])
    return next((lv for lv in levels if lv["kind"] == kind and lv["value"] == value), None)


def comparisons(report: dict) -> list[dict]:
    """Per level: the draft server's output-token throughput and TTFT p50 over the plain server's; at
    concurrency 1, each server's TPOT p50 over ``generate``'s time per output token one prompt at a time; at each
    rate, each server's mean E2E over that of ``generate`` in static batches under the same arrivals."""
    rows = []
    levels = dict.fromkeys((lv["kind"], lv["value"]) for s in SERVERS
                           for lv in report.get("servers", {}).get(s, {}).get("levels", []))
    baseline = report.get("baseline") or {}
    for kind, value in levels:
        draft, plain = _level(report, "draft", kind, value), _level(report, "plain", kind, value)
        row = dict(kind=kind, value=value)
        if draft and plain:
            row["throughput_draft_over_plain"] = _ratio(draft["output_throughput"], plain["output_throughput"])
            row["ttft_p50_draft_over_plain"] = _ratio(draft["ttft_s"]["p50"], plain["ttft_s"]["p50"])
        for server in SERVERS:
            level, base = _level(report, server, kind, value), baseline.get(server)
            if level is None or base is None:
                continue
            if kind == "concurrency" and value == 1:
                row[f"tpot_p50_over_generate_{server}"] = _ratio(level["tpot_s"]["p50"], base["single"]["tpot_s"])
            static = base.get("static", {}).get(f"{value:g}") if kind == "rate" else None
            if static:
                row[f"e2e_mean_over_static_{server}"] = _ratio(level["e2e_s"]["mean"], static["e2e_mean_s"])
        rows.append(row)
    return rows


def _ms(value) -> str:
    return "" if value is None else f"{1e3 * value:.1f}"


def _num(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    """The levels of both servers (times in ms: mean / p50 / p99), the ratios and the baseline."""
    lines = [f"# serve: {report.get('device', '')}, {report['config']['prompts']} prompts of "
             f"{'-'.join(map(str, report['config']['bucket']))} tokens, max_tokens {report['config']['max_tokens']}, "
             f"T={report['config']['temperature']}", ""]
    lines += md_header(["server", "load", "done", "req/s", "out tok/s", "tau"]
                       + [f"{s.removesuffix('_s').upper()} ms" for s in STATS])
    for server in SERVERS:
        for lv in report.get("servers", {}).get(server, {}).get("levels", []):
            cells = [server, f"{lv['kind']} {lv['value']:g}", f"{lv['completed']}/{lv['requests']}",
                     _num(lv["request_throughput"]), _num(lv["output_throughput"], 1), _num(lv["tau"])]
            cells += [" / ".join(_ms(lv[s][k]) for k in ("mean", "p50", "p99")) for s in STATS]
            lines.append(md_row(cells))
    rows = report.get("comparisons") or []
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("kind", "value")))
    if keys:
        lines += ["", *md_header(["load", *keys])]
        lines += [md_row([f"{r['kind']} {r['value']:g}", *(_num(r.get(k)) for k in keys)]) for r in rows]
    for server, base in (report.get("baseline") or {}).items():
        single = base["single"]
        lines += ["", f"`generate` ({server}), one prompt at a time: {_ms(single['tpot_s'])} ms per output token "
                      f"(median over {single['prompts']} prompts), E2E mean {_ms(single['e2e_mean_s'])} ms"]
        for rate, static in base.get("static", {}).items():
            lines.append(f"- static batches of {static['batch']} at rate {rate}: E2E mean "
                         f"{_ms(static['e2e_mean_s'])} ms")
    return "\n".join(lines) + "\n"


def plot(report: dict, out_dir: str) -> list[str]:
    """``serve_concurrency.png`` and ``serve_rate.png`` (those the run has): output-token throughput and TTFT p50
    against the load, one line per server."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for kind, label in (("concurrency", "concurrent clients"), ("rate", "request rate (requests/s)")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        drawn = False
        for server in SERVERS:
            levels = [lv for lv in report.get("servers", {}).get(server, {}).get("levels", [])
                      if lv["kind"] == kind and lv["completed"]]
            if not levels:
                continue
            drawn = True
            xs = [f"{lv['value']:g}" for lv in levels]  # categories: a rate of inf has its place too
            axes[0].plot(xs, [lv["output_throughput"] for lv in levels], marker="o", label=server)
            axes[1].plot(xs, [1e3 * lv["ttft_s"]["p50"] for lv in levels], marker="o", label=server)
        if drawn:
            axes[0].set_title("output tokens/s")
            axes[1].set_title("TTFT p50 (ms)")
            for ax in axes:
                ax.set_xlabel(label)
                ax.legend()
            fig.tight_layout()
            paths.append(os.path.join(out_dir, f"serve_{kind}.png"))
            fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
