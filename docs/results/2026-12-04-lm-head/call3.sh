source .gpu/setup.sh
export LONGSPEC_FIXTURE_DRAFT=$PWD/.gpu/fx/code-lm-draft-ref
left start
timeout 330 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --phase-contexts 16384 --e2e-contexts 16384 --commit-repeats 1 --reps 2 --out $OUT/spec16 2>&1 | grep -v -i warn | grep -E "ms|tok|x |rror|Trace" | tail -40
left spec done
timeout 40 python -c "
import re, jax, jax.numpy as jnp
from infer.generate import REPRODUCIBLE_OPTIONS as R
d, V = 512, 4096; W = jnp.zeros((d, V), jnp.bfloat16)
t = jax.jit(lambda h, W: jnp.dot(h, W, preferred_element_type=jnp.float32)).lower(jnp.zeros((1, 1, d), jnp.bfloat16), W).compile(compiler_options=R).as_text()
print('old one-row formula converts the kernel at the test shape:', bool(re.search(rf'f32\[{d},{V}\]\S* convert\(', t)))
" 2>&1 | grep -v -i warn | tail -2
timeout 200 python -m pytest -q -m gpu tests/test_gpu_repro.py 2>&1 | tail -3
left repro done
timeout 150 python -m pytest -q -m gpu tests/test_gpu_e2e.py -k "test_bf16_speculative_matches_greedy and auto and not 32k" 2>&1 | tail -3
left end
