"""Per-iteration cost of an XLA while loop under command-buffer option variants (tiny body: launch-bound)."""
import json, sys, time
import jax, jax.numpy as jnp

VARIANTS = {
    "default": {},
    "cb_list": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"},
    "cb_plus": {"xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL"},
    "nocublas": {"xla_gpu_cublas_fallback": False},
}

def body_fn(x, w):
    for _ in range(6):
        x = jnp.tanh(x @ w) + 1.0
    return x

def fori(x, w, n):
    return jax.lax.fori_loop(0, n, lambda i, x: body_fn(x, w), x)

def whilel(x, w, n):  # data-dependent predicate, like generate's loop
    return jax.lax.while_loop(lambda s: s[1] < n, lambda s: (body_fn(s[0], w), s[1] + jnp.sum(s[0][:1, :1] * 0).astype(jnp.int32) + 1), (x, jnp.int32(0)))[0]

x = jnp.ones((64, 256), jnp.bfloat16); w = jnp.ones((256, 256), jnp.bfloat16) * 0.001
out = {}
for name, opts in VARIANTS.items():
    row = {}
    for lname, f in (("fori", fori), ("while", whilel)):
        try:
            c = jax.jit(f, static_argnums=2).lower(x, w, 2000).compile(opts)
            c(x, w).block_until_ready()
            t = time.perf_counter(); c(x, w).block_until_ready(); dt = time.perf_counter() - t
            row[lname] = round(dt / 2000 * 1e6, 2)
        except Exception as e:
            row[lname] = f"ERR {type(e).__name__}: {str(e)[:200]}"
    out[name] = row
    print(name, row, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
