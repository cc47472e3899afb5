# Left for the next session (docs/benchmarks.md 7q); needs .gpu/setup.sh as in call2.sh. Two device calls
# (split this file at "# Call B"), ~8 + ~7 min. (Lines of an older Call A that an edit had left between the two calls
# were removed on 2026-12-04 in the twenty-sixth session, which ran these calls: ../2026-12-04-padded-profile/.)
# Call A: where the padded round's time goes now, in generate()'s default compile (profile --compile reproducible,
#         new) and the autotuned one; variants: default (72 nodes) and nodes_1 (the unpadded tree); 16k.
source .gpu/setup.sh
for mode in reproducible autotuned; do
  timeout 240 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
    --contexts 16384 --reps 5 --phases draft_step0,tree_level2,verify,round --attention auto \
    --verify-node-multiples 1 --compile $mode --out $OUT/prof_$mode > $OUT/prof_${mode}_log.txt 2>&1
  grep -E "\[bench|rror" $OUT/prof_${mode}_log.txt | grep -v -i warn | tail -10; left "profile $mode done"
done
# Call B: 32k end to end (goal: round <= 8.5 ms) and batch 4 at 16k, in generate()'s default compile (the faster
#         speculative loop, 7q).
source .gpu/setup.sh
timeout 260 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 32768 --phase-contexts "" --e2e-contexts 32768 --stable-gap 0.25 --stable-search 16384 --reps 2 \
  --compile reproducible --out $OUT/ctx32k > $OUT/ctx32k_log.txt 2>&1
grep -E "tok/s|rror" $OUT/ctx32k_log.txt | grep -v -i warn | tail -5; left "32k done"
timeout 300 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --new-tokens 128 --reps 1 --batch 4 --stable-gap 0.25 \
  --stable-search 8192 --compile reproducible --out $OUT/b4 > $OUT/b4_log.txt 2>&1
grep -E "tok/s|rror" $OUT/b4_log.txt | grep -v -i warn | tail -5; left "batch 4 done"
