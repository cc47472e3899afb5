"""What every benchmark shares: logging, in-loop timing, the copy-bandwidth ceiling, JSON + markdown output.

In-loop timing (:func:`time_loop`): ``carry = step(carry, *consts)`` repeated ``reps`` times inside one jitted
``lax.fori_loop``, the carry donated (a KV cache in it is updated in place), so no per-call dispatch or copy is
counted. The loop is compiled once per (step, reps, shapes); a warm-up call runs first, then ``calls`` timed
calls (median). Whole calls (a generation loop from its post-prefill state): :func:`time_runs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

RESIZE_BELOW, RESIZE_ABOVE = 0.6, 10.0  # warm-up call shorter / longer than this x target_s: choose reps again


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def error_text(exc: BaseException, limit: int = 2000) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


def record_failure(rec: dict, label: str, exc: BaseException) -> None:
    """A measurement that raised: its error into ``rec["error"]``, a log line naming ``label`` and the traceback;
    the benchmark goes on with the next one."""
    rec["error"] = error_text(exc, 1000)
    log(f"  {label}: FAILED {rec['error'][:400]}")
    traceback.print_exc()


# ------------------------------------------------------------------------------------------------ timing

@functools.cache
def loop_runner(step: Callable, reps: int):
    """jit(carry, *consts) -> carry after ``reps`` steps inside one ``fori_loop``; the carry is donated."""
    return jax.jit(lambda carry, *consts: jax.lax.fori_loop(0, reps, lambda i, c: step(c, *consts), carry),
                   donate_argnums=0)


def loop_count(target_s: float, per_step_s: float, limit: int = 1_000_000) -> int:
    """Steps for one call of about ``target_s`` seconds (at least 1, at most ``limit``)."""
    return int(min(limit, max(1, math.ceil(target_s / max(per_step_s, 1e-8)))))


@dataclasses.dataclass
class LoopTime:
    per_step_s: float         # median call / reps
    call_s: float             # median of the timed calls
    call_times_s: list[float]
    reps: int
    compile_s: float          # every compile of this measurement (a re-chosen reps compiles again)
    first_call_s: float       # the warm-up call after the (last) compile
    compiled: Any = dataclasses.field(repr=False)  # the executable, e.g. to inspect its HLO


def _timed_call(compiled, carry, consts):
    t0 = time.perf_counter()
    carry = compiled(carry, *consts)
    jax.block_until_ready(carry)
    return time.perf_counter() - t0, carry


def time_loop(step: Callable, carry, consts: tuple = (), reps: int = 1, calls: int = 1, *,
              reset: Callable | None = None, target_s: float | None = None,
              options: dict | None = None) -> tuple[LoopTime, Any]:
    """Times ``carry = step(carry, *consts)`` repeated ``reps`` times in one jitted ``fori_loop``; returns the
    timing and the final carry (keep it: the one passed in is donated).

    ``reset(carry) -> carry`` runs untimed before each timed call (e.g. to rewind cache lengths). With
    ``target_s``, ``reps`` is a first guess: if the warm-up call lasts under 0.6x or over 10x ``target_s``,
    reps is chosen again from the measured time and the loop compiled once more. ``options``: XLA compiler
    options of the compile."""
    compile_s = 0.0
    while True:
        t0 = time.perf_counter()
        compiled = loop_runner(step, reps).lower(carry, *consts).compile(options or {})
        compile_s += time.perf_counter() - t0
        first_s, carry = _timed_call(compiled, carry, consts)
        if target_s is None or not (first_s < RESIZE_BELOW * target_s or (first_s > RESIZE_ABOVE * target_s
                                                                          and reps > 1)):
            break
        new_reps = loop_count(target_s, first_s / reps)
        if new_reps == reps:
            break
        reps, target_s = new_reps, None  # one re-choice at most
    times = []
    for _ in range(calls):
        if reset is not None:
            carry = reset(carry)
        seconds, carry = _timed_call(compiled, carry, consts)
        times.append(seconds)
    call_s = statistics.median(times)
    return LoopTime(per_step_s=call_s / reps, call_s=call_s, call_times_s=times, reps=reps, compile_s=compile_s,
                    first_call_s=first_s, compiled=compiled), carry


def time_runs(start: Callable, run: Callable, reps: int, warmup: bool = True) -> tuple[float, Any]:
    """Median seconds of ``run(start())`` over ``reps`` runs (``start`` untimed), after one warm-up run (unless
    ``warmup=False``: ``run`` is compiled and warm already); and the last run's result. For whole jitted calls,
    such as a generation loop from its post-prefill state."""
    times = []
    for i in range(reps + int(warmup)):
        state = start()
        jax.block_until_ready(state)
        seconds, state = _timed_call(run, state, ())
        if i or not warmup:
            times.append(seconds)
    return statistics.median(times), state


def median_call(call: Callable, reps: int) -> tuple[float, Any]:
    """Median wall seconds of ``reps`` calls of ``call`` (which returns host data, so it has finished), and the
    last call's result."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_backend_compiles = [0]


