"""Run from a checkout of 9545c08 (tree_attention_merged): tree half + merge at the padded pair's verify shapes (16k, 11 cuDNN splits): the old path (tree kernel on
unfolded q, XLA merge of splits + tree) vs tree_attention_merged at several tiles; in-loop us per call."""
import sys, json, functools
import jax, jax.numpy as jnp, numpy as np
from infer.bench.harness import time_loop
from pallas.tree_attention import tree_attention, tree_attention_merged
from pallas.reference import merge_partials
from pallas.folding import fold_group

B, M, H, K, D, N, P = 1, 69, 72, 18, 64, 69, int(sys.argv[1]) if len(sys.argv) > 1 else 11
G, R = H // K, 69 * 4
rng = np.random.default_rng(0)
bf = jnp.bfloat16
q = jnp.asarray(rng.standard_normal((B, M, H, D)), bf)
kn = jnp.asarray(rng.standard_normal((B, N, K, D)), bf)
vn = jnp.asarray(rng.standard_normal((B, N, K, D)), bf)
mask = jnp.asarray(np.tril(np.ones((M, N), bool)) & (rng.random((M, N)) < 0.3) | np.eye(M, N, dtype=bool))[None]
o_parts = jnp.asarray(rng.standard_normal((P, B, R, K, D)), bf)
lse_parts = jnp.asarray(rng.standard_normal((P, B, K, R)), jnp.float32)

def unfold(o_BxTxKxD, lse_BxKxT):
    o = o_BxTxKxD.reshape(B, M, G, K, D).swapaxes(2, 3).reshape(B, M, H, D)
    lse = lse_BxKxT.reshape(B, K, M, G).transpose(0, 2, 1, 3).reshape(B, M, H)
    return o.astype(bf), lse

def old(q):
    o_t, lse_t = tree_attention(q, kn, vn, mask)
    o_e, lse_e = fold_group(o_t, K), fold_group(lse_t[..., None], K)[..., 0]
    o_all = jnp.concatenate([o_parts, o_e[None]])
    lse_all = jnp.concatenate([jnp.swapaxes(lse_parts, 2, 3), lse_e[None]])
    o, lse = merge_partials(o_all, lse_all)
    return unfold(o, jnp.swapaxes(lse, 1, 2))

def new(q, bm, nw):
    o, lse = tree_attention_merged(fold_group(q, K), kn, vn, jnp.repeat(mask, G, axis=1), o_parts, lse_parts,
                                   rows=R, block_m=bm, num_warps=nw)
    return unfold(o, lse)

def step_of(f):
    def step(x):
        o, _ = f(x)
        return x + (o[0, 0, 0, 0].astype(jnp.float32) * 1e-30).astype(x.dtype)
    return step

def empty(x):
    return x + (x[0, 0, 0, 0].astype(jnp.float32) * 1e-30).astype(x.dtype)

ref = old(q)
res = {}
t, _ = time_loop(empty, jnp.copy(q), (), reps=int(__import__("os").environ.get("PROBE_REPS", 2000)), calls=5)
base = t.per_step_s * 1e6
res["empty"] = base
cands = [("old", old)] + [(f"merged bm{bm} w{nw}", functools.partial(new, bm=bm, nw=nw))
                          for bm, nw in [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8), (128, 4)]]
for name, f in cands:
    try:
        o, lse = f(q)
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref[0].astype(jnp.float32))))
        t, _ = time_loop(step_of(f), jnp.copy(q), (), reps=int(__import__("os").environ.get("PROBE_REPS", 1000)), calls=5)
        us = t.per_step_s * 1e6 - base
        res[name] = dict(us=us, err=err)
        print(f"P={P} {name:>18}: {us:7.2f} us  (raw {t.per_step_s*1e6:.2f}, empty {base:.2f})  |diff vs old| {err:.3g}", flush=True)
    except Exception as e:
        print(name, "FAILED", str(e)[:300], flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
