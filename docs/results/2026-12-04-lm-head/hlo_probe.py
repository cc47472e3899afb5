"""Which ops XLA emits for the f32-output LM-head dot under each compile mode (H200)."""
import re, sys
import jax, jax.numpy as jnp

MODES = {
    "autotuned": {},
    "repro": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False},
    "repro_lt": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True},
}
d, V = 4608, 16384
W = jnp.zeros((d, V), jnp.bfloat16)
for rows in (1, 16, 69):
    h = jnp.zeros((1, rows, d), jnp.bfloat16)
    for name, opts in MODES.items():
        f = jax.jit(lambda h, W: jnp.dot(h, W, preferred_element_type=jnp.float32))
        txt = f.lower(h, W).compile(compiler_options=opts).as_text()
        ops = [l.strip() for l in txt.splitlines()
               if re.search(r"convert|custom_call_target|__triton|fusion\(", l) and "ENTRY" not in l]
        print(f"== rows {rows} {name}")
        for l in ops[:8]:
            print("   ", l[:220])
sys.stdout.flush()
