"""Autoregressive decode speed: our jitted decode loop vs HF PyTorch ``generate``, and the memory-bandwidth floor.

    python -m infer.bench decode --out DIR                       # on the GPU, about 5-6 minutes
    python -m infer.bench decode --out DIR --smoke               # tiny shapes on the CPU, seconds

Model: Llama-3-8B shapes (32 layers, d 4096, 32/8 heads of 128, MLP 14336, vocab 128256, untied), random bf16
weights, batch 1, a prompt of random tokens at each context length; greedy.

Each framework runs in its own subprocess (``--worker``) so that its GPU memory is returned before the next
starts (JAX preallocates 75% of the GPU): ``jax``, then ``hf`` (eager, sdpa), then ``hf_static`` (static cache +
``torch.compile``, optional, cut off by its time budget). Workers append one JSON line per measurement to a
results file, so a worker that fails or runs out of time still leaves what it measured.

What is timed:
  jax        the decode loop only: prefill once (untimed, XLA attention), then N calls of
             ``infer.plain.decode_step`` (the step ``generate`` runs) in the harness's in-loop timing (one jitted
             ``fori_loop``, KV cache donated); compile excluded (one warm-up call), median of ``--reps`` calls,
             the cache lengths rewound before each. One cache capacity for all contexts, so prefill and decode
             compile once; attention reads only the valid ``[0, length)`` prefix.
  copy       the harness's copy bandwidth: ``x + 1`` over a 1 GiB uint32 buffer in the in-loop timing.
  hf, hf_static  :mod:`infer.bench.hf_baseline`.
  floor      (all weight bytes + K/V bytes at that context) / copy bandwidth, per token. ``floor_strict`` leaves
             out the embedding table (only one row of it is read per token).
Writes ``bench_decode.json`` (everything) and ``bench_decode.md`` (the table) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from infer.bench.harness import (add_sized_args, arg_parser, copy_bandwidth, error_text, log, md_header, md_row,
                                 nbytes, parse_sized, time_loop, write_report)
from infer.main import positive_ints_arg

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, rope_theta=500000.0, rms_norm_eps=1e-5)
PARTS = ("jax", "hf", "hf_static")
# Seconds each worker may run at most (the overall --budget-s cuts further).
PART_LIMITS = {"jax": 300.0, "hf": 200.0, "hf_static": 200.0}
PREFILL_CHUNK = 512
DEFAULTS = dict(contexts=(1024, 16384, 32768), new_tokens=128)
SMOKE = dict(contexts=(64, 128), new_tokens=16)
PROG = "python -m infer.bench decode"


def parse_args(argv=None):
    p = arg_parser("decode", __doc__, "tiny shapes on the CPU (for tests)")
    add_sized_args(p, (("contexts", positive_ints_arg, "prompt lengths"),
                       ("new-tokens", int, "decode steps timed per run")), DEFAULTS, SMOKE)
    p.add_argument("--hf-new-tokens", type=int, default=0, help="decode steps for HF (0 = --new-tokens)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per context for jax (median)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--impls", default="auto", help="attention impls for our decode (auto = Pallas on GPU); "
                                                   "xla is added when every auto run fails")
    p.add_argument("--budget-s", type=float, default=360.0, help="total wall-time budget of all workers")
    # internal
    p.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.new_tokens <= 1:
        p.error("--new-tokens must be > 1")
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown --parts {bad}; choose from {','.join(PARTS)}")
    args.part_list = parts
    args.hf_new_tokens = args.hf_new_tokens or args.new_tokens
    return args


def shapes(args) -> dict:
    return TINY if args.smoke else LLAMA3_8B


def weight_bytes(s: dict, itemsize: int = 2) -> dict:
    d, V, I, L = s["hidden_size"], s["vocab_size"], s["intermediate_size"], s["num_layers"]
    H, K, hd = s["num_heads"], s["num_kv_heads"], s["head_dim"]
    per_layer = d * (H + 2 * K) * hd + H * hd * d + 3 * d * I + 2 * d
    total = V * d + d * V + L * per_layer + d
    return dict(params=total, bytes=total * itemsize, embed_bytes=V * d * itemsize)


def kv_bytes(s: dict, context: int, itemsize: int = 2) -> int:
    return context * s["num_layers"] * s["num_kv_heads"] * s["head_dim"] * 2 * itemsize


class Recorder:
    """Appends one JSON object per line to the results file (survives a worker being killed)."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, **record) -> None:
        log("result " + json.dumps(record))
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------------------------------- jax worker

