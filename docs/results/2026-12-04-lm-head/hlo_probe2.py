"""The single-row LM head under the cuBLAS (reproducible) compile: is the kernel still converted to f32? (H200)"""
import re, time
import jax, jax.numpy as jnp
from longspec_jax.target import lm_head_logits

REPRO = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
d, V = 4608, 16384
params = {"lm_head": jax.random.normal(jax.random.key(0), (d, V), jnp.bfloat16), "embed": jnp.zeros((8, d), jnp.bfloat16)}
h = jax.random.normal(jax.random.key(1), (1, 1, d), jnp.bfloat16)
old = lambda p, h: jnp.dot(h, p["lm_head"], preferred_element_type=jnp.float32)
for name, fn in (("one row", old), ("lm_head_logits", lm_head_logits)):
    for mode, opts in (("autotuned", {}), ("repro", REPRO)):
        loop = lambda p, h: jax.lax.fori_loop(0, 200, lambda i, c: c + fn(p, h + c[..., :d].astype(h.dtype) * 0)[..., :1].sum(), jnp.zeros((1, 1, V), jnp.float32))
        c = jax.jit(loop).lower(params, h).compile(compiler_options=opts)
        txt = c.as_text()
        conv = [l.strip()[:120] for l in txt.splitlines() if re.search(rf"f32\[{d},{V}\].*convert\(", l)]
        c(params, h).block_until_ready()
        t0 = time.perf_counter(); c(params, h).block_until_ready(); us = (time.perf_counter() - t0) / 200 * 1e6
        print(f"{name:15s} {mode:9s} {us:7.1f} us/step  kernel converted to f32: {bool(conv)}")
a = jax.jit(old, ).lower(params, h).compile(compiler_options=REPRO)(params, h)
b = jax.jit(lm_head_logits).lower(params, h).compile(compiler_options=REPRO)(params, h)
print("max |diff| one row vs two rows:", float(jnp.abs(a - b).max()), "argmax equal:", bool(a.argmax() == b.argmax()))
