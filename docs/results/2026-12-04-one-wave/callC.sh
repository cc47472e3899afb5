# In the round, one process: default, 4 splits with 3 for the light row block (one wave), 7 splits (two waves).
source .gpu/setup.sh
(cd .gpu/light && PYTHONPATH=$PWD timeout 500 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py \
  --work /tmp/lsb --contexts 16384 --reps 5 --phases verify,round --attention auto \
  --mosaic '{"s4l3": {"num_splits": 4, "light_splits": 3}, "s7": {"num_splits": 7}}' --out $OUT/prof16) > $OUT/prof16_log.txt 2>&1
tail -5 $OUT/prof16_log.txt; grep -E "^\| (verify|round)|^## " $OUT/prof16/*.md | head -20; left "profile 16k"
