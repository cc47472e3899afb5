"""Benchmark of hybrid tree attention and the Pallas kernels (their correctness is checked by the GPU tests:
``JAX_PLATFORMS=cuda python -m pytest -m gpu tests/test_pallas_kernels.py tests/test_cudnn_cache.py``).

    python -m tools.attention --out DIR --sections copy,sweep,table --budget-s 190   # H200, ~4 minutes
    python -m tools.attention --smoke --out DIR    # tiny shapes, CPU interpret mode, seconds

Sections (``--sections``, default all, in this order):
  copy    HBM bandwidth ceiling (:func:`infer.bench.harness.copy_bandwidth`): ``x + 1`` over a 1 GiB uint32
          buffer (bytes = read + write) in the in-loop timing, and by 10 chained dispatches for comparison
  sweep   cache_attention block_r / block_k / num_splits / num_warps at 32k (Llama-3-8B heads, batch 1),
          for 1 and for 74 queries; the current ``default_config`` first, marked "(default)"; then the split
          count of the cuDNN cache half
  mosaic  the Mosaic GPU cache half's launch shapes (``--mosaic-shapes``) against the cuDNN cache half and the
          roofline (GPU only: :mod:`tools.attention_mosaic`)
  phases  the Mosaic GPU cache half's compute warpgroups by phase (Q K^T, softmax, P V, ...), same shapes and
          config variants, from Mosaic GPU's on-device profiler (GPU only, with JAX_PLATFORMS=cuda,cpu:
          :mod:`tools.mosaic_phases`)
  table   Llama-3-8B (32/8 heads) and Vicuna-7B (32/32) shapes, head_dim 128, bf16, batch 1 and 4, cache
          length 4k..64k, 74 new tokens under a random tree mask: hybrid attention with impl pallas / xla / naive,
          the Pallas cache half alone (and its kernel alone), the tree half alone, single-token decode
          (cache_attention, M=1), jax.nn.dot_product_attention over the cache for the 74 queries; achieved
          cache bytes/s.
Writes ``bench_attention.json`` (every number) and ``bench_attention.md`` (tables) to ``--out``.

Timing (every op): ``n`` iterations of the op inside one jitted ``lax.fori_loop``, perturbed so that nothing is
hoisted, over rotated K/V sets so that the cache is read from HBM, the empty loop's time per step subtracted
(:mod:`tools.attention_loop`). Warm-up call first, then the median of ``--calls`` calls (buffers donated,
chained). Both the raw per-step time and the overhead are in the JSON (``raw_us``, ``overhead_us``) and the
markdown.
"""

from __future__ import annotations

import datetime
import sys
import time
import traceback

import jax

from tools.attention_loop import L2_BYTES, OpTimer
from tools.attention_mosaic import VARIANT_KINDS, run_sweep_mosaic
from tools.attention_report import markdown
from tools.attention_sections import run_sweep, run_sweep_cudnn, run_table, sweep_best
from tools.mosaic_phases import run_phases
from infer.bench.harness import arg_parser, copy_bandwidth, log, names_arg, write_report

SECTIONS = ("copy", "sweep", "mosaic", "phases", "table")
TIMING_METHOD = ("each op run n times inside one jitted lax.fori_loop; every step perturbs its inputs by a scalar "
                 "of the previous output (x 1e-30) and rewrites the cache's last slot in place, so nothing is "
                 "folded or hoisted; R distinct K/V sets rotated (cycle >= 3x L2 where possible); n chosen so "
                 "one call lasts >= ~{target_ms:.0f} ms; warm-up, median of {calls} calls; the same loop with an "
                 "identity op is subtracted.")

variant_kinds_arg = names_arg(VARIANT_KINDS, "variant kind", none=True)  # --mosaic-variants


