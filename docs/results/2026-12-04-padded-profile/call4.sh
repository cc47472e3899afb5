# 2026-12-04 session 26, call 4: verify and round profiled with the new Mosaic query loading and with the old
# (HEAD before the change, .gpu/old), one process each; then the kernel's GPU cases at groups 7 and 1.
source .gpu/setup.sh
prof() {  # $1 name, $2 PYTHONPATH
  PYTHONPATH=$2 timeout 110 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py \
    --work /tmp/lsb --contexts 16384 --reps 5 --phases verify,round --attention auto --compile reproducible \
    --out $OUT/$1 > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_profile.md; grep -E "\] default|rror" $OUT/$1_log.txt | grep -v -i warn | tail -3; left "profile $1"
}
prof pnew $PWD; prof pold $PWD/.gpu/old
timeout 60 python -m pytest -q -m gpu tests/test_mosaic_cache.py -p no:cacheprovider -k "gqa7 or mha-empty" \
  > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt; left "kernel tests"
