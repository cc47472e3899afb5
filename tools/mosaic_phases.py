"""The attention benchmark's ``phases`` section: where the compute warpgroups of the Mosaic GPU cache half spend
their time, from Mosaic GPU's on-device profiler (``mosaic_cache_partials(profile_dir=...)``: SM clock stamps at
the kernel's named scopes ``load_q``, ``scores`` (Q K^T), ``softmax``, ``pv`` (P V, with the waits for the V tile
and the next K tile), ``write_out``).

Per shape of ``--mosaic-shapes`` (``--new-tokens`` queries, the whole cache valid), its default config and the
``--mosaic-variants`` changes of it (``none``: the default alone): one profiled call each after a warm-up; over
the compute warpgroups that ran (not the all-padding ones), the mean clock cycles from a warpgroup's first stamp
to its last and inside each scope; the rest ("other") is loop control and slot releases. Each stamp costs a few
cycles, so a profiled call is a little slower than a plain one.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from tools.attention_mosaic import parse_shapes, variants
from tools.attention_ops import MODELS, make_inputs
from infer.bench.harness import error_text, log, md_header, md_row

PHASES = ("load_q", "scores", "softmax", "pv", "write_out")


def phase_table(events: list, compute_wgs: int) -> dict:
    """Chrome-trace events of one profiled call (Mosaic GPU's profiler: ``tid - 1`` = block x (C + 1) + warpgroup,
    the memory warpgroup last; ``ph`` "B" / "E"; ``ts`` in thousands of clock cycles within one warpgroup's trace)
    -> ``{"traces", "span_kcycles", "kcycles": {scope: mean}, "other_kcycles"}`` over the warpgroups that stamped a
    ``softmax`` (those that computed); only outermost scopes count."""
    by_trace = {}
    for event in events:
        by_trace.setdefault(event["tid"], []).append(event)
    spans, totals = [], {name: 0.0 for name in PHASES}
    for tid, trace in by_trace.items():
        if (tid - 1) % (compute_wgs + 1) == compute_wgs or not any(e["name"] == "softmax" for e in trace):
            continue
        open_scopes = []
        for event in sorted(trace, key=lambda e: e["ts"]):
            if event["ph"] == "B":
                open_scopes.append(event)
            elif open_scopes:
                begin = open_scopes.pop()
                if not open_scopes and begin["name"] in totals:
                    totals[begin["name"]] += event["ts"] - begin["ts"]
        spans.append(max(e["ts"] for e in trace) - min(e["ts"] for e in trace))
    n = len(spans)
    if not n:
        raise ValueError("mosaic phases: the trace has no compute warpgroup that stamped a softmax")
    kcycles = {name: total / n for name, total in totals.items()}
    span = sum(spans) / n
    return dict(traces=n, span_kcycles=span, kcycles=kcycles, other_kcycles=span - sum(kcycles.values()))


def _host_callbacks_available() -> None:
    try:
        jax.devices("cpu")
    except RuntimeError as exc:
        raise RuntimeError("mosaic phases: the on-device profiler writes its trace through a host callback, which "
                           "needs the CPU platform too: run with JAX_PLATFORMS=cuda,cpu (or unset)") from exc


def profile_config(inputs: dict, cfg, kv_heads: int, rows: int) -> dict:
    """One profiled call (after a warm-up) of the kernel with ``cfg`` on ``inputs`` (:func:`make_inputs`) ->
    :func:`phase_table`."""
    from pallas.folding import fold_group
    from pallas.mosaic_cache_attention import mosaic_cache_partials

    q_rows = fold_group(inputs["q"], kv_heads, row_multiple=cfg.rows_per_block())
    with tempfile.TemporaryDirectory() as trace_dir:
        for _ in range(2):  # the first call compiles; each call writes a trace
            jax.block_until_ready(mosaic_cache_partials(q_rows, inputs["k_cache"], inputs["v_cache"],
                                                        inputs["lengths"], cfg=cfg, scale=q_rows.shape[-1] ** -0.5,
                                                        valid_rows=rows, profile_dir=trace_dir))
        jax.effects_barrier()
        traces = glob.glob(os.path.join(trace_dir, "*-trace.json"))
        if not traces:
            raise RuntimeError(f"mosaic phases: the profiler wrote no trace into {trace_dir}")
        with open(max(traces, key=os.path.getmtime)) as f:
            events = json.load(f)["traceEvents"]
    return phase_table(events, cfg.compute_wgs)


def run_phases(args) -> list:
    """Per ``--mosaic-shapes`` shape, the default config and the ``--mosaic-variants`` changes of it (as the
    mosaic section times them; ``none``: the default alone), each profiled once."""
    from pallas.mosaic_cache_attention import default_mosaic_config

    _host_callbacks_available()
    results = []
    for model, D, S, B in parse_shapes(args.mosaic_shapes):
        H, K = MODELS[model]
        rows = args.new_tokens * (H // K)
        inputs = make_inputs(600, B, args.new_tokens, S, H, K, D, jnp.bfloat16)
        base = default_mosaic_config(B, K, rows, S, D)
        for cfg in variants(base, S, args.mosaic_variants, default_mosaic_config(B, K, rows, S, D, one_wave=False)):
            rec = dict(model=model, D=D, S=S, B=B, M=args.new_tokens, rows=rows, config=dataclasses.asdict(cfg),
                       default=cfg == base)
            label = f"{model} D={D} S={S} B={B} {cfg}"
            try:
                rec.update(profile_config(inputs, cfg, K, rows))
                shares = ", ".join(f"{n} {100 * t / rec['span_kcycles']:.0f}%" for n, t in rec["kcycles"].items())
                log(f"  {label}: {rec['traces']} compute warpgroups, {rec['span_kcycles']:.1f} kcycles each: "
                    f"{shares}")
            except Exception as exc:
                rec["error"] = error_text(exc)
                log(f"  {label}: FAILED {rec['error']}")
            results.append(rec)
        del inputs
    return results


def _config_text(c: dict, default: bool) -> str:
    parts = [f"{c['num_splits']} splits", f"{c['compute_wgs']} wgs", f"{c['block_kv']}-key blocks",
             f"{c['stages']} stages"] + ([] if c["pingpong"] else ["free"]) + (
        [] if c["accumulate"] == "state" else [c["accumulate"]])
    return ", ".join(parts) + (" (default)" if default else "")


def phases_markdown(rows: list) -> list[str]:
    lines = ["## Mosaic GPU cache half: a compute warpgroup's time by phase (on-device profiler, thousands of "
             "clock cycles, mean over the warpgroups that computed; % of the span)", ""]
    lines += md_header(["model", "D", "S", "B", "rows", "config", "warpgroups", "span", *PHASES, "other"])
    for r in rows:
        head = [r["model"], r["D"], r["S"], r["B"], r["rows"], _config_text(r["config"], r["default"])]
        if "error" in r:
            lines.append(md_row([*head, r["error"][:80].replace("|", "/")]))
            continue
        cells = [f"{t:.1f} ({100 * t / r['span_kcycles']:.0f}%)" for t in (*r["kcycles"].values(),
                                                                          r["other_kcycles"])]
        lines.append(md_row([*head, r["traces"], f"{r['span_kcycles']:.1f}", *cells]))
    return lines + [""]
