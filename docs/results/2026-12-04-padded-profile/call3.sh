# 2026-12-04 session 26, call 3: the Mosaic cache half reading the queries as they are (8-query TMA boxes, no fold
# or unfold copies). GPU kernel and end-to-end tests, then end to end at 16k in generate()'s default compile:
# new, old (HEAD before the change, from .gpu/old), new again, one process each on one machine.
source .gpu/setup.sh
timeout 170 python -m pytest -q -m gpu tests/test_mosaic_cache.py -p no:cacheprovider \
  -k "padded-default or llama-default or gqa7 or mha-empty or 27nodes or padded-cross" 2>&1 | tail -4; left "kernel tests"
timeout 150 python -m pytest -q -m gpu tests/test_gpu_e2e.py -p no:cacheprovider \
  -k "test_bf16_speculative_matches_greedy and auto and not 32k" 2>&1 | tail -4; left "e2e tests"
spec() {  # $1 name, $2 PYTHONPATH
  PYTHONPATH=$2 timeout 140 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
    --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --reps 2 --compile reproducible --out $OUT/$1 \
    > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_spec.md; grep -E "tok/s|rror" $OUT/$1_log.txt | grep -v -i warn | tail -5; left "spec $1"
}
spec new $PWD; spec old $PWD/.gpu/old; spec new2 $PWD