def jax_worker(args, record: Recorder) -> None:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from infer.decoding import DecodeSettings
    from infer.generate import plan_shapes
    from infer.plain import decode_step
    from longspec_jax.attention import resolve_impl
    from longspec_jax.config import RopeConfig, TargetConfig
    from longspec_jax.kv_cache import init_cache
    from longspec_jax.sampling import SamplingConfig
    from longspec_jax.target import init_target_params, prefill
    from pallas.sizes import round_up

    s = shapes(args)
    dev = jax.devices()[0]
    record(kind="env", part="jax", device=str(getattr(dev, "device_kind", dev.platform)), backend=jax.default_backend(),
           jax=jax.__version__, python=platform.python_version())
    try:
        c = copy_bandwidth(args.smoke)
        record(kind="copy", bytes=c["bytes"], seconds=c["seconds"], bytes_per_s=c["bytes_per_s"])
    except Exception as e:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        record(kind="copy", error=error_text(e))

    N = args.new_tokens
    _, chunk, _, capacity = plan_shapes(max(args.contexts), N, 1, PREFILL_CHUNK)
    padded = round_up(max(args.contexts), chunk)
    config = TargetConfig(model_type="llama", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                          intermediate_size=s["intermediate_size"], num_layers=s["num_layers"],
                          num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                          rms_norm_eps=s["rms_norm_eps"], rope=RopeConfig(theta=s["rope_theta"]),
                          max_position_embeddings=capacity)
    t0 = time.perf_counter()
    params = init_target_params(config, jax.random.PRNGKey(0), dtype=jnp.bfloat16, std=0.02)
    jax.block_until_ready(params)
    param_bytes = nbytes(params)
    log(f"random bf16 params: {param_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s; cache capacity "
        f"{capacity}, prefill chunk {chunk}")
    record(kind="model", part="jax", param_bytes=param_bytes, capacity=capacity, init_s=time.perf_counter() - t0)

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def prefill_fn(params, tokens_1xT, length_1, cache):
        """The library's chunked prefill (XLA attention: one compile, whatever decode impl is measured)."""
        logits_1xV, cache = prefill(params, config, tokens_1xT, length_1, cache, chunk=chunk, impl="xla")
        return jnp.argmax(logits_1xV, axis=-1).astype(jnp.int32), cache

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, padded)), jnp.int32)
    impls = [x for x in args.impls.split(",") if x]
    done_ok: dict[str, int] = {}
    i = 0
    while i < len(impls):
        impl_name = impls[i]
        i += 1
        impl = resolve_impl(impl_name)
        settings = DecodeSettings(config=config, sampling=SamplingConfig(), capacity=capacity, prefill_chunk=chunk,
                                  out_len=N, prompt_len=padded, impl=impl)

        def step(carry, params, settings=settings):
            """One greedy decode step; the token goes to column ``i`` of the output buffer."""
            cache, last_B, key, out_BxN, i = carry
            key, sub = jax.random.split(key)
            token_B, cache = decode_step(params, settings, cache, last_B, sub)
            return cache.replace(lengths=cache.lengths + 1), token_B, key, out_BxN.at[:, i].set(token_B), i + 1

        cache = init_cache(config.num_layers, 1, capacity, config.num_kv_heads, config.head_dim, jnp.bfloat16)
        done_ok[impl_name] = 0
        for ctx in args.contexts:
            try:
                t0 = time.perf_counter()
                first, cache = prefill_fn(params, tokens, jnp.full((1,), ctx, jnp.int32), cache)
                first.block_until_ready()
                prefill_s = time.perf_counter() - t0
                outs = []

                def start(cache, ctx=ctx, first=first):
                    """The prefilled state (slots written since stay unread); the whole carry is donated."""
                    return (cache.replace(lengths=jnp.full((1,), ctx, jnp.int32)), jnp.copy(first),
                            jax.random.PRNGKey(1), jnp.zeros((1, N), jnp.int32), jnp.int32(0))

                def rewind(carry, outs=outs, start=start):
                    outs.append(np.asarray(carry[3]))
                    return start(carry[0])

                t, carry = time_loop(step, start(cache), (params,), N, args.reps, reset=rewind)
                cache = carry[0]
                outs.append(np.asarray(carry[3]))
                same = all(np.array_equal(outs[0], o) for o in outs[1:])
                record(kind="decode", part="jax", impl=impl_name, resolved_impl=impl, context=ctx, new_tokens=N,
                       seconds=t.call_s, all_seconds=t.call_times_s, ms_per_token=1e3 * t.per_step_s,
                       tokens_per_s=1 / t.per_step_s, first_call_s=t.compile_s + t.first_call_s,
                       prefill_s=prefill_s, repeat_identical=same)
                done_ok[impl_name] += 1
            except Exception as e:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                record(kind="decode", part="jax", impl=impl_name, context=ctx, error=error_text(e))
                if done_ok[impl_name] == 0:
                    log(f"impl {impl_name} failed at its first context: skipping its other contexts")
                    break
                cache = init_cache(config.num_layers, 1, capacity, config.num_kv_heads, config.head_dim,
                                   jnp.bfloat16)
        cache = None
        if impl_name == "auto" and done_ok["auto"] == 0 and "xla" not in impls:
            log("every auto run failed: measuring impl=xla instead")
            impls.append("xla")