@functools.cache
def _count_backend_compiles() -> None:
    def listener(event: str, _seconds: float, **_kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            _backend_compiles[0] += 1
    jax.monitoring.register_event_duration_secs_listener(listener)


def backend_compiles() -> int:
    """Programs XLA has compiled in this process since the first call of this function (a call whose count
    changed compiled something, and its time holds the compile)."""
    _count_backend_compiles()
    return _backend_compiles[0]


def net_of_overhead(per_step_s: float, empty_per_step_s: float) -> dict:
    """An op's time = loop time per step - the empty loop's (same loop, identity op), in microseconds."""
    return dict(us=(per_step_s - empty_per_step_s) * 1e6, raw_us=per_step_s * 1e6, overhead_us=empty_per_step_s * 1e6)


def nbytes(tree) -> int:
    """Bytes of a pytree's arrays (or of their ``jax.ShapeDtypeStruct``s)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------------------------------- copy ceiling

def copy_bandwidth(smoke: bool, target_s: float = 0.025, calls: int = 5) -> dict:
    """HBM ceiling: ``x + 1`` over a 1 GiB uint32 buffer (bytes = read + write), in the in-loop timing above.
    ``dispatch`` cross-checks it with 10 chained dispatches of one jitted ``x + 1`` (median of 5 groups)."""
    n = 2**12 if smoke else 2**28
    nbytes = 4 * n
    moved = 2 * nbytes
    reps = 2 if smoke else max(2, math.ceil(target_s / (moved / 3.5e12)))
    calls = 2 if smoke else max(1, calls)
    t, x = time_loop(lambda a: a + jnp.uint32(1), jnp.zeros((n,), jnp.uint32), (), reps, calls)
    bump = jax.jit(lambda a: a + jnp.uint32(1))
    y = bump(x)
    y.block_until_ready()
    groups = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            y = bump(y)
        y.block_until_ready()
        groups.append((time.perf_counter() - t0) / 10)
    del x, y
    t_dispatch = statistics.median(groups)
    res = dict(buffer_bytes=nbytes, bytes=moved, seconds=t.per_step_s, iters=reps, calls=calls, call_s=t.call_s,
               bytes_per_s=moved / t.per_step_s,
               dispatch=dict(seconds=t_dispatch, bytes_per_s=moved / t_dispatch,
                             method="10 chained dispatches, median of 5"))
    log(f"copy: x + 1 over {nbytes / 2**30:.3f} GiB: in-jit loop {t.per_step_s * 1e6:.1f} us -> "
        f"{res['bytes_per_s'] / 1e12:.3f} TB/s; chained dispatches {t_dispatch * 1e6:.1f} us -> "
        f"{moved / t_dispatch / 1e12:.3f} TB/s (read + write)")
    return res


# ------------------------------------------------------------------------------------------------ output

def names_arg(choices, what: str, *, none: bool = False) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type``: a comma list of names from ``choices`` (``what`` names one in the error); with
    ``none``, the word ``none`` stands for no names."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n for n in text.split(",") if n and not (none and n == "none"))
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown)}; choose from "
                                             f"{', '.join(choices)}" + (" or none" if none else ""))
        return names
    return parse


def json_object_arg(text: str) -> dict:
    """An argparse ``type``: a JSON object, e.g. of XLA options."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def arg_parser(name: str, doc: str, smoke_help: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``python -m infer.bench NAME`` (or of ``prog``), with ``--out`` (for
    ``bench_NAME.json`` / ``.md``) and ``--smoke``."""
    p = argparse.ArgumentParser(prog=prog or f"python -m infer.bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help=f"output directory for bench_{name}.json / .md")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    return p


def add_sized_args(p: argparse.ArgumentParser, specs, defaults: dict, smoke: dict) -> None:
    """Options ``--NAME`` from ``specs`` (``(name, type, help)``) whose default depends on ``--smoke``: the value
    in ``smoke`` or ``defaults`` (keyed by the option's attribute name); :func:`parse_sized` fills them in."""
    def shown(value) -> str:
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

    for name, kind, text in specs:
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=kind,
                       help=f"{text} (default {shown(defaults[key])}; --smoke: {shown(smoke[key])})")


def parse_sized(p: argparse.ArgumentParser, argv, defaults: dict, smoke: dict) -> argparse.Namespace:
    """``p.parse_args(argv)`` with every option of :func:`add_sized_args` not given set from ``smoke`` (with
    ``--smoke``) or ``defaults``."""
    args = p.parse_args(argv)
    for key, value in (smoke if args.smoke else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def run_header(**fields) -> dict:
    """What every report starts with: the date, the device kind and the jax version, then ``fields``."""
    return {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__, **fields}


def finish(out_dir, name: str, results: dict, markdown: str) -> int:
    """Writes ``bench_NAME.json`` / ``.md`` under ``out_dir``, prints the markdown; a benchmark's exit status."""
    write_report(out_dir, f"bench_{name}", results, markdown)
    print(markdown)
    return 0


def md_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_header(names) -> list[str]:
    """A markdown table's header row and its separator."""
    names = list(names)
    return [md_row(names), "|" + "---|" * len(names)]


def write_report(out_dir, name: str, report: dict, markdown: str) -> tuple[Path, Path]:
    """``out_dir/name.json`` (every number) and ``out_dir/name.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{name}.json", out / f"{name}.md"
    paths[0].write_text(json.dumps(report, indent=1, default=str))
    paths[1].write_text(markdown)
    return paths
