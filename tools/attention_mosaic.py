"""The attention benchmark's ``mosaic`` section: launch shapes of the Mosaic GPU cache half
(:mod:`pallas.mosaic_cache_attention`) against the cuDNN cache half and the roofline, per model, cache length and
batch (74 queries, B=1 and 4).

Each shape times the default :class:`MosaicConfig` first, then one change at a time (accumulation, compute
warpgroups, key tile, pipeline stages, splits), each as the whole cache half the verification pass pays
(fold, kernel, merge of the splits). Roofline = the larger of the attention FLOPs at 790 TFLOP/s and the K+V
bytes at the copy bandwidth.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp

from tools.attention_loop import EMPTY_EST_S, OpTimer, identity_op, per_op
from tools.attention_ops import CACHE_USES, MODELS, RowInputs, cache_bytes, chunk_attention_fn
from tools.floors import PEAK_FLOPS
from infer.bench.harness import error_text, log, md_header, md_row, record_failure


def parse_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """``model:head_dim:length:batch,...`` -> [(model, D, S, B)]."""
    shapes = []
    for item in text.split(","):
        model, d, s, b = item.split(":")
        if model not in MODELS:
            raise ValueError(f"--mosaic-shapes: unknown model {model!r}; choose from {', '.join(MODELS)}")
        shapes.append((model, int(d), int(s), int(b)))
    return shapes


VARIANT_KINDS = ("accumulate", "wgs", "schedule", "stages", "block", "splits", "light")


def variants(base, capacity: int, kinds=VARIANT_KINDS, before_one_wave=None) -> list:
    """The default config, then one-step changes of it, of the ``kinds`` asked for (:data:`VARIANT_KINDS`).
    before_one_wave: the default without its one-wave rule (``default_mosaic_config(..., one_wave=False)``), which the
    ``light`` kind times beside it."""
    from pallas.mosaic_cache_attention import MosaicConfig
    key_blocks = capacity // base.block_kv
    out = [base]
    if "accumulate" in kinds:
        out.append(dataclasses.replace(base, accumulate="fresh"))
    if "wgs" in kinds:
        out += [dataclasses.replace(base, compute_wgs=c) for c in (1, 2, 3) if c != base.compute_wgs]
    if "schedule" in kinds and base.compute_wgs == 2:
        out.append(dataclasses.replace(base, pingpong=not base.pingpong))
    if "stages" in kinds:
        out += [dataclasses.replace(base, stages=st) for st in (2, 4) if st != base.stages]
    if "block" in kinds and base.block_kv != 64:
        out.append(dataclasses.replace(base, block_kv=64, stages=4))
    if "light" in kinds and base.light_splits is not None:  # the one-wave rule's light row block, and the rule
        out.append(dataclasses.replace(base, light_splits=None))  # before it
        if before_one_wave is not None:
            out.append(before_one_wave)
    if "splits" in kinds:  # splits need not divide the key blocks (chunks are cut at run time); the neighbours
        n = base.num_splits  # show wave quantization (thread blocks per split x splits against the SMs)
        counts = {n - 2, n - 1, n + 1, n + 2, n * 2 // 3, n * 3 // 2, n * 2}
        out += [dataclasses.replace(base, num_splits=ns, light_splits=base.light_splits and min(base.light_splits, ns))
                for ns in sorted(counts) if ns != n and 1 <= ns <= key_blocks]
    return [c for c in out if isinstance(c, MosaicConfig)]


def roofline_s(B, M, S, H, K, D, copy_bw) -> float:
    flops = 4 * B * M * H * S * D
    return max(flops / PEAK_FLOPS, cache_bytes(B, S, K, D, jnp.bfloat16) / (copy_bw or 4.03e12))


def run_sweep_mosaic(args, copy_bw, t_start, timer: OpTimer) -> list:
    from longspec_jax.cudnn_cache import cudnn_cache_attention
    from pallas.mosaic_cache_attention import default_mosaic_config, mosaic_cache_attention

    chunk_fn = chunk_attention_fn()
    M = args.new_tokens
    results = []
    section_start = time.perf_counter()
    for model, D, S, B in parse_shapes(args.mosaic_shapes):
        H, K = MODELS[model]
        try:
            inputs = RowInputs.rotated(500, B, M, S, H, K, D, jnp.bfloat16, args)
            empty = timer.time("empty", identity_op(CACHE_USES), CACHE_USES, inputs.small, inputs.kv(),
                               est_s=EMPTY_EST_S)
        except Exception as exc:
            log(f"  {model} D={D} S={S} B={B}: inputs FAILED {error_text(exc)}")
            continue
        roof = roofline_s(B, M, S, H, K, D, copy_bw)
        base = default_mosaic_config(B, K, M * (H // K), S, D)
        ops = [("cudnn", None, lambda i: cudnn_cache_attention(i["q"], i["k_cache"], i["v_cache"], i["lengths"],
                                                               chunk_attention=chunk_fn))]
        ops += [("mosaic", cfg, (lambda i, _c=cfg: mosaic_cache_attention(i["q"], i["k_cache"], i["v_cache"],
                                                                          i["lengths"], config=_c)))
                for cfg in variants(base, S, args.mosaic_variants,
                                    default_mosaic_config(B, K, M * (H // K), S, D, one_wave=False))]
        for name, cfg, op in ops:
            now = time.perf_counter()
            if now - section_start > args.mosaic_budget_s or now - t_start > args.budget_s:
                log("  mosaic budget used up; skipping the rest")
                return results
            rec = dict(model=model, D=D, S=S, B=B, M=M, impl=name, roofline_us=roof * 1e6,
                       config=dataclasses.asdict(cfg) if cfg else None, default=cfg == base)
            try:
                r = per_op(timer.time(f"mosaic_{name}", op, CACHE_USES, inputs.small, inputs.kv(),
                                      est_s=inputs.estimate_s("cache")), empty)
                rec.update(us=r["us"], raw_us=r["raw_us"], frac_roofline=roof * 1e6 / r["us"] if r["us"] > 0 else None)
                log(f"  {model} D={D} S={S} B={B} {name} {cfg or ''}: {r['us']:.1f} us "
                    f"({100 * rec['frac_roofline']:.0f}% of the {roof * 1e6:.1f} us roofline)")
            except Exception as exc:
                record_failure(rec, f"{model} D={D} S={S} B={B} {name} {cfg or ''}", exc)
            results.append(rec)
        del inputs
    return results


def mosaic_markdown(rows: list) -> list[str]:
    lines = ["## Mosaic GPU cache half: launch shapes against cuDNN and the roofline (74 queries, us per call)", ""]
    lines += md_header(["model", "D", "S", "B", "impl", "splits", "light splits", "block_kv", "stages",
                        "compute wgs", "ping-pong", "accumulate", "us", "% of roofline", "roofline us"])
    for r in rows:
        c = r.get("config") or {}
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80].replace("|", "/")
        frac = f"{100 * r['frac_roofline']:.0f}%" if r.get("frac_roofline") else "-"
        label = r["impl"] + (" (default)" if r.get("default") else "")
        lines.append(md_row([r["model"], r["D"], r["S"], r["B"], label, c.get("num_splits", "-"),
                             c.get("light_splits") or "-", c.get("block_kv", "-"), c.get("stages", "-"),
                             c.get("compute_wgs", "-"), c.get("pingpong", "-"), c.get("accumulate", "-"), us, frac,
                             f"{r['roofline_us']:.1f}"]))
    return lines + [""]
