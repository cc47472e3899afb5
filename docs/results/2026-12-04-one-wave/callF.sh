# End to end at 16k, generate()'s compile: the one-wave rule (A), then the rule before it (B), one process each.
source .gpu/setup.sh
ARGS="--fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --phase-contexts '' --e2e-contexts 16384 --reps 2 --compile reproducible"
eval timeout 120 python -m infer.bench spec $ARGS --out $OUT/one_wave > $OUT/one_wave_log.txt 2>&1
grep -E "tok/s|rror" $OUT/one_wave_log.txt | grep -v -i warn | tail -4; left "one wave"
eval timeout 110 python - $ARGS --out $OUT/before > $OUT/before_log.txt 2>&1 <<'PY'
import functools, runpy, sys
import pallas.mosaic_cache_attention as mca
mca.default_mosaic_config = functools.partial(mca.default_mosaic_config, one_wave=False)  # the rule before 7t
sys.argv = ["infer.bench", "spec"] + sys.argv[1:]
runpy.run_module("infer.bench", run_name="__main__")
PY
grep -E "tok/s|rror" $OUT/before_log.txt | grep -v -i warn | tail -4; left "before"