def parse_args(argv=None):
    p = arg_parser("attention", __doc__, "tiny shapes in interpret mode (CPU), for tests",
                   prog="python -m tools.attention")
    p.add_argument("--sections", default=",".join(SECTIONS), help="subset of " + ",".join(SECTIONS))
    p.add_argument("--models", default="llama3-8b,vicuna-7b")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--lengths", default="32768,4096,16384,65536", help="cache lengths, run in this order")
    p.add_argument("--new-tokens", type=int, default=74)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                   help="table dtype (jax 0.11.2's Mosaic GPU attention kernel takes float16 only: its mgpu column "
                        "is measured with float16 only)")
    p.add_argument("--impls", default="gpu,pallas,cudnn,xla,naive,cache,kernel,cache_cudnn,mgpu,tree,decode,"
                                      "decode_cudnn,dpa",
                   help="table columns: hybrid gpu (= auto on a GPU) / pallas / cudnn / xla / naive, the Pallas "
                        "cache half and its kernel alone, the cuDNN split cache half, jax's Mosaic GPU flash "
                        "kernel on the same split problem (mgpu), tree half, decode (M=1) with the Pallas and "
                        "the cuDNN cache half, dpa (jax.nn.dot_product_attention)")
    # cache_attention launch parameters used by the table (0 / unset = the kernel's default_config)
    p.add_argument("--block-r", type=int, default=0)
    p.add_argument("--block-k", type=int, default=0)
    p.add_argument("--num-splits", type=int, default=0)
    p.add_argument("--num-warps", type=int, default=0)
    p.add_argument("--num-stages", type=int, default=0)
    p.add_argument("--combine", default="pallas", choices=("pallas", "xla"), help="merge of the splits")
    # sweep grid
    p.add_argument("--sweep-length", type=int, default=32768)
    p.add_argument("--sweep-model", default="llama3-8b")
    p.add_argument("--sweep-batch", type=int, default=1)
    p.add_argument("--sweep-block-k", default="32,64,128",
                   help="M=1 key tiles (bf16 K+V tiles x stages must fit in 227 KB of shared memory)")
    p.add_argument("--sweep-splits-decode", default="0,8,16", help="0 = default_config")
    p.add_argument("--sweep-splits-tree", default="0,4,16")
    p.add_argument("--sweep-block-r-tree", default="64,128")
    p.add_argument("--sweep-warps-decode", default="4")
    p.add_argument("--sweep-warps-tree", default="8")
    p.add_argument("--sweep-stages-decode", default="2,3")
    p.add_argument("--sweep-stages-tree", default="2")
    p.add_argument("--sweep-block-k-tree", default="64,128")
    p.add_argument("--mosaic-shapes", default="padded-8b:64:16384:1,padded-8b:64:32768:1,llama3-8b:128:32768:1,"
                                               "padded-8b:64:16384:4",
                   help="model:head_dim:cache_length:batch,... of the mosaic section")
    p.add_argument("--mosaic-budget-s", type=float, default=150.0)
    p.add_argument("--mosaic-variants", type=variant_kinds_arg, default=VARIANT_KINDS, metavar="KIND,...",
                   help=f"mosaic and phases sections: which one-step changes of the default config to run "
                        f"besides it (any of {','.join(VARIANT_KINDS)}; 'none': the default config (and cuDNN) "
                        f"only)")
    p.add_argument("--target-s", type=float, default=0.025,
                   help="seconds per timed call: the in-jit loop count n is chosen so one call lasts about this")
    p.add_argument("--calls", type=int, default=5, help="timed calls per op (median reported), after a warm-up")
    p.add_argument("--max-rotate", type=int, default=16, help="most K/V buffer sets rotated over (L2 coldness)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new work after this")
    p.add_argument("--sweep-budget-s", type=float, default=50.0)
    p.add_argument("--sweep-cudnn-splits", default="0,4,8,16,32,64,128",
                   help="num_splits of the cuDNN cache half swept at --sweep-length (0 = default_num_splits)")
    args = p.parse_args(argv)
    args.section_list = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.section_list if s not in SECTIONS]
    if bad:
        p.error(f"unknown --sections {bad}; choose from {','.join(SECTIONS)} (the kernel checks are GPU tests now)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from pallas import resolve_backend
    backend = "interpret" if args.smoke else resolve_backend(None)
    t_start = time.perf_counter()
    timer = OpTimer(args)
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
                  jax=jax.__version__, backend=backend, smoke=args.smoke, dtype=args.dtype,
                  argv=sys.argv[1:] if argv is None else argv,
                  timing=dict(method=TIMING_METHOD.format(target_ms=1e3 * timer.target_s, calls=timer.calls),
                              target_s=timer.target_s, calls=timer.calls, l2_bytes=L2_BYTES))
    log(f"attention: device {report['device']} ({report['platform']}), jax {jax.__version__}, "
        f"kernel backend {backend}")

    def save():
        report["timing"].update(compile_s=round(timer.compile_s, 1), recompiles=timer.recompiles)
        return write_report(args.out, "bench_attention", report, markdown(report))

    copy_bw = None
    if "copy" in args.section_list:
        log("== copy bandwidth")
        try:
            report["copy"] = copy_bandwidth(args.smoke, args.target_s, args.calls)
            copy_bw = report["copy"]["bytes_per_s"]
        except Exception as exc:
            log(f"  copy FAILED {exc}")
            traceback.print_exc()
        save()
    if "sweep" in args.section_list:
        log("== sweep")
        report["sweep"] = run_sweep(args, backend, copy_bw, t_start, timer)
        report["sweep_best"] = sweep_best(report["sweep"])
        save()
        log("== sweep (cuDNN cache half)")
        report["sweep_cudnn"] = run_sweep_cudnn(args, copy_bw, t_start, timer)
        save()
    if "mosaic" in args.section_list:
        if jax.default_backend() == "gpu":
            log("== mosaic")
            report["sweep_mosaic"] = run_sweep_mosaic(args, copy_bw, t_start, timer)
            save()
        else:
            log("== mosaic: skipped (needs a GPU; the Mosaic GPU interpreter is too slow to time)")
    if "phases" in args.section_list:
        if jax.default_backend() == "gpu":
            log("== phases")
            report["mosaic_phases"] = run_phases(args)
            save()
        else:
            log("== phases: skipped (needs a GPU: the on-device profiler times the compiled kernel)")
    if "table" in args.section_list:
        log("== table")
        report["table"] = run_table(args, backend, copy_bw, t_start, timer)
        save()
    report["elapsed_s"] = time.perf_counter() - t_start
    paths = save()
    log(f"done in {report['elapsed_s']:.0f} s (compiling {timer.compile_s:.0f} s, {timer.recompiles} recompiles); "
        f"wrote {paths[0]} and {paths[1]}")
    return report


if __name__ == "__main__":
    main()
