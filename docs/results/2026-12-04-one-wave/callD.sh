# The one-wave rule in the round (generate()'s reproducible compile), one process: new default, then the rule before it.
source .gpu/setup.sh
timeout 540 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 16384,32768 --reps 5 --phases verify,round --attention auto --compile reproducible \
  --mosaic '{"before": {"num_splits": 11}}' --out $OUT/prof > $OUT/prof_log.txt 2>&1
tail -3 $OUT/prof_log.txt; grep -E "^\| (verify|round)|^## " $OUT/prof/*.md | head -20; left "profile"
