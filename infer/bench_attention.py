"""GPU check + benchmark of hybrid tree attention and the Pallas kernels.

    python -m infer.bench_attention --out DIR            # on the GPU (about 4 minutes)
    python -m infer.bench_attention --smoke --out DIR    # tiny shapes, CPU interpret mode, seconds

Sections (``--sections``, default all, in this order):
  checks  each kernel against its pure-jnp reference at a few shapes (relative error, PASS/FAIL; a failure
          prints its traceback and the run goes on)
  copy    device-to-device copy bandwidth (bytes read + written / time) of a 1 GiB buffer
  sweep   cache_attention block_r / block_k / num_splits / num_warps at 32k (Llama-3-8B heads, batch 1),
          for 1 and for 74 queries
  table   Llama-3-8B (32/8 heads) and Vicuna-7B (32/32) shapes, head_dim 128, bf16, batch 1 and 4, cache
          length 4k..64k, 74 new tokens under a random tree mask: hybrid attention with impl pallas / xla / naive,
          the Pallas cache half alone (and its kernel alone), single-token decode (cache_attention, M=1),
          jax.nn.dot_product_attention over the cache for the 74 queries; achieved cache bytes/s.
Writes ``bench_attention.json`` (every number) and ``bench_attention.md`` (tables) to ``--out``.

Timing: jitted functions, warm-up, groups of back-to-back asynchronous calls (one sync per group), median
over groups of the per-call time; inputs rotate over enough buffer sets to exceed the 60 MB L2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

MODELS = {"llama3-8b": (32, 8), "vicuna-7b": (32, 32)}
L2_BYTES = 60 * 2**20


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory for bench_attention.json / .md")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU), for tests")
    p.add_argument("--sections", default="checks,copy,sweep,table")
    p.add_argument("--models", default="llama3-8b,vicuna-7b")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--lengths", default="32768,65536,16384,4096", help="cache lengths, run in this order")
    p.add_argument("--new-tokens", type=int, default=74)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--impls", default="pallas,xla,naive,cache,kernel,tree,decode,dpa",
                   help="table columns: hybrid pallas/xla/naive, cache half, its kernel only, tree half, "
                        "decode (M=1), dpa (jax.nn.dot_product_attention)")
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
    p.add_argument("--target-s", type=float, default=0.12, help="timing seconds per measurement (approx.)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new work after this")
    p.add_argument("--sweep-budget-s", type=float, default=50.0)
    return p.parse_args(argv)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# ---------------------------------------------------------------------------------------------- inputs

def tree_masks(rng, batch: int, num_new: int, num_accepted: int = 5, num_pad: int = 5) -> np.ndarray:
    """[B, M, M] verification masks (reference.md 2.4 layout): accepted tokens causal, tree nodes with random
    parents see every accepted token plus their ancestors and themselves, padding rows see nothing."""
    num_accepted = min(num_accepted, num_new)
    num_pad = min(num_pad, num_new - num_accepted)
    nodes = num_new - num_accepted - num_pad
    out = np.zeros((batch, num_new, num_new), bool)
    for b in range(batch):
        a = num_accepted
        out[b, :a, :a] = np.tril(np.ones((a, a), bool))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]
        for i in range(nodes):
            out[b, a + i, :a] = True
            j = i
            while j >= 0:
                out[b, a + i, a + j] = True
                j = parents[j]
    return out


def make_inputs(seed: int, B: int, M: int, S: int, H: int, K: int, D: int, dtype, lengths=None) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = [S] * B
    return dict(
        q=jax.random.normal(keys[0], (B, M, H, D), dtype),
        k_cache=jax.random.normal(keys[1], (B, S, K, D), dtype),
        v_cache=jax.random.normal(keys[2], (B, S, K, D), dtype),
        lengths=jnp.asarray(lengths, jnp.int32),
        k_new=jax.random.normal(keys[3], (B, M, K, D), dtype),
        v_new=jax.random.normal(keys[4], (B, M, K, D), dtype),
        mask=jnp.asarray(tree_masks(rng, B, M)),
    )


def cache_bytes(B, L, K, D, dtype) -> int:
    return 2 * B * L * K * D * jnp.dtype(dtype).itemsize


# ---------------------------------------------------------------------------------------------- timing

def time_fn(fn, arg_sets, *, target_s: float, max_group: int = 64) -> dict:
    """Median per-call seconds of ``fn`` (jitted) over ``arg_sets`` used round-robin."""
    out = fn(*arg_sets[0])
    jax.block_until_ready(out)  # compile
    t0 = time.perf_counter()
    outs = [fn(*a) for a in arg_sets]
    jax.block_until_ready(outs)
    est = max((time.perf_counter() - t0) / len(arg_sets), 1e-6)
    del outs
    n = len(arg_sets)
    group = int(min(max(n, math.ceil(2e-3 / est)), max(n, max_group)))
    group = max(n, group // n * n)
    reps = int(min(max(3, target_s / (group * est)), 25))
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*arg_sets[i % n]) for i in range(group)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - t0) / group)
        del outs
    return dict(median_s=statistics.median(per_call), min_s=min(per_call), reps=reps, group=group)


def num_buffers(bytes_per_set: int, smoke: bool) -> int:
    if smoke:
        return 1
    return int(min(8, max(1, math.ceil(2.5 * L2_BYTES / max(bytes_per_set, 1)))))


# ---------------------------------------------------------------------------------------------- functions

def cache_kwargs(args) -> dict:
    kw = {"combine": args.combine}
    for name in ("block_r", "block_k", "num_splits", "num_warps", "num_stages"):
        val = getattr(args, name)
        if val:
            kw[name] = val
    return kw


def build_fns(args, backend) -> dict:
    """name -> jitted fn(q, k_cache, v_cache, lengths, k_new, v_new, mask, q1)."""
    from longspec_jax.attention import hybrid_tree_attention
    from pallas import cache_attention, cache_attention_partials, tree_attention

    ckw = cache_kwargs(args)

    def hybrid(impl):  # impl="pallas" uses the kernels' auto backend (interpret on CPU, Triton on GPU)
        return jax.jit(lambda q, kc, vc, L, kn, vn, m, q1: hybrid_tree_attention(q, kc, vc, L, kn, vn, m,
                                                                                 impl=impl))

    def dpa(q, kc, vc, L, kn, vn, m, q1):
        impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
        return jax.nn.dot_product_attention(q, kc, vc, key_value_seq_lengths=L, implementation=impl)

    def dpa_xla(q, kc, vc, L, kn, vn, m, q1):
        return jax.nn.dot_product_attention(q, kc, vc, key_value_seq_lengths=L, implementation="xla")

    return {
        "pallas": hybrid("pallas"),
        "xla": hybrid("xla"),
        "naive": hybrid("naive"),
        "cache": jax.jit(lambda q, kc, vc, L, kn, vn, m, q1: cache_attention(q, kc, vc, L, backend=backend, **ckw)),
        "kernel": jax.jit(lambda q, kc, vc, L, kn, vn, m, q1: cache_attention_partials(
            q, kc, vc, L, backend=backend, **{k: v for k, v in ckw.items() if k != "combine"})),
        "tree": jax.jit(lambda q, kc, vc, L, kn, vn, m, q1: tree_attention(q, kn, vn, m, backend=backend)),
        "decode": jax.jit(lambda q, kc, vc, L, kn, vn, m, q1: cache_attention(q1, kc, vc, L, backend=backend,
                                                                              **ckw)),
        "dpa": jax.jit(dpa),
        "dpa_xla": jax.jit(dpa_xla),
    }


def arg_tuple(inp: dict) -> tuple:
    return (inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["k_new"], inp["v_new"], inp["mask"],
            inp["q"][:, :1])


# ---------------------------------------------------------------------------------------------- sections

def rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def lse_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    if not np.array_equal(np.isneginf(a), np.isneginf(b)) or np.isnan(a).any():
        return float("inf")
    fin = np.isfinite(b)
    return float(np.max(np.abs(a[fin] - b[fin]), initial=0.0))


def run_checks(args, backend, record) -> None:
    from longspec_jax.attention import hybrid_tree_attention
    from pallas import (cache_attention, cache_attention_reference, masked_attention_reference,
                        tree_attention)

    if args.smoke:
        shapes = [("tree", 2, 16, 16, 4, 2, 64, jnp.float32), ("cache", 2, 8, 256, 4, 2, 64, jnp.bfloat16)]
    else:
        shapes = [
            ("tree", 2, 74, 74, 32, 8, 128, jnp.bfloat16), ("tree", 2, 74, 74, 32, 32, 128, jnp.bfloat16),
            ("tree", 2, 74, 74, 32, 8, 128, jnp.float32), ("tree", 1, 16, 69, 32, 8, 128, jnp.bfloat16),
            ("tree", 2, 74, 74, 28, 4, 64, jnp.bfloat16),
            ("cache", 2, 1, 8192, 32, 8, 128, jnp.bfloat16), ("cache", 2, 74, 8192, 32, 8, 128, jnp.bfloat16),
            ("cache", 2, 74, 8192, 32, 32, 128, jnp.bfloat16), ("cache", 2, 74, 8192, 32, 8, 128, jnp.float32),
            ("cache", 1, 1, 8192, 32, 32, 128, jnp.float32), ("cache", 1, 512, 8192, 32, 8, 128, jnp.bfloat16),
            ("cache", 2, 74, 4000, 28, 4, 64, jnp.bfloat16),
            ("hybrid", 2, 74, 16384, 32, 8, 128, jnp.bfloat16),
        ]
    for n, (kind, B, M, S, H, K, D, dtype) in enumerate(shapes):
        name = f"{kind} B{B} M{M} S{S} H{H}/K{K} D{D} {jnp.dtype(dtype).name}"
        tol = 2e-5 if dtype == jnp.float32 else 1.5e-2
        lse_tol = 1e-4 if dtype == jnp.float32 else 5e-3
        try:
            lengths = [S] + [max(0, S // 3 - 7)] * (B - 1)
            if kind == "tree":
                inp = make_inputs(100 + n, B, M, S, H, K, D, dtype)
                kn, vn = inp["k_new"][:, :S], inp["v_new"][:, :S]  # S = number of new keys here
                if S != M:
                    kn = jax.random.normal(jax.random.PRNGKey(n), (B, S, K, D), dtype)
                    vn = jax.random.normal(jax.random.PRNGKey(n + 1), (B, S, K, D), dtype)
                    full = tree_masks(np.random.default_rng(n), B, S, num_accepted=1, num_pad=0)
                    mask = jnp.asarray(full[:, S - M:])
                else:
                    mask = inp["mask"]
                out = tree_attention(inp["q"], kn, vn, mask, backend=backend)
                with jax.default_matmul_precision("highest"):
                    ref = masked_attention_reference(inp["q"], kn, vn, mask)
            elif kind == "cache":
                inp = make_inputs(100 + n, B, M, S, H, K, D, dtype, lengths)
                out = cache_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], backend=backend)
                with jax.default_matmul_precision("highest"):
                    ref = cache_attention_reference(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"])
            else:
                inp = make_inputs(100 + n, B, M, S, H, K, D, dtype, lengths)
                a = (inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["k_new"], inp["v_new"],
                     inp["mask"])
                out = hybrid_tree_attention(*a, impl="pallas")
                with jax.default_matmul_precision("highest"):
                    ref = hybrid_tree_attention(*a, impl="naive")
            e, le = rel_err(out[0], ref[0]), lse_err(out[1], ref[1])
            nan = bool(np.isnan(np.asarray(jnp.asarray(out[0], jnp.float32))).any())
            ok = e < tol and le < lse_tol and not nan
            log(f"  [{'PASS' if ok else 'FAIL'}] {name}: rel err {e:.2e} (tol {tol:.0e}), "
                f"max |lse err| {le:.2e}, nan={nan}")
            record.append(dict(name=name, ok=ok, rel_err=e, lse_err=le, nan=nan))
        except Exception as exc:  # keep going: the lead reads every failure of the first run at once
            log(f"  [FAIL] {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            record.append(dict(name=name, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000]))


def run_copy(args) -> dict:
    n = 2**12 if args.smoke else 2**28  # uint32 elements: 1 GiB on the GPU
    x = jnp.zeros((n,), jnp.uint32)
    f = jax.jit(lambda a: a + jnp.uint32(1))
    t = time_fn(f, [(x,)], target_s=args.target_s)
    bw = 2 * x.nbytes / t["median_s"]
    log(f"  copy {x.nbytes / 2**30:.3f} GiB: {t['median_s'] * 1e6:.1f} us -> {bw / 1e12:.3f} TB/s (read+write)")
    return dict(bytes=int(x.nbytes), **t, bytes_per_s=bw)


def run_sweep(args, backend, copy_bw, t_start) -> list:
    from pallas import cache_attention
    from pallas.cache_attention import default_config

    H, K = MODELS[args.sweep_model]
    B, D, S = args.sweep_batch, args.head_dim, args.sweep_length
    dtype = jnp.bfloat16
    if args.smoke:
        H, K, B, D, S = 4, 2, 1, 64, 256
    inp_sets = [make_inputs(200 + i, B, args.new_tokens, S, H, K, D, dtype)
                for i in range(num_buffers(cache_bytes(B, S, K, D, dtype), args.smoke))]
    nbytes = cache_bytes(B, S, K, D, dtype)
    results = []
    sweep_start = time.perf_counter()
    for M in ((1,) if args.smoke else (1, args.new_tokens)):
        G = H // K
        base = default_config(B, K, M, G, S, head_dim=D, itemsize=jnp.dtype(dtype).itemsize)
        block_rs = [base["block_r"]] if M == 1 else _ints(args.sweep_block_r_tree)
        splits = _ints(args.sweep_splits_decode if M == 1 else args.sweep_splits_tree)
        if args.smoke:
            block_rs, splits = block_rs[:1], [0]
        kind = "decode" if M == 1 else "tree"
        block_ks = _ints(args.sweep_block_k if M == 1 else args.sweep_block_k_tree)
        warps = _ints(getattr(args, f"sweep_warps_{kind}"))
        stages = _ints(getattr(args, f"sweep_stages_{kind}"))
        if args.smoke:
            block_ks, warps, stages = block_ks[:1], warps[:1], stages[:1]
        combos = [(br, bk, ns, nw, st, "pallas") for br in block_rs for bk in block_ks for ns in splits
                  for nw in warps for st in stages]
        if not args.smoke:  # the default config with the jnp merge of the splits, for comparison
            combos.append((base["block_r"], base["block_k"], 0, base["num_warps"], base["num_stages"], "xla"))
        for br, bk, ns, nw, st, comb in combos:
            if time.perf_counter() - sweep_start > args.sweep_budget_s or time.perf_counter() - t_start > args.budget_s:
                log("  sweep budget used up; skipping the rest")
                return results
            cfg = dict(block_r=br, block_k=bk, num_splits=ns or None, num_warps=nw, num_stages=st, combine=comb)
            label = (f"M={M} block_r={br} block_k={bk} splits={ns or base['num_splits']} warps={nw} stages={st} "
                     f"combine={comb}")
            try:
                fn = jax.jit(lambda q, kc, vc, L, _cfg=cfg: cache_attention(q, kc, vc, L, backend=backend, **_cfg))
                sets = [(i["q"][:, :M], i["k_cache"], i["v_cache"], i["lengths"]) for i in inp_sets]
                t = time_fn(fn, sets, target_s=args.target_s / 2)
                bw = nbytes / t["median_s"]
                results.append(dict(M=M, **cfg, splits_used=ns or base["num_splits"], us=t["median_s"] * 1e6,
                                    bytes_per_s=bw,
                                    frac_copy_bw=bw / copy_bw if copy_bw else None))
                log(f"  {label}: {t['median_s'] * 1e6:8.1f} us  {bw / 1e12:.2f} TB/s"
                    + (f" ({100 * bw / copy_bw:.0f}% of copy)" if copy_bw else ""))
            except Exception as exc:
                log(f"  {label}: FAILED {type(exc).__name__}: {exc}")
                traceback.print_exc()
                results.append(dict(M=M, **cfg, splits_used=ns or base["num_splits"],
                                    error=f"{type(exc).__name__}: {exc}"[:1000]))
    return results


def run_table(args, backend, copy_bw, t_start) -> list:
    impls = args.impls.split(",")
    rows = []
    models = args.models.split(",")
    batches, lengths = _ints(args.batches), _ints(args.lengths)
    D, M, dtype = args.head_dim, args.new_tokens, jnp.bfloat16
    if args.smoke:
        models, batches, lengths, D, M = models[:1], [1], [256], 64, 8
    fns = build_fns(args, backend)
    for S in lengths:
        for model in models:
            H, K = MODELS[model]
            if args.smoke:
                H, K = 4, 2
            for B in batches:
                if time.perf_counter() - t_start > args.budget_s:
                    log(f"  budget used up: skipping {model} B={B} S={S}")
                    rows.append(dict(model=model, B=B, S=S, skipped=True))
                    continue
                row = dict(model=model, H=H, K=K, D=D, B=B, S=S, M=M, us={}, errors={})
                nbytes = cache_bytes(B, S, K, D, dtype)
                try:
                    sets = [arg_tuple(make_inputs(300 + i, B, M, S, H, K, D, dtype))
                            for i in range(num_buffers(nbytes, args.smoke))]
                except Exception as exc:
                    log(f"  {model} B={B} S={S}: input allocation failed: {exc}")
                    row["errors"]["inputs"] = str(exc)[:1000]
                    rows.append(row)
                    continue
                for impl in impls:
                    try:
                        t = time_fn(fns[impl], sets, target_s=args.target_s)
                        row["us"][impl] = t["median_s"] * 1e6
                    except Exception as exc:
                        if impl == "dpa":  # cuDNN may refuse the shape: fall back to the XLA version
                            try:
                                t = time_fn(fns["dpa_xla"], sets, target_s=args.target_s)
                                row["us"][impl] = t["median_s"] * 1e6
                                row["dpa_impl"] = "xla"
                                row["errors"]["dpa_cudnn"] = f"{type(exc).__name__}: {exc}"[:500]
                                continue
                            except Exception as exc2:
                                exc = exc2
                        row["errors"][impl] = f"{type(exc).__name__}: {exc}"[:1000]
                        log(f"    {impl}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                us = row["us"]
                for name in ("cache", "kernel", "decode"):
                    if name in us:
                        bw = nbytes / (us[name] * 1e-6)
                        row[f"{name}_bytes_per_s"] = bw
                        if copy_bw:
                            row[f"{name}_frac_copy_bw"] = bw / copy_bw
                if "pallas" in us and "naive" in us:
                    row["naive_over_pallas"] = us["naive"] / us["pallas"]
                if "pallas" in us and "decode" in us:
                    row["pallas_over_decode"] = us["pallas"] / us["decode"]
                del sets
                rows.append(row)
                summary = "  ".join(f"{k} {v:.1f}" for k, v in us.items())
                extra = ""
                if "cache_frac_copy_bw" in row:
                    extra = f"  cache half {100 * row['cache_frac_copy_bw']:.0f}% of copy BW"
                log(f"  {model} B={B} S={S}: [us] {summary}{extra}")
    return rows


# ---------------------------------------------------------------------------------------------- report

def markdown(report: dict) -> str:
    lines = [f"# Attention benchmark ({report['date']}, {report['device']}, jax {report['jax']})", ""]
    if report.get("checks"):
        lines += ["## Checks", "", "| check | result | rel err | lse err |", "|---|---|---|---|"]
        for c in report["checks"]:
            err = f"{c['rel_err']:.2e}" if "rel_err" in c else c.get("error", "")[:200].replace("|", "/")
            lse = f"{c['lse_err']:.2e}" if "lse_err" in c else ""
            lines.append(f"| {c['name']} | {'PASS' if c['ok'] else 'FAIL'} | {err} | {lse} |")
        lines.append("")
    if report.get("copy"):
        lines += [f"Copy bandwidth: {report['copy']['bytes_per_s'] / 1e12:.3f} TB/s (read + write, 1 GiB).", ""]
    if report.get("table"):
        impl_names = ["pallas", "xla", "naive", "cache", "kernel", "tree", "decode", "dpa"]
        first = next((r for r in report["table"] if "M" in r), {})
        lines += [f"## Hybrid tree attention, {first.get('M', '?')} new tokens, bf16, head_dim {first.get('D', '?')} "
                  "(median us per call)", "",
                  "| model | B | S | " + " | ".join(impl_names) + " | naive/pallas | pallas/decode | cache half % copy BW "
                  "| kernel % copy BW | decode % copy BW |",
                  "|" + "---|" * (3 + len(impl_names) + 5)]
        for r in report["table"]:
            if r.get("skipped"):
                lines.append(f"| {r['model']} | {r['B']} | {r['S']} | skipped (budget) |")
                continue
            us = r.get("us", {})
            cells = [f"{us[n]:.1f}" if n in us else "-" for n in impl_names]

            def pct(key):
                return f"{100 * r[key]:.0f}%" if key in r else "-"

            def ratio(key):
                return f"{r[key]:.2f}" if key in r else "-"

            lines.append(f"| {r['model']} | {r['B']} | {r['S']} | " + " | ".join(cells)
                         + f" | {ratio('naive_over_pallas')} | {ratio('pallas_over_decode')} | "
                         f"{pct('cache_frac_copy_bw')} | {pct('kernel_frac_copy_bw')} | {pct('decode_frac_copy_bw')} |")
        lines += ["", "pallas / xla / naive: `hybrid_tree_attention(impl=...)`; cache: Pallas cache half "
                  "(`cache_attention`, 74 queries); kernel: its pallas_call alone; tree: `tree_attention`; decode: "
                  "`cache_attention` with 1 query; dpa: `jax.nn.dot_product_attention` over the cache (74 queries, "
                  "cuDNN where it accepts the shape). % copy BW: K+V bytes of the valid cache / time vs the copy "
                  "bandwidth above.", ""]
    if report.get("sweep"):
        lines += ["## cache_attention sweep", "",
                  "| M | block_r | block_k | splits | warps | stages | combine | us | % copy BW |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in report["sweep"]:
            us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80]
            frac = f"{100 * r['frac_copy_bw']:.0f}%" if r.get("frac_copy_bw") else "-"
            lines.append(f"| {r['M']} | {r['block_r']} | {r['block_k']} | {r['splits_used']}{'' if r['num_splits'] else ' (auto)'} | "
                         f"{r['num_warps']} | {r['num_stages']} | {r.get('combine', '')} | {us} | {frac} |")
        for M, best in report.get("sweep_best", {}).items():
            lines.append(f"\nBest for M={M}: {best}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from pallas import resolve_backend
    backend = resolve_backend(None)
    if args.smoke:
        backend = "interpret"
        args.target_s = min(args.target_s, 0.01)
    sections = args.sections.split(",")
    t_start = time.perf_counter()
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
                  jax=jax.__version__, backend=backend, smoke=args.smoke, argv=sys.argv[1:] if argv is None else argv)
    log(f"bench_attention: device {report['device']} ({report['platform']}), jax {jax.__version__}, "
        f"kernel backend {backend}")

    def save():
        (out_dir / "bench_attention.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "bench_attention.md").write_text(markdown(report))

    copy_bw = None
    if "checks" in sections:
        log("== checks")
        report["checks"] = []
        run_checks(args, backend, report["checks"])
        save()
    if "copy" in sections:
        log("== copy bandwidth")
        try:
            report["copy"] = run_copy(args)
            copy_bw = report["copy"]["bytes_per_s"]
        except Exception as exc:
            log(f"  copy FAILED {exc}")
            traceback.print_exc()
        save()
    if "sweep" in sections:
        log("== sweep")
        report["sweep"] = run_sweep(args, backend, copy_bw, t_start)
        best = {}
        for M in sorted({r["M"] for r in report["sweep"]}):
            ok = [r for r in report["sweep"] if r["M"] == M and "us" in r]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                best[str(M)] = {k: b[k] for k in ("block_r", "block_k", "splits_used", "num_warps", "num_stages",
                                                  "combine", "us")}
        report["sweep_best"] = best
        save()
    if "table" in sections:
        log("== table")
        report["table"] = run_table(args, backend, copy_bw, t_start)
        save()
    report["elapsed_s"] = time.perf_counter() - t_start
    save()
    log(f"done in {report['elapsed_s']:.0f} s; wrote {out_dir / 'bench_attention.json'} and .md")
    return report


if __name__ == "__main__":
    main()
