"""The markdown tables of the attention benchmark (``bench_attention.md``)."""

from __future__ import annotations

from tools.attention_loop import l2_cell
from tools.attention_mosaic import mosaic_markdown
from infer.bench.harness import md_header, md_row
from tools.mosaic_phases import phases_markdown

TABLE_COLUMNS = ("gpu", "mosaic", "pallas", "cudnn", "xla", "naive", "cache", "kernel", "cache_cudnn", "cache_mosaic",
                 "mgpu", "tree", "decode", "decode_cudnn", "dpa")
RATIOS = ("naive_over_gpu", "gpu_over_decode", "naive_over_pallas", "pallas_over_decode")
FRACS = ("cache_frac_copy_bw", "cache_cudnn_frac_copy_bw", "decode_frac_copy_bw", "decode_cudnn_frac_copy_bw")
TABLE_NOTE = (
    "gpu / mosaic / pallas / cudnn / xla / naive: `hybrid_tree_attention(impl=...)` (gpu is what auto picks on a "
    "GPU); cache_mosaic: the Mosaic GPU cache half (`mosaic_cache_attention`, folded, split, merged); "
    "cache: Pallas cache half (`cache_attention`, 74 queries); kernel: its pallas_call alone; cache_cudnn: "
    "`cudnn_cache_attention` (cuDNN, split along the keys); mgpu: jax's Mosaic GPU flash kernel on the same split "
    "problem, full chunks, no merge; tree: `tree_attention`; decode / decode_cudnn: the Pallas / cuDNN cache half "
    "with 1 query; x / decode: against the faster decode; dpa: `jax.nn.dot_product_attention` over the cache (74 "
    "queries, cuDNN where it accepts the shape). % copy BW: K+V bytes of the valid cache / time vs the copy "
    "bandwidth above. K/V fits L2: whether the cache bytes touched per cycle of the loop fit in the 60 MB L2 (R x "
    "set size: R distinct K/V sets are rotated so that a cycle is >= 3x L2, i.e. every call reads its cache from "
    "HBM: 'no'); the tree half reads only the new keys/values, q and the mask (< 3 MB), which stay in L2, as they "
    "would in a real verify step.")


def _num(d: dict, k: str) -> str:
    return f"{d[k]:.2f}" if k in d else "-"


def _table(rows: list, dtype: str) -> list[str]:
    impl_names = [n for n in TABLE_COLUMNS if any(n in r.get("us", {}) for r in rows)]
    first = next((r for r in rows if "M" in r), {})
    lines = [f"## Hybrid tree attention, {first.get('M', '?')} new tokens, {dtype}, head_dim {first.get('D', '?')} "
             "(us per call, in-jit loop, loop overhead subtracted)", ""]
    lines += md_header(["model", "B", "S", *impl_names, *(r.replace("_over_", " / ") for r in RATIOS),
                        *(f.replace("_frac_copy_bw", " % copy BW") for f in FRACS), "K/V fits L2"])
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['model']} | {r['B']} | {r['S']} | skipped (budget) |")
            continue
        us = r.get("us", {})
        cells = [f"{us[n]:.1f}" if n in us else "-" for n in impl_names]
        cells += [f"{r[k]:.2f}" if k in r else "-" for k in RATIOS]
        cells += [f"{100 * r[k]:.0f}%" if k in r else "-" for k in FRACS]
        lines.append(md_row([r["model"], r["B"], r["S"], *cells, l2_cell(r.get("l2"))]))
    lines += ["", TABLE_NOTE, "",
              "Loop overhead per step (us; the empty loop: perturbation + one-row cache writes, subtracted above), "
              "and raw per-step times:", ""]
    lines += md_header(["model", "B", "S", "overhead hybrid", "overhead cache/kernel/dpa", "overhead tree",
                        "overhead decode", "raw pallas", "raw cache", "raw tree", "raw decode",
                        "loop n (pallas/tree/decode)"])
    for r in rows:
        if r.get("skipped"):
            continue
        o, raw, lp = r.get("overhead_us", {}), r.get("raw_us", {}), r.get("loop", {})
        ns = "/".join(str(lp[k]["n"] * lp[k]["steps_per_iter"]) if k in lp else "-"
                      for k in ("pallas", "tree", "decode"))
        lines.append(md_row([r["model"], r["B"], r["S"], _num(o, "pallas"), _num(o, "cache"), _num(o, "tree"),
                             _num(o, "decode"), _num(raw, "pallas"), _num(raw, "cache"), _num(raw, "tree"),
                             _num(raw, "decode"), ns]))
    return lines + [""]


def _sweeps(report: dict) -> list[str]:
    lines = []
    if report.get("sweep"):
        note = next((r["l2"] for r in report["sweep"] if r.get("l2")), None)
        lines += ["## cache_attention sweep", "", f"K/V fits L2: {l2_cell(note)}. us: in-jit loop, loop overhead "
                  "subtracted.", ""]
        lines += md_header(["M", "block_r", "block_k", "splits", "warps", "stages", "combine", "us", "% copy BW"])
        for r in report["sweep"]:
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80].replace("|", "/")
            frac = f"{100 * r['frac_copy_bw']:.0f}%" if r.get("frac_copy_bw") else "-"
            lines.append(md_row([f"{r['M']}{' (default)' if r.get('default') else ''}", r["block_r"], r["block_k"],
                                 f"{r['splits_used']}{'' if r['num_splits'] else ' (auto)'}", r["num_warps"],
                                 r["num_stages"], r.get("combine", ""), us, frac]))
        for M, best in report.get("sweep_best", {}).items():
            lines.append(f"\nBest for M={M}: {best}")
        lines.append("")
    if report.get("sweep_cudnn"):
        lines += ["## cuDNN cache half (cudnn_cache_attention) num_splits sweep", ""]
        lines += md_header(["model", "M", "splits", "us", "% copy BW"])
        for r in report["sweep_cudnn"]:
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80].replace("|", "/")
            frac = f"{100 * r['frac_copy_bw']:.0f}%" if r.get("frac_copy_bw") else "-"
            lines.append(md_row([r["model"], r["M"], f"{r['num_splits']}{' (default)' if r['default'] else ''}", us,
                                 frac]))
        lines.append("")
    return lines


def markdown(report: dict) -> str:
    lines = [f"# Attention benchmark ({report['date']}, {report['device']}, jax {report['jax']})", ""]
    if report.get("timing"):
        lines += [f"Timing: {report['timing']['method']}", ""]
    if report.get("copy"):
        c = report["copy"]
        lines += [f"Copy bandwidth (ceiling): {c['bytes_per_s'] / 1e12:.3f} TB/s (`x + 1` over "
                  f"{c['buffer_bytes'] / 2**30:.3g} GiB uint32, read + write, {c['iters']} iterations inside one "
                  f"jitted fori_loop, median of {c['calls']} calls); by 10 chained dispatches: "
                  f"{c['dispatch']['bytes_per_s'] / 1e12:.3f} TB/s.", ""]
    if report.get("table"):
        lines += _table(report["table"], report.get("dtype", "bfloat16"))
    if report.get("sweep_mosaic"):
        lines += mosaic_markdown(report["sweep_mosaic"])
    if report.get("mosaic_phases"):
        lines += phases_markdown(report["mosaic_phases"])
    return "\n".join(lines + _sweeps(report))
