"""The timed sections of the attention benchmark: the Pallas cache-half launch sweep, the cuDNN cache-half split
sweep and the table of every op over models, batches and cache lengths."""

from __future__ import annotations

import time
import traceback

import jax.numpy as jnp

from tools.attention_loop import EMPTY_EST_S, OpTimer, identity_op, l2_cell, l2_note, num_rotations, per_op
from tools.attention_ops import MODELS, RowInputs, build_ops, cache_bytes, chunk_attention_fn
from infer.bench.harness import error_text, log, record_failure


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _time_cache_half(timer: OpTimer, kind: str, op, uses, inputs: RowInputs, M: int, empty: dict, rec: dict,
                     copy_bw) -> tuple[dict, float | None]:
    """Times a cache-half op with M queries into ``rec``: its time net of the empty loop, the achieved cache
    bytes/s and their fraction of the copy bandwidth. Returns the time and the bytes/s."""
    est_s = inputs.estimate_s("decode" if M == 1 else "cache", M)
    r = per_op(timer.time(kind, op, uses, inputs.small, inputs.kv(), est_s=est_s), empty)
    bw = inputs.nbytes / (r["us"] * 1e-6) if r["us"] > 0 else None
    rec.update(r, bytes_per_s=bw, frac_copy_bw=bw / copy_bw if (copy_bw and bw) else None)
    return r, bw


def run_sweep(args, backend, copy_bw, t_start, timer: OpTimer) -> list:
    """cache_attention block_r / block_k / num_splits / num_warps / num_stages for 1 and M queries; the current
    ``default_config`` first, marked default."""
    from pallas import cache_attention
    from pallas.cache_attention import default_config

    H, K = MODELS[args.sweep_model]
    B, D, S = args.sweep_batch, args.head_dim, args.sweep_length
    dtype = jnp.bfloat16
    if args.smoke:
        H, K, B, D, S = 4, 2, 1, 64, 256
    inputs = RowInputs.rotated(200, B, args.new_tokens, S, H, K, D, dtype, args)
    note = l2_note(inputs.nbytes, inputs.R)
    log(f"  K/V {inputs.nbytes / 1e6:.1f} MB per set, {inputs.R} sets rotated; fits L2: {l2_cell(note)}")
    results = []
    sweep_start = time.perf_counter()
    for M in ((1,) if args.smoke else (1, args.new_tokens)):
        G = H // K
        base = default_config(B, K, M, G, S, head_dim=D, itemsize=jnp.dtype(dtype).itemsize)
        uses = ("q1" if M == 1 else "q", "lengths")
        kind = "decode" if M == 1 else "tree"
        block_rs = [base["block_r"]] if M == 1 else ints(args.sweep_block_r_tree)
        splits = ints(args.sweep_splits_decode if M == 1 else args.sweep_splits_tree)
        block_ks = ints(args.sweep_block_k if M == 1 else args.sweep_block_k_tree)
        warps = ints(getattr(args, f"sweep_warps_{kind}"))
        stages = ints(getattr(args, f"sweep_stages_{kind}"))
        if args.smoke:
            block_rs, splits, block_ks, warps, stages = block_rs[:1], [0], block_ks[:1], warps[:1], stages[:1]

        def is_default(br, bk, ns, nw, st, comb):
            return (comb == "pallas" and (br, bk, ns or base["num_splits"], nw, st)
                    == (base["block_r"], base["block_k"], base["num_splits"], base["num_warps"], base["num_stages"]))

        # The current default_config first (no launch arguments at all), then the grid without its duplicate.
        combos = [("default", None)]
        if not args.smoke:  # the default config with the jnp merge of the splits, for comparison
            combos.append(("default+xla", None))
        combos += [("grid", c) for c in ((br, bk, ns, nw, st, "pallas") for br in block_rs for bk in block_ks
                                         for ns in splits for nw in warps for st in stages) if not is_default(*c)]
        try:
            empty = timer.time("empty", identity_op(uses), uses, inputs.small, inputs.kv(), est_s=EMPTY_EST_S)
        except Exception as exc:
            log(f"  M={M}: empty loop FAILED {error_text(exc)}")
            traceback.print_exc()
            continue
        log(f"  M={M}: loop overhead {empty['per_step_s'] * 1e6:.2f} us/step (perturbation + one-row cache writes)")
        for tag, combo in combos:
            if time.perf_counter() - sweep_start > args.sweep_budget_s or time.perf_counter() - t_start > args.budget_s:
                log("  sweep budget used up; skipping the rest")
                return results
            if combo is None:
                cfg = dict(combine="xla" if tag == "default+xla" else "pallas")
                rec = dict(M=M, default=tag == "default", block_r=base["block_r"], block_k=base["block_k"],
                           num_splits=None, splits_used=base["num_splits"], num_warps=base["num_warps"],
                           num_stages=base["num_stages"], combine=cfg["combine"])
            else:
                br, bk, ns, nw, st, comb = combo
                cfg = dict(block_r=br, block_k=bk, num_splits=ns or None, num_warps=nw, num_stages=st, combine=comb)
                rec = dict(M=M, default=False, **cfg, splits_used=ns or base["num_splits"])
            label = (f"M={M}{' (default)' if rec['default'] else ''} block_r={rec['block_r']} "
                     f"block_k={rec['block_k']} splits={rec['splits_used']} warps={rec['num_warps']} "
                     f"stages={rec['num_stages']} combine={rec['combine']}")
            op = (lambda i, _cfg=cfg, _qn=uses[0]: cache_attention(i[_qn], i["k_cache"], i["v_cache"], i["lengths"],
                                                                    backend=backend, **_cfg))
            try:
                r, bw = _time_cache_half(timer, f"sweep{M}", op, uses, inputs, M, empty, rec, copy_bw)
                rec["l2"] = note
                results.append(rec)
                log(f"  {label}: {r['us']:8.1f} us (raw {r['raw_us']:.1f})" + (f"  {bw / 1e12:.2f} TB/s" if bw else "")
                    + (f" ({100 * bw / copy_bw:.0f}% of copy)" if (copy_bw and bw) else ""))
            except Exception as exc:
                record_failure(rec, label, exc)
                results.append(rec)
    return results


