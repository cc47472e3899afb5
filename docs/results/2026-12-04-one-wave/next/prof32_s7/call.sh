# 32k in the round: the default (4, light 3) against 7 splits (the best alone in 7t); the loose end of next_calls.sh.
source .gpu/setup.sh
timeout 315 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 32768 --reps 5 --phases verify,round --attention auto --compile reproducible \
  --mosaic '{"s7": {"num_splits": 7}}' --out $OUT/prof32 > $OUT/prof32_log.txt 2>&1
grep -v -i warn $OUT/prof32_log.txt | grep -E "verify|round|rror" | tail -8; left "profile 32k"
rm -f $OUT/prof32/*.json.gz