# ---------------------------------------------------------------------------------------------------- orchestration

def run_worker(args, part: str, results: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "infer.bench", "decode", "--worker", part, "--results", str(results),
           "--out", args.out, "--contexts", ",".join(map(str, args.contexts)), "--new-tokens", str(args.new_tokens),
           "--hf-new-tokens", str(args.hf_new_tokens), "--reps", str(args.reps), "--impls", args.impls]
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ)
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    log(f"worker {part}: starting (time limit {timeout:.0f} s)")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, cwd=Path(__file__).resolve().parents[2])
        status = "ok" if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"stopped after its {timeout:.0f} s limit"
    elapsed = time.perf_counter() - t0
    log(f"worker {part}: {status} in {elapsed:.1f} s")
    return dict(part=part, status=status, seconds=elapsed)


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut off by a killed worker
    return out


def summarize(args, records: list[dict], workers: list[dict]) -> dict:
    s = shapes(args)
    w = weight_bytes(s)
    copy = next((r for r in records if r.get("kind") == "copy" and "bytes_per_s" in r), None)
    bw = copy["bytes_per_s"] if copy else None
    rows = []
    for ctx in args.contexts:
        row = {"context": ctx, "weight_bytes": w["bytes"], "kv_bytes": kv_bytes(s, ctx)}
        if bw:
            row["floor_ms"] = 1e3 * (w["bytes"] + row["kv_bytes"]) / bw
            row["floor_strict_ms"] = 1e3 * (w["bytes"] - w["embed_bytes"] + row["kv_bytes"]) / bw
        for r in records:
            if r.get("kind") != "decode" or r.get("context") != ctx:
                continue
            name = r["part"] if r["part"] != "jax" else f"jax_{r['impl']}"
            row[name] = {k: r[k] for k in ("ms_per_token", "tokens_per_s", "error") if k in r}
        rows.append(row)
    return dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), smoke=args.smoke, shapes=s,
        weights=w, batch=1, new_tokens=args.new_tokens, hf_new_tokens=args.hf_new_tokens, reps=args.reps,
        copy_bandwidth_bytes_per_s=bw, workers=workers, rows=rows, records=records,
        command=" ".join([PROG] + args.argv))


def _cell(entry) -> str:
    if not entry:
        return "-"
    if "error" in entry:
        return "error"
    return f"{entry['ms_per_token']:.2f} ({entry['tokens_per_s']:.1f}/s)"