def sweep_best(sweep: list) -> dict:
    """The fastest launch configuration per query count."""
    best = {}
    for M in sorted({r["M"] for r in sweep}):
        ok = [r for r in sweep if r["M"] == M and "us" in r]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            best[str(M)] = {k: b[k] for k in ("default", "block_r", "block_k", "splits_used", "num_warps",
                                              "num_stages", "combine", "us")}
    return best


def run_sweep_cudnn(args, copy_bw, t_start, timer: OpTimer) -> list:
    """num_splits of the cuDNN cache half (``cudnn_cache_attention``) at the sweep shape, 1 and M queries, for
    each model of ``--models``. 0 = ``default_num_splits``. Off a GPU the jnp chunk kernel stands in."""
    from longspec_jax.cudnn_cache import cudnn_cache_attention, default_num_splits
    chunk_fn = chunk_attention_fn()
    B, D, S, dtype = args.sweep_batch, args.head_dim, args.sweep_length, jnp.bfloat16
    models = args.models.split(",")
    splits = ints(args.sweep_cudnn_splits)
    if args.smoke:
        B, D, S, models, splits = 1, 64, 256, models[:1], [0, 2]
    results = []
    for model in models:
        H, K = (4, 2) if args.smoke else MODELS[model]
        inputs = RowInputs.rotated(400, B, args.new_tokens, S, H, K, D, dtype, args)
        for M in ((1,) if args.smoke else (1, args.new_tokens)):
            uses = ("q1" if M == 1 else "q", "lengths")
            default = default_num_splits(B, K, M * (H // K), S)
            empty = timer.time("empty", identity_op(uses), uses, inputs.small, inputs.kv(), est_s=EMPTY_EST_S)
            for ns in splits:
                if time.perf_counter() - t_start > args.budget_s:
                    log("  budget used up; skipping the rest of the cuDNN sweep")
                    return results
                used = ns or default
                if S % used:
                    continue
                rec = dict(model=model, M=M, num_splits=used, default=used == default)
                op = (lambda i, _q=uses[0], _ns=used: cudnn_cache_attention(
                    i[_q], i["k_cache"], i["v_cache"], i["lengths"], num_splits=_ns, chunk_attention=chunk_fn))
                try:
                    r, bw = _time_cache_half(timer, f"cudnn{M}", op, uses, inputs, M, empty, rec, copy_bw)
                    log(f"  cuDNN {model} M={M} splits={used}{' (default)' if rec['default'] else ''}: "
                        f"{r['us']:8.1f} us" + (f" ({100 * bw / copy_bw:.0f}% of copy)" if (copy_bw and bw) else ""))
                except Exception as exc:
                    record_failure(rec, f"cuDNN {model} M={M} splits={used}", exc)
                results.append(rec)
        del inputs
    return results


def _measure_row(ops, impls, row: dict, inputs: RowInputs, timer: OpTimer) -> None:
    """Times every op of ``impls`` on one table row's inputs into ``row`` (us, raw_us, overhead_us, loop)."""
    empties: dict = {}

    def measure(name):
        op, uses, with_cache = ops[name]
        box = inputs.kv() if with_cache else None
        key = (uses, with_cache)
        if key not in empties:
            empties[key] = timer.time("empty", identity_op(uses), uses, inputs.small, box, est_s=EMPTY_EST_S)
        return per_op(timer.time(name, op, uses, inputs.small, box, est_s=inputs.estimate_s(name)), empties[key])

    for impl in impls:
        if impl not in ops:
            continue  # cuDNN / Mosaic GPU columns off a GPU, Mosaic GPU in bfloat16
        try:
            r = measure(impl)
        except Exception as exc:
            r = None
            if impl == "dpa":  # cuDNN may refuse the shape: fall back to the XLA version
                try:
                    r = measure("dpa_xla")
                    row["dpa_impl"] = "xla"
                    row["errors"]["dpa_cudnn"] = error_text(exc, 500)
                except Exception as exc2:
                    exc = exc2
            if r is None:
                row["errors"][impl] = error_text(exc, 1000)
                log(f"    {impl}: FAILED {error_text(exc, 300)}")
                continue
        row["us"][impl], row["raw_us"][impl] = r["us"], r["raw_us"]
        row["overhead_us"][impl], row["loop"][impl] = r["overhead_us"], r["loop"]


def _ratios(row: dict, nbytes: int, copy_bw) -> None:
    """Achieved cache bytes/s of the cache halves and decode, naive / hybrid and hybrid / decode."""
    us = row["us"]
    for name in ("cache", "kernel", "cache_cudnn", "mgpu", "decode", "decode_cudnn"):
        if name in us and us[name] > 0:
            bw = nbytes / (us[name] * 1e-6)
            row[f"{name}_bytes_per_s"] = bw
            if copy_bw:
                row[f"{name}_frac_copy_bw"] = bw / copy_bw
    decodes = [us[n] for n in ("decode", "decode_cudnn") if us.get(n, 0) > 0]
    for hyb in ("gpu", "pallas", "cudnn"):
        if us.get(hyb, 0) > 0 and "naive" in us:
            row[f"naive_over_{hyb}"] = us["naive"] / us[hyb]
        if us.get(hyb, 0) > 0 and decodes:
            row[f"{hyb}_over_decode"] = us[hyb] / min(decodes)


def run_table(args, backend, copy_bw, t_start, timer: OpTimer) -> list:
    """Every op of ``--impls`` for each cache length x model x batch."""
    impls = args.impls.split(",")
    rows = []
    models = args.models.split(",")
    batches, lengths = ints(args.batches), ints(args.lengths)
    D, M, dtype = args.head_dim, args.new_tokens, jnp.dtype(args.dtype)
    if args.smoke:
        models, batches, lengths, D, M = models[:1], [1], [256], 64, 8
    ops = build_ops(args, backend)
    for S in lengths:
        for model in models:
            H, K = (4, 2) if args.smoke else MODELS[model]
            for B in batches:
                if time.perf_counter() - t_start > args.budget_s:
                    log(f"  budget used up: skipping {model} B={B} S={S}")
                    rows.append(dict(model=model, B=B, S=S, skipped=True))
                    continue
                t_row = time.perf_counter()
                nbytes = cache_bytes(B, S, K, D, dtype)
                R = num_rotations(nbytes, args.smoke, args.max_rotate)
                row = dict(model=model, H=H, K=K, D=D, B=B, S=S, M=M, us={}, raw_us={}, overhead_us={}, loop={},
                           errors={}, l2=l2_note(nbytes, R))
                try:
                    inputs = RowInputs(300, B, M, S, H, K, D, dtype, R)
                except Exception as exc:
                    log(f"  {model} B={B} S={S}: input allocation failed: {exc}")
                    row["errors"]["inputs"] = str(exc)[:1000]
                    rows.append(row)
                    continue
                _measure_row(ops, impls, row, inputs, timer)
                _ratios(row, nbytes, copy_bw)
                del inputs
                row["elapsed_s"] = time.perf_counter() - t_row
                rows.append(row)
                summary = "  ".join(f"{k} {v:.1f}" for k, v in row["us"].items())
                ovh = sorted({round(v, 2) for v in row["overhead_us"].values()})
                extra = ""
                if "cache_frac_copy_bw" in row:
                    extra = f"  cache half {100 * row['cache_frac_copy_bw']:.0f}% of copy BW"
                log(f"  {model} B={B} S={S} (K/V fits L2: {l2_cell(row['l2'])}): [us] {summary}{extra}; "
                    f"loop overhead {ovh} us/step subtracted; {row['elapsed_s']:.1f} s")
    return rows
