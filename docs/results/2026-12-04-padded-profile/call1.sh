# 2026-12-04 session 26, call 1: where the padded round's time goes (72 verified nodes, the default since 7q),
# in generate()'s default compile and the autotuned one; 16k, five steps a call.
source .gpu/setup.sh
for mode in reproducible autotuned; do
  timeout 250 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
    --contexts 16384 --reps 5 --phases draft_step0,tree_level2,verify,round --attention auto \
    --compile $mode --out $OUT/prof_$mode > $OUT/prof_${mode}_log.txt 2>&1
  grep -E "\[bench|rror" $OUT/prof_${mode}_log.txt | grep -v -i warn | tail -10; left "profile $mode done"
done
