"""The weight GEMMs of a round at their row counts: XLA's ``jnp.dot`` against the skinny Pallas matmul.

    python -m infer.bench gemm --out DIR             # H200: the padded 8B pair's shapes, ~2 minutes
    python -m infer.bench gemm --out DIR --smoke     # tiny shapes, CPU interpret mode, seconds

A verification pass multiplies the tree's ~70 tokens, a draft level its 16 nodes, by every weight matrix: the
time is the weights' bytes if the kernel streams them at the copy rate. XLA splits K for these shapes and writes
float32 partials (section 7d of docs/benchmarks.md); :func:`pallas.skinny_matmul.skinny_matmul` does not. For each
shape: XLA's dot and every ``--configs`` launch shape of the skinny matmul, in the in-loop timing over ``R``
distinct weight matrices (R x bytes >= 3x L2, so they come from HBM), each result fed back into the next step's
input by a scalar so nothing is hoisted; GB/s of weights and the ratio to the copy bandwidth measured in the same run.
The skinny results are checked against XLA's (bf16 rounding apart).
"""

from __future__ import annotations

import datetime
import math

import jax
import jax.numpy as jnp
import numpy as np

from infer.bench.attention_loop import L2_BYTES
from infer.bench.harness import (arg_parser, copy_bandwidth, log, md_header, md_row, record_failure, time_loop,
                                 write_report)
from pallas.skinny_matmul import SkinnyConfig, skinny_matmul, skinny_supported

# (name, rows, in, out): the padded 8B-cost pair (hidden 4608, MLP 14336, 72/18 heads of 64, vocabulary 16384)
PADDED_SHAPES = (
    ("verify q/k/v", 69, 4608, 6912), ("verify o", 69, 4608, 4608), ("verify gate/up", 69, 4608, 28672),
    ("verify down", 69, 14336, 4608), ("verify lm head", 69, 4608, 16384),
    ("level q", 16, 4608, 4608), ("level gate", 16, 4608, 14336), ("level down", 16, 14336, 4608),
    ("level lm head", 16, 4608, 16384), ("plain q/k/v", 1, 4608, 6912),
)
SMOKE_SHAPES = (("smoke a", 5, 256, 128), ("smoke b", 16, 128, 64))
DEFAULT_CONFIGS = "16x128x4x4,32x128x4x4,32x256x4x3,64x128x4x4,64x64x4x5,128x64x8x4,32x64x4x6"


def parse_configs(text: str) -> list[SkinnyConfig]:
    """``--configs``: comma list of ``BLOCKN x BLOCKK x WARPS x STAGES``, e.g. ``32x128x4x4``."""
    configs = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--configs: {item!r} is not BLOCKNxBLOCKKxWARPSxSTAGES (e.g. 32x128x4x4)")
        configs.append(SkinnyConfig(*map(int, parts)))
    return configs


def config_name(cfg: SkinnyConfig) -> str:
    return f"{cfg.block_n}x{cfg.block_k}x{cfg.num_warps}x{cfg.num_stages}"


def _step(matmul):
    """``x -> x + 1e-30 * sum_r y_r[0, 0]`` with ``y_r = matmul(x, w_r)``: every weight is read each step."""
    def step(x_MxK, *ws):
        corner = sum(matmul(x_MxK, w)[0, 0].astype(jnp.float32) for w in ws)
        return x_MxK + (corner * 1e-30).astype(x_MxK.dtype)
    return step


