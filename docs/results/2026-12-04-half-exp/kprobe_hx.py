"""Kernel-only probe of the Mosaic cache half: float32 exp2 (default) against packed 16-bit exp2 (half_exp)."""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas.mosaic_cache_attention import mosaic_cache_partials, default_mosaic_config
from pallas.folding import fold_group
from pallas.reference import cache_attention_reference, merge_partials

NSETS = 4
key = jax.random.PRNGKey(0)
results = []
_kv = {}


def kv_sets(B, K, D, S):
    if (B, K, D, S) not in _kv:
        _kv.clear()
        ks = [jax.random.normal(jax.random.fold_in(key, i), (B, S, K, D), jnp.bfloat16) for i in range(2 * NSETS)]
        _kv[(B, K, D, S)] = [(ks[2 * i], ks[2 * i + 1]) for i in range(NSETS)]
    return _kv[(B, K, D, S)]


def timed(name, cfg, R, valid, K=18, D=64, S=16384, B=1):
    kv = kv_sets(B, K, D, S)
    lengths = jnp.full((B,), S, jnp.int32)
    q = jax.random.normal(key, (B, R, K, D), jnp.bfloat16)
    f = jax.jit(lambda q, kv: [mosaic_cache_partials(q, k, v, lengths, cfg=cfg, scale=D ** -0.5, valid_rows=valid)
                               for k, v in kv])
    try:
        jax.block_until_ready(f(q, kv))
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
        results.append(dict(name=name, error=str(e)[:2000]))
        return
    best = []
    for rep in range(3):
        t = time.perf_counter()
        for _ in range(25):
            out = f(q, kv)
        jax.block_until_ready(out)
        best.append((time.perf_counter() - t) / (25 * NSETS) * 1e6)
    us = min(best)
    results.append(dict(name=name, cfg=dataclasses.asdict(cfg), R=R, valid=valid, K=K, D=D, S=S, B=B, us=us))
    print(f"{name:36s} R={R} valid={valid} K={K} D={D} S={S} B={B} {cfg}: {us:.1f} us", flush=True)


def error(name, cfg, M=69, H=72, K=18, D=64, S=16384):
    """Relative error of the merged output and max LSE error against a float32 reference."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)
               for s in ((1, M, H, D), (1, S, K, D), (1, S, K, D)))
    lens = jnp.full((1,), S - 5, jnp.int32)
    rows = fold_group(q, K, row_multiple=cfg.rows_per_block())
    R = M * (H // K)
    o, lse = mosaic_cache_partials(rows, k, v, lens, cfg=cfg, scale=D ** -0.5 * 4, valid_rows=R)  # peaky scores
    o, lse = merge_partials(o[:, :, :R], jnp.swapaxes(lse, 2, 3)[:, :, :R])
    with jax.default_matmul_precision("highest"):
        ro, rl = cache_attention_reference(fold_group(q, K).astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), lens, D ** -0.5 * 4)
    o, ro, lse, rl = (np.asarray(x, np.float32) for x in (o, ro, lse, rl))
    e = dict(name=name, rel_err=float(np.linalg.norm(o - ro) / np.linalg.norm(ro)),
             max_abs=float(np.abs(o - ro).max()), lse_max_err=float(np.abs(lse - rl).max()))
    results.append(e)
    print(e, flush=True)


def main():
    rp = dataclasses.replace
    d = default_mosaic_config(1, 18, 276, 16384, 64)
    for name, c in (("err default", d), ("err half_exp", rp(d, half_exp=True))):
        try:
            error(name, c)
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    for tag in ("", " again"):
        timed("276 rows 16k default" + tag, d, 384, 276)
        timed("276 rows 16k half_exp" + tag, rp(d, half_exp=True), 384, 276)
    d32 = default_mosaic_config(1, 18, 276, 32768, 64)
    timed("276 rows 32k default", d32, 384, 276, S=32768)
    timed("276 rows 32k half_exp", rp(d32, half_exp=True), 384, 276, S=32768)
    dc = default_mosaic_config(1, 18, 64, 16384, 64)
    timed("draft cross 64 rows default", dc, 64, 64)
    timed("draft cross 64 rows half_exp", rp(dc, half_exp=True), 64, 64)
    d4 = default_mosaic_config(4, 18, 276, 16384, 64)
    timed("B4 276 rows 16k default", d4, 384, 276, B=4)
    timed("B4 276 rows 16k half_exp", rp(d4, half_exp=True), 384, 276, B=4)
    d = default_mosaic_config(1, 18, 108, 16384, 64)
    timed("108 rows default", d, 128, 108)
    timed("108 rows half_exp", rp(d, half_exp=True), 128, 108)
    dp = default_mosaic_config(1, 18, 2048, 16384, 64)
    timed("prefill 2048 rows default", dp, 2112, 2048)
    timed("prefill 2048 rows half_exp", rp(dp, half_exp=True), 2112, 2048)
    l32 = default_mosaic_config(1, 8, 296, 32768, 128)
    timed("llama 32k default", l32, 384, 296, K=8, D=128, S=32768)
    timed("llama 32k half_exp", rp(l32, half_exp=True), 384, 296, K=8, D=128, S=32768)


main()
json.dump(results, open(sys.argv[1], "w"), indent=1)
