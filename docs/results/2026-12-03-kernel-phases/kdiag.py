"""On-device profile (Mosaic GPU profiler, the kernel's named scopes) of one cache-half variant at the padded verify
shape; summarises time per scope per warpgroup kind. argv: variant out_dir"""
import collections, dataclasses, functools, glob, gzip, json, os, sys
import jax, jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas.mosaic_cache_attention import mosaic_cache_partials, default_mosaic_config

variant, out = sys.argv[1], sys.argv[2]
os.makedirs(out + "/trace", exist_ok=True)
plgpu.CompilerParams = functools.partial(plgpu.CompilerParams, profile_space=400, profile_dir=out + "/trace")
K, D, S, R, valid = 18, 64, 16384, 384, 276
cfg = default_mosaic_config(1, K, valid, S, D)
if variant == "ring":
    cfg = dataclasses.replace(cfg, ring=True)
key = jax.random.PRNGKey(0)
k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, S, K, D), jnp.bfloat16) for i in (1, 2))
q = jax.random.normal(key, (1, R, K, D), jnp.bfloat16)
lengths = jnp.full((1,), S, jnp.int32)
f = jax.jit(lambda q, k, v: mosaic_cache_partials(q, k, v, lengths, cfg=cfg, scale=0.125, valid_rows=valid))
for _ in range(2):
    jax.block_until_ready(f(q, k, v))
jax.effects_barrier()
path = sorted(glob.glob(out + "/trace/*-trace.json"))[-1]
events = json.load(open(path))["traceEvents"]
C = cfg.compute_wgs
per_tid = collections.defaultdict(list)
for e in events:
    per_tid[e["tid"]].append(e)
totals = collections.defaultdict(lambda: collections.defaultdict(float))
spans = collections.defaultdict(list)
for tid, evs in per_tid.items():
    wg = (tid - 1) % (C + 1)
    kind = "memory" if wg == C else f"wg{wg}"
    stack = []
    for e in evs:
        if e["ph"] == "B":
            stack.append((e["name"], e["ts"]))
        else:
            name, t0 = stack.pop()
            if not stack:  # top-level scopes only: their time partitions the warpgroup's
                totals[kind][name] += e["ts"] - t0
    spans[kind].append(evs[-1]["ts"] - evs[0]["ts"])
sm_span = collections.defaultdict(lambda: [1e30, -1e30])
for e in events:
    s = sm_span[e["pid"]]
    s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"])
summary = dict(variant=variant, cfg=dataclasses.asdict(cfg), events=len(events),
               kernel_span_us=max(v[1] for v in sm_span.values()) - min(v[0] for v in sm_span.values()),
               per_kind={k: dict(traces=len(spans[k]), mean_span_us=sum(spans[k]) / len(spans[k]),
                                 mean_us={n: t / len(spans[k]) for n, t in sorted(v.items())})
                         for k, v in totals.items()})
json.dump(summary, open(f"{out}/summary_{variant}.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
with open(path, "rb") as src, gzip.open(f"{out}/trace_{variant}.json.gz", "wb") as dst:
    dst.write(src.read())
os.remove(path)