def time_shape(name: str, rows: int, k: int, n: int, configs, copy_bps: float, smoke: bool) -> dict:
    """XLA's dot and each skinny config at one shape: us per matmul, weight GB/s, share of the copy rate."""
    itemsize = 2
    nbytes = k * n * itemsize
    copies = 2 if smoke else max(2, math.ceil(3 * L2_BYTES / nbytes))
    key = jax.random.PRNGKey(rows * 7 + k + n)
    x = (jax.random.normal(key, (rows, k), jnp.float32) * 0.5).astype(jnp.bfloat16)
    ws = tuple((jax.random.normal(jax.random.fold_in(key, r), (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
               for r in range(copies))
    rec = dict(name=name, rows=rows, k=k, n=n, weight_bytes=nbytes, copies=copies, floor_us=nbytes / copy_bps * 1e6,
               results=[])
    reference = jnp.dot(x, ws[0]).astype(jnp.float32)
    candidates = [("xla", jnp.dot)] + [(config_name(c), lambda a, w, c=c: skinny_matmul(a, w, config=c))
                                       for c in configs if skinny_supported(rows, k, n, c)]
    reps = 2 if smoke else max(4, math.ceil(0.02 / (copies * rec["floor_us"] * 1e-6)))
    for label, matmul in candidates:
        res = dict(impl=label)
        try:
            err = float(jnp.max(jnp.abs(matmul(x, ws[0]).astype(jnp.float32) - reference)))
            t, _ = time_loop(_step(matmul), jnp.copy(x), ws, reps=reps, calls=1 if smoke else 3)
            us = t.per_step_s / copies * 1e6
            res.update(us=us, gb_per_s=nbytes / us * 1e-3, of_copy=nbytes / (us * 1e-6) / copy_bps,
                       max_abs_diff_vs_xla=err, compile_s=t.compile_s)
            log(f"  {name} [{rows}x{k}] @ [{k}x{n}] {label:>12}: {us:8.1f} us  {res['gb_per_s']:7.0f} GB/s "
                f"({res['of_copy']:.0%} of copy)  |diff| {err:.3g}")
        except Exception as exc:  # a config that fails to compile is recorded; the others go on
            record_failure(res, f"{name} {label}", exc)
        rec["results"].append(res)
    timed = [r for r in rec["results"] if "us" in r and r["impl"] != "xla"]
    rec["best_skinny"] = min(timed, key=lambda r: r["us"])["impl"] if timed else None
    return rec


def markdown(report: dict) -> str:
    lines = [f"# GEMMs at few rows ({report['date']}, {report['device']}, jax {report['jax']})", "",
             f"Copy bandwidth {report['copy']['bytes_per_s'] / 1e12:.2f} TB/s. us per matmul (share of the copy "
             "rate); configs are block_n x block_k x warps x stages.", ""]
    impls = ["xla"] + [config_name(c) for c in parse_configs(report["configs"])]
    lines += md_header(["shape", "rows", "floor us"] + impls)
    for s in report["shapes"]:
        by = {r["impl"]: r for r in s["results"]}
        cells = [f"{by[i]['us']:.1f} ({by[i]['of_copy']:.0%})" if "us" in by.get(i, {}) else
                 ("failed" if i in by else "-") for i in impls]
        lines.append(md_row([f"{s['name']} {s['k']}->{s['n']}", s["rows"], f"{s['floor_us']:.1f}"] + cells))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = arg_parser("gemm", __doc__, "tiny shapes in Pallas interpret mode (CPU)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="skinny matmul launch shapes, BLOCKNxBLOCKKxWARPSxSTAGES, "
                   f"comma-separated (default {DEFAULT_CONFIGS})")
    p.add_argument("--only", default="", help="comma list of shape-name prefixes to run (default: all)")
    args = p.parse_args(argv)
    configs = parse_configs(args.configs)
    shapes = SMOKE_SHAPES if args.smoke else PADDED_SHAPES
    if args.only:
        shapes = [s for s in shapes if any(s[0].startswith(o) for o in args.only.split(","))]
    if args.smoke:
        configs = [SkinnyConfig(16, 64, 4, 2), SkinnyConfig(32, 128, 4, 2)]
        args.configs = ",".join(config_name(c) for c in configs)
    copy = copy_bandwidth(args.smoke)
    report = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, configs=args.configs, copy=copy, shapes=[])
    for name, rows, k, n in shapes:
        report["shapes"].append(time_shape(name, rows, k, n, configs, copy["bytes_per_s"], args.smoke))
    write_report(args.out, "bench_gemm", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
