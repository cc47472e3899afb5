"""Where a jitted step spends its GPU time: one profiled call of the in-loop timing, read back programmatically.

:func:`profile_loop` runs ``carry = step(carry, *consts)`` ``reps`` times in one jitted ``fori_loop`` (the
harness's in-loop timing) under ``jax.profiler``, reads the trace's GPU kernel events with
:class:`jax.profiler.ProfileData`, and attributes each kernel to the HLO instruction that launched it and, through
that instruction's stack frame in the compiled program, to the function (and its caller) that built it. The result:
per step, the kernels launched, their summed time, the GPU-busy time (overlaps merged) and the wall time, a
table of time by source function and by kernel, and where the GPU sat idle: each gap between kernels charged to
the source of the kernel that ended it (the one the GPU waited to launch).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time

import jax

_METADATA = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}')
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_TABLE_ROW = re.compile(r'^(\d+)\s+(?:"(.*)"|\{(.*)\})\s*$')


def _tables(hlo_text: str) -> dict[str, dict[int, object]]:
    """The module's FileNames / FunctionNames / FileLocations / StackFrames tables (newer XLA prints source
    locations once, there, and refers to them by ``stack_frame_id``)."""
    tables: dict = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = _TABLE_ROW.match(line) if current is not None else None
        if not m:
            current = None
            continue
        current[int(m.group(1))] = m.group(2) if m.group(2) is not None else {
            k: int(v) for k, v in _FIELD.findall(m.group(3)) if v.lstrip("-").isdigit()}
    return tables


def _frame_names(tables: dict) -> dict[int, str]:
    """``{stack frame id: "file.py:function < file.py:caller"}``."""
    files, funcs, locs = (tables.get(k, {}) for k in ("FileNames", "FunctionNames", "FileLocations"))
    frames = tables.get("StackFrames", {})

    def name(frame_id):
        loc = locs.get(frames.get(frame_id, {}).get("file_location_id"), {})
        path = files.get(loc.get("file_name_id"), "?")
        return f"{'/'.join(path.split('/')[-2:])}:{funcs.get(loc.get('function_name_id'), '?')}"

    out = {}
    for frame_id, frame in frames.items():
        parent = frame.get("parent_frame_id", 0) - 1  # printed one above the id (0: no parent)
        out[frame_id] = name(frame_id) + (f" < {name(parent)}" if parent > 0 else "")
    return out


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """``{instruction name: "file.py:function < file.py:caller"}`` from the metadata of a compiled program's HLO
    text (fusions carry their root op's metadata); instructions without a source keep their op name."""
    frames = _frame_names(_tables(hlo_text))
    out = {}
    for line in hlo_text.splitlines():
        m = _METADATA.match(line)
        if not m:
            continue
        fields = {k: v.strip('"') for k, v in _FIELD.findall(m.group(2))}
        if fields.get("stack_frame_id", "").isdigit() and int(fields["stack_frame_id"]) in frames:
            out[m.group(1)] = frames[int(fields["stack_frame_id"])]
        elif "op_name" in fields:
            out[m.group(1)] = fields["op_name"].rsplit("/", 1)[-1]
    return out


def kernel_events(xplane_path: str) -> list[dict]:
    """Device work of a trace: the kernel and memcpy events of the GPU planes' stream lines, or without a GPU
    the host's XLA op events (those with an ``hlo_op``). Each: name, hlo_op, start and duration (ns)."""
    from jax.profiler import ProfileData

    planes = list(ProfileData.from_file(xplane_path).planes)
    on_gpu = any(p.name.startswith("/device:GPU") for p in planes)
    events = []
    for plane in planes:
        if not plane.name.startswith("/device:GPU" if on_gpu else "/host:CPU"):
            continue
        for line in plane.lines:
            if on_gpu and not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                if on_gpu or "hlo_op" in stats:
                    events.append(dict(name=ev.name, hlo_op=str(stats.get("hlo_op", "")), start=float(ev.start_ns),
                                       dur=float(ev.duration_ns)))
    return events


def idle_gaps(events: list[dict]) -> list[tuple[dict, float]]:
    """``(event, ns)`` for every gap in which no event runs, each charged to the event that ends it (none before
    the first event)."""
    gaps, end = [], None
    for ev in sorted(events, key=lambda e: e["start"]):
        if end is not None and ev["start"] > end:
            gaps.append((ev, ev["start"] - end))
        ev_end = ev["start"] + ev["dur"]
        end = ev_end if end is None else max(end, ev_end)
    return gaps


def busy_ns(events: list[dict]) -> float:
    """Time during which at least one event runs (overlapping events counted once): the span less the gaps."""
    if not events:
        return 0.0
    span = max(e["start"] + e["dur"] for e in events) - min(e["start"] for e in events)
    return span - sum(ns for _, ns in idle_gaps(events))


def summarize(events: list[dict], sources: dict[str, str], reps: int, wall_s: float, top: int = 25) -> dict:
    """Per-step numbers and the time tables (microseconds per step); ``longest_gap_us``: the longest idle gap of
    the call, not per step (one far longer than a step is a once-a-call gap, which the per-step idle spreads over
    the steps)."""
    by_source: dict = collections.defaultdict(lambda: [0.0, 0])
    by_kernel: dict = collections.defaultdict(lambda: [0.0, 0])
    idle_source: dict = collections.defaultdict(lambda: [0.0, 0])
    idle_kernel: dict = collections.defaultdict(lambda: [0.0, 0])

    def add(ev, ns, source_table, kernel_table):
        for table, key in ((source_table, sources.get(ev["hlo_op"], ev["hlo_op"] or "(no hlo op)")),
                           (kernel_table, ev["name"][:100])):
            table[key][0] += ns
            table[key][1] += 1

    for ev in events:
        add(ev, ev["dur"], by_source, by_kernel)
    gaps = idle_gaps(events)
    for ev, ns in gaps:  # inside a command buffer every kernel's hlo_op is the buffer's: the name tells
        add(ev, ns, idle_source, idle_kernel)

    def rows(table):
        ordered = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        return [dict(what=k, us=v[0] / reps / 1e3, launches=v[1] / reps) for k, v in ordered]

    return dict(reps=reps, wall_us=wall_s / reps * 1e6, kernel_sum_us=sum(e["dur"] for e in events) / reps / 1e3,
                busy_us=busy_ns(events) / reps / 1e3, launches=len(events) / reps,
                idle_us=sum(ns for _, ns in gaps) / reps / 1e3,
                longest_gap_us=max((ns for _, ns in gaps), default=0.0) / 1e3, by_source=rows(by_source),
                by_kernel=rows(by_kernel), idle_before=rows(idle_source), idle_before_kernel=rows(idle_kernel))


def profile_loop(step, carry, consts: tuple, reps: int, compiler_options: dict | None = None,
                 hlo_path: str | None = None):
    """Compiles the in-loop timing of ``step``, runs it once untraced (warm-up) and once traced; returns the
    :func:`summarize` dict (wall = the traced call) with ``temp_mib`` added, and the final carry. ``hlo_path``:
    where to write the compiled module's text too (its fusions' bodies name what each kernel of the summary
    computes)."""
    runner = jax.jit(lambda c, *k: jax.lax.fori_loop(0, reps, lambda i, x: step(x, *k), c), donate_argnums=0)
    compiled = runner.lower(carry, *consts).compile(compiler_options or {})
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    carry = compiled(carry, *consts)
    jax.block_until_ready(carry)
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        t0 = time.perf_counter()
        carry = compiled(carry, *consts)
        jax.block_until_ready(carry)
        wall_s = time.perf_counter() - t0
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        events = kernel_events(paths[-1]) if paths else []
    summary = summarize(events, hlo_sources(compiled.as_text()), reps, wall_s)
    return dict(summary, temp_mib=temp_mib(compiled)), carry


def temp_mib(compiled) -> float | None:
    """The compiled program's temporary buffers in MiB (XLA's memory analysis; None where a backend has none)."""
    stats = compiled.memory_analysis()
    size = getattr(stats, "temp_size_in_bytes", None)
    return None if size is None else size / 2**20
