# shared_light: GPU correctness (new cases + regressions of the refactored kernel), then the kernel alone at
# Llama-3-8B's verify shapes (72 queries), twice.
source .gpu/setup.sh
cd .gpu/shared && export PYTHONPATH=$PWD
att() {
  timeout $2 python -m infer.bench attention --sections copy,mosaic --mosaic-shapes llama3-8b:128:32768:1,llama3-8b:128:16384:1,padded-8b:64:16384:1 \
    --new-tokens 72 --mosaic-variants light,shared --out $OUT/$1 > $OUT/$1_log.txt 2>&1
  grep -E " us \(|rror" $OUT/$1_log.txt | sed -E 's/MosaicConfig\(num_splits=([0-9]+), block_kv=([0-9]+), stages=([0-9]+), compute_wgs=([0-9]+).*light_splits=([A-Za-z0-9]+), shared_light=([A-Za-z]+)\)/s=\1 st=\3 wg=\4 l=\5 sh=\6/' | cut -c12-150; left "attention $1"
}
att att1 170
T=tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider "$T[llama-shared]" "$T[llama-shared-stages3]" "$T[padded-wg2-shared]" \
  "$T[llama-default]" "$T[llama-light]" "$T[padded-default]" "$T[padded-one-wave]" "$T[padded-cross]" "$T[padded-free]" \
  tests/test_mosaic_cache.py::test_default_configs_compile_without_register_spills > $OUT/kernel_tests.txt 2>&1
tail -5 $OUT/kernel_tests.txt; left "kernel tests"
att att2 $(( 575 - $(date +%s) + T0 ))