def markdown(report: dict) -> str:
    env = {r["part"]: r for r in report["records"] if r.get("kind") == "env"}
    devices = sorted({str(r.get("device")) for r in env.values()})
    versions = ", ".join(dict.fromkeys(f"{k} {v}" for r in env.values() for k, v in r.items()
                                       if k in ("jax", "torch", "transformers")))
    bw = report["copy_bandwidth_bytes_per_s"]
    lines = [f"Decode benchmark, {report['date']}, device: {', '.join(devices)}; {versions}.",
             "",
             f"Shapes: {report['shapes']}; random bf16 weights ({report['weights']['bytes'] / 1e9:.2f} GB), "
             f"batch 1, greedy, {report['new_tokens']} timed decode steps (HF: {report['hf_new_tokens']}).",
             f"Copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)." if bw else "Copy bandwidth: not measured.",
             "",
             "ms per generated token (tokens/s); ratios are ours / floor and HF / ours.",
             ""]
    jax_impls = sorted({k for row in report["rows"] for k in row if k.startswith("jax_")})
    cols = jax_impls + [p for p in ("hf", "hf_static") if any(p in row for row in report["rows"])]
    header = ["context", "floor"] + [c.replace("jax_", "ours ") for c in cols]
    if jax_impls:
        header += [f"{jax_impls[0].replace('jax_', 'ours ')} / floor"]
        header += [f"{c} / ours" for c in cols if c.startswith("hf")]
    lines += md_header(header)
    for row in report["rows"]:
        cells = [str(row["context"]), f"{row['floor_ms']:.2f}" if "floor_ms" in row else "-"]
        cells += [_cell(row.get(c)) for c in cols]
        if jax_impls:
            ours = row.get(jax_impls[0]) or {}
            ok = "ms_per_token" in ours
            cells.append(f"{ours['ms_per_token'] / row['floor_ms']:.2f}x" if ok and "floor_ms" in row else "-")
            for c in cols:
                if c.startswith("hf"):
                    other = row.get(c) or {}
                    cells.append(f"{other['ms_per_token'] / ours['ms_per_token']:.2f}x"
                                 if ok and "ms_per_token" in other else "-")
        lines.append(md_row(cells))
    lines += ["", "floor = (all weight bytes + K/V bytes at the context) / copy bandwidth; without the embedding "
              "table (one row is read per token): " + ", ".join(
                  f"{r['context']}: {r['floor_strict_ms']:.2f} ms" for r in report["rows"] if "floor_strict_ms" in r),
              "", "Workers: " + "; ".join(f"{w['part']} {w['status']} ({w['seconds']:.0f} s)"
                                          for w in report["workers"])]
    errors = [r for r in report["records"] if "error" in r]
    if errors:
        lines += ["", "Errors:"] + [f"- {r.get('part', '')} {r.get('kind')} {r.get('context', '')}: "
                                    f"{r['error'].splitlines()[0][:300]}" for r in errors]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        record = Recorder(args.results)
        if args.worker == "jax":
            jax_worker(args, record)
        else:
            from infer.bench.hf_baseline import hf_worker
            hf_worker(shapes(args), args.contexts, args.hf_new_tokens, args.smoke, record,
                      static=args.worker == "hf_static")
        return None
    out = Path(args.out)
    results = out / "bench_decode_records.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    results.unlink(missing_ok=True)
    start = time.perf_counter()
    workers = []
    for part in args.part_list:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            log(f"worker {part}: skipped, {left:.0f} s of the budget left")
            workers.append(dict(part=part, status="skipped (budget)", seconds=0.0))
            continue
        workers.append(run_worker(args, part, results, min(PART_LIMITS[part], left)))
        report = summarize(args, read_results(results), workers)
        write_report(out, "bench_decode", report, markdown(report))
    report = summarize(args, read_results(results), workers)
    md = markdown(report)
    paths = write_report(out, "bench_decode", report, md)
    print(md, flush=True)
    log(f"total {time.perf_counter() - start:.0f} s; wrote {paths[0]} and {paths[1]}")
    return report
