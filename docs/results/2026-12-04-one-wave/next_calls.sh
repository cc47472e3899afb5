# Left for the next session (docs/benchmarks.md 7t): the oracle rows end to end that call F lost, and 32k's split
# count in the round. Needs .gpu/setup.sh and .gpu/fx as in ../2026-12-04-overlap-regs/; carry [".gpu"]; ~8 min.
source .gpu/setup.sh
ARGS="--fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --phase-contexts '' --e2e-contexts 16384 --reps 2 --compile reproducible"
# the rule before 7t, patched in (B), then the one-wave rule (A), then B again: one process each
before() {
  eval timeout 150 python - $ARGS --out $OUT/$1 > $OUT/$1_log.txt 2>&1 <<'PY'
import functools, runpy, sys
import pallas.mosaic_cache_attention as mca
mca.default_mosaic_config = functools.partial(mca.default_mosaic_config, one_wave=False)
sys.argv = ["infer.bench", "spec"] + sys.argv[1:]
runpy.run_module("infer.bench", run_name="__main__")
PY
  grep -E "tok/s|rror" $OUT/$1_log.txt | grep -v -i warn | tail -4; left "$1"
}
before before1
eval timeout 120 python -m infer.bench spec $ARGS --out $OUT/one_wave > $OUT/one_wave_log.txt 2>&1
grep -E "tok/s|rror" $OUT/one_wave_log.txt | grep -v -i warn | tail -4; left "one wave"
before before2
# 32k in the round: the default (4, light 3) against 7 splits, the best alone in 7t (130.2 against 133.5 us)
timeout 200 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 32768 --reps 5 --phases verify,round --attention auto --compile reproducible \
  --mosaic '{"s7": {"num_splits": 7}}' --out $OUT/prof32 > $OUT/prof32_log.txt 2>&1
grep -E "^\| (verify|round)|^## " $OUT/prof32/*.md; left "profile 32k"
