# Correctness on the GPU with the one-wave rule, then the kernel alone at Llama-3-8B 16k and Qwen2-7B 16k.
source .gpu/setup.sh
T=tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider "$T[padded-default]" "$T[llama-default]" "$T[padded-light]" \
  "$T[llama-light]" "$T[padded-one-wave]" "$T[padded-cross]" tests/test_mosaic_cache.py::test_default_configs_compile_without_register_spills \
  > $OUT/kernel_tests.txt 2>&1; tail -3 $OUT/kernel_tests.txt; left "kernel tests"
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider "tests/test_gpu_e2e.py::test_bf16_speculative_matches_greedy[auto]" \
  "tests/test_gpu_e2e.py::test_bf16_speculative_matches_greedy_at_32k[auto]" > $OUT/e2e_tests.txt 2>&1; tail -3 $OUT/e2e_tests.txt; left "e2e tests"
timeout 100 python -m infer.bench attention --sections copy,mosaic --mosaic-shapes llama3-8b:128:16384:1,qwen2-7b:128:16384:1 \
  --new-tokens 72 --mosaic-variants light --out $OUT/att > $OUT/att_log.txt 2>&1
grep -E " us \(|rror" $OUT/att_log.txt | sed -E 's/MosaicConfig\(num_splits=([0-9]+).*light_splits=([A-Za-z0-9]+)\)/s=\1 l=\2/' | cut -c12-140; left "attention"
