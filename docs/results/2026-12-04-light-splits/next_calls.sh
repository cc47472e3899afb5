# Left for the next session (docs/benchmarks.md 7s, closing note of the twenty-seventh session): does cutting the
# last, partly padded row block into fewer, longer splits pack the waves better? 72 queries x group 4 = 288 rows fill
# 384 rows of thread blocks: Llama-3-8B shapes 3 row blocks of two warpgroups (the third: 32 rows computing, one
# warpgroup idle), the padded pair 2 of three (the second: 96 rows). Untimed: MosaicConfig(light_splits=N) on branch
# exp/light-splits, `light_splits.diff` here (against main at the commit that added this folder). Interpreter,
# lowering and config tests pass on the CPU; its GPU cases (padded-light, llama-light) have not run. Before the calls:
#   rm -rf .gpu/light && mkdir -p .gpu/light && git archive HEAD pallas longspec_jax infer train tests | tar -x -C .gpu/light
#   git apply --directory=.gpu/light docs/results/2026-12-04-light-splits/light_splits.diff   # from the repo root
# (`git apply` inside .gpu/light would skip every path: it lies inside this repository.) ~4 min; carry [".gpu"].
# Call A: the kernel alone, default and its light variants (num_splits // 3, // 2, 2 * // 3), twice; then the GPU cases.
source .gpu/setup.sh
att() {  # $1 name
  (cd .gpu/light && PYTHONPATH=$PWD timeout 150 python -m infer.bench attention --sections copy,mosaic \
    --mosaic-shapes padded-8b:64:16384:1,padded-8b:64:32768:1,llama3-8b:128:32768:1 --new-tokens 72 \
    --mosaic-variants light --out $OUT/$1) > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_attention.md; grep -E " us \(|rror" $OUT/$1_log.txt | cut -c1-200; left "attention $1"
}
att light1; att light2
(cd .gpu/light && PYTHONPATH=$PWD timeout 200 python -m pytest -q -m gpu -p no:cacheprovider \
  "tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference[padded-light]" \
  "tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference[llama-light]") \
  > $OUT/light_tests.txt 2>&1; tail -2 $OUT/light_tests.txt; left "light tests"
# Call B, if a light variant is >= 3% faster alone: in the round (one process, A B; N = the best light_splits):
#   timeout 250 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
#     --contexts 16384 --reps 5 --phases verify,round --attention auto --mosaic '{"light": {"light_splits": N}}' \
#     --out $OUT/prof_light   (run in .gpu/light with PYTHONPATH=$PWD)
