"""Format probe: what XLA's autotune logs and results files hold for two small GEMM fusions."""
import os, glob, jax, jax.numpy as jnp
k = jax.random.PRNGKey(0)
w1 = jax.random.normal(k, (4608, 6912), jnp.bfloat16)
w2 = jax.random.normal(k, (4608, 4608), jnp.bfloat16)
f = jax.jit(lambda x, y: ((jnp.dot(x, w1)[:, :4608] + 1).astype(jnp.bfloat16) @ w2, jnp.dot(y, w2)))
x = jax.random.normal(k, (69, 4608), jnp.bfloat16)
y = jax.random.normal(k, (16, 4608), jnp.bfloat16)
print([a.shape for a in jax.block_until_ready(f(x, y))])
out = os.environ["OUT"]
for name in ("logs.textproto", "results.textproto"):
    p = os.path.join(out, name)
    t = open(p).read() if os.path.exists(p) else "(missing)"
    print(f"===== {name}: {len(t)} chars\n{t[:3000]}")
for p in sorted(glob.glob(os.path.join(out, "hlo", "*lambda*after_optimizations.txt")))[:1]:
    t = open(p).read()
    import re
    print("===== HLO fusions with backend configs:")
    for line in t.splitlines():
        if "fusion(" in line and ("__triton" in line or "cublas" in line or "custom_call_target" in line or "gemm" in line):
            print(line[:600])
for p in sorted(glob.glob(os.path.join(out, "hlo", "*lambda*autotune_results.pbtxt")))[:1]:
    print("=====", p, "\n", open(p).read()[:2500])
