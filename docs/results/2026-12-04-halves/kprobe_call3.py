"""Kernel-only probe of the Mosaic cache half: two halves a key block against the default schedules."""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp
from pallas.mosaic_cache_attention import mosaic_cache_partials, MosaicConfig, default_mosaic_config

B, NSETS = 1, 4
key = jax.random.PRNGKey(0)
results = []
_kv = {}


def kv_sets(K, D, S):
    if (K, D, S) not in _kv:
        _kv.clear()
        ks = [jax.random.normal(jax.random.fold_in(key, i), (B, S, K, D), jnp.bfloat16) for i in range(2 * NSETS)]
        _kv[(K, D, S)] = [(ks[2 * i], ks[2 * i + 1]) for i in range(NSETS)]
    return _kv[(K, D, S)]


def timed(name, cfg, R, valid, K=18, D=64, S=16384):
    kv = kv_sets(K, D, S)
    lengths = jnp.full((B,), S, jnp.int32)
    q = jax.random.normal(key, (B, R, K, D), jnp.bfloat16)
    f = jax.jit(lambda q, kv: [mosaic_cache_partials(q, k, v, lengths, cfg=cfg, scale=D ** -0.5, valid_rows=valid)
                               for k, v in kv])
    try:
        jax.block_until_ready(f(q, kv))
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
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
    results.append(dict(name=name, cfg=dataclasses.asdict(cfg), R=R, valid=valid, K=K, D=D, S=S, us=us))
    print(f"{name:34s} R={R} valid={valid} K={K} D={D} S={S} {cfg}: {us:.1f} us", flush=True)


def main(which):
    rp = dataclasses.replace
    d = default_mosaic_config(1, 18, 276, 16384, 64)
    timed("276 rows 16k default", d, 384, 276)
    timed("276 rows 16k halves", rp(d, halves=True), 384, 276)
    timed("276 rows 16k default again", d, 384, 276)
    timed("276 rows 16k halves again", rp(d, halves=True), 384, 276)
    for n in (7, 11, 14):
        timed(f"276 rows 2 wgs {n} splits halves", rp(d, compute_wgs=2, num_splits=n, halves=True), 384, 276)
    d32 = default_mosaic_config(1, 18, 276, 32768, 64)
    timed("276 rows 32k default", d32, 384, 276, S=32768)
    timed("276 rows 32k halves", rp(d32, halves=True), 384, 276, S=32768)
    d = default_mosaic_config(1, 18, 256, 16384, 64)
    timed("256 rows default", d, 384, 256)
    timed("256 rows halves", rp(d, halves=True), 384, 256)
    timed("256 rows 2 wgs 11 splits pingpong", rp(d, compute_wgs=2), 256, 256)
    timed("256 rows 2 wgs 11 splits halves", rp(d, compute_wgs=2, halves=True), 256, 256)
    d = default_mosaic_config(1, 18, 108, 16384, 64)
    timed("108 rows default (2 wgs)", d, 128, 108)
    timed("108 rows halves", rp(d, halves=True), 128, 108)
    d = default_mosaic_config(1, 18, 64, 16384, 64)
    timed("draft cross 64 rows default", d, 64, 64)
    timed("draft cross 64 rows halves", rp(d, halves=True), 64, 64)
    l32 = default_mosaic_config(1, 8, 296, 32768, 128)
    timed("llama 32k default", l32, 384, 296, K=8, D=128, S=32768)
    timed("llama 32k halves", rp(l32, halves=True), 384, 296, K=8, D=128, S=32768)


main(sys.argv[2:])
json.dump(results, open(sys.argv[1], "w"), indent=1)
