"""What bounds the Mosaic GPU cache half inside a thread block: the kernel alone (no fold, no merge) at the
verification shapes, timed in-loop, with one part of its step removed at a time by patching the names the kernel
looks up while it is traced (results are wrong on purpose; only the time is read):

  default      all rows computed (valid_rows = the padded row count, as before the idle-warpgroup skip)
  skip         warpgroups whose rows are all padding compute nothing (valid_rows = M * G; the new default)
  no_exp       skip, and both exp2 of the online softmax replaced by the identity (no MUFU work)
  no_qk        skip, and the S = Q K^T wgmma not issued
  no_pv        skip, and the O += P V wgmma not issued
  free         skip, the two compute warpgroups not taking turns (MosaicConfig(pingpong=False))
  wgs3         skip, three compute warpgroups of 64 rows (no turns)

    python mosaic_probe.py OUT.json [REPS [VARIANT,...]]    # on the H200, from the repository root
"""
import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import pallas.mosaic_cache_attention as mca
from infer.bench.harness import time_loop
from pallas.folding import fold_group
from pallas.mosaic_cache_attention import default_mosaic_config

SHAPES = {  # name: B, M, H, K, D, capacity, length
    "padded-16k": (1, 69, 72, 18, 64, 16640, 16384),
    "padded-16k-b4": (4, 69, 72, 18, 64, 16640, 16384),
    "llama-32k": (1, 74, 32, 8, 128, 32768 + 128, 32768),
}


def patched(no_exp=False, no_qk=False, no_pv=False):
    jnp_proxy = types.SimpleNamespace(**{n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")})
    if no_exp:
        jnp_proxy.exp2 = lambda x: x
    real_wgmma = mca.plgpu.wgmma
    plgpu_proxy = types.SimpleNamespace(**{n: getattr(mca.plgpu, n) for n in dir(mca.plgpu) if not n.startswith("__")})

    def wgmma(acc, a, b, **kw):
        is_pv = isinstance(a, jax.core.Tracer)  # P V takes P from registers; Q K^T takes Q from shared memory
        if (is_pv and no_pv) or (not is_pv and no_qk):
            return None
        return real_wgmma(acc, a, b, **kw)

    plgpu_proxy.wgmma = wgmma
    return jnp_proxy, plgpu_proxy


def kernel_fn(cfg, scale, valid_rows, **parts):
    jnp_p, plgpu_p = patched(**parts)

    def run(q, k, v, n):
        saved = mca.jnp, mca.plgpu
        mca.jnp, mca.plgpu = jnp_p, plgpu_p
        try:
            return mca._lower(n, q, k, v, cfg=cfg, scale=scale, valid_rows=valid_rows, interpret=False)
        finally:
            mca.jnp, mca.plgpu = saved
    return run


def main():
    out, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    rng = np.random.default_rng(0)
    results = {}
    for name, (B, M, H, K, D, S, L) in SHAPES.items():
        G = H // K
        base = default_mosaic_config(B, K, M * G, S, D)
        q_heads = jnp.asarray(rng.standard_normal((B, M, H, D)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((B, S, K, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((B, S, K, D)), jnp.bfloat16)
        n = jnp.full((B,), L, jnp.int32)
        flops = 4 * B * M * H * L * D
        variants = {"default": (None, base, {}), "skip": (M * G, base, {}),
                    "no_exp": (M * G, base, dict(no_exp=True)), "no_qk": (M * G, base, dict(no_qk=True)),
                    "no_pv": (M * G, base, dict(no_pv=True)),
                    "free": (M * G, dataclasses.replace(base, pingpong=False), {}),
                    "wgs3": (M * G, dataclasses.replace(base, compute_wgs=3), {})}
        ref = None
        for vname, (valid, cfg, parts) in variants.items():
            if chosen and vname not in chosen:
                continue
            q = fold_group(q_heads, K, row_multiple=cfg.rows_per_block())
            R = q.shape[1]
            valid = R if valid is None else valid
            run = kernel_fn(cfg, D ** -0.5, valid, **parts)

            def step(x, k, v, n, run=run):
                o, lse = run(x, k, v, n)
                return x + (o[0, 0, 0, 0, 0].astype(jnp.float32) * 1e-30).astype(x.dtype)

            try:
                o, lse = jax.jit(run)(q, k, v, n)
                rows = slice(0, M * G)
                if ref is None:
                    ref = o[:, :, rows]
                diff = float(jnp.max(jnp.abs(o[:, :, rows].astype(jnp.float32) - ref.astype(jnp.float32))))
                t, _ = time_loop(step, jnp.copy(q), (k, v, n), reps=reps, calls=5)
                us = t.per_step_s * 1e6
                results[f"{name}/{vname}"] = dict(us=us, tflops=flops / us / 1e6, max_diff_vs_default=diff,
                                                  config=str(cfg), rows=R, valid_rows=valid)
                print(f"{name:14s} {vname:8s} {us:8.2f} us  {flops / us / 1e6:6.1f} TFLOP/s  "
                      f"|o - default| {diff:.3g}  {cfg}", flush=True)
            except Exception as exc:  # report and go on: a probe variant may not lower
                results[f"{name}/{vname}"] = dict(error=str(exc)[:500])
                print(name, vname, "FAILED", str(exc)[:300], flush=True)
        json.dump(results, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
