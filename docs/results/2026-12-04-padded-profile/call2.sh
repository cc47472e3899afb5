# 2026-12-04 session 26, call 2: 32k end to end (goal: round <= 8.5 ms) and batch 4 at 16k, in generate()'s default
# (reproducible) compile, the tree padded to 72 nodes.
source .gpu/setup.sh
timeout 260 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 32768 --phase-contexts "" --e2e-contexts 32768 --stable-gap 0.25 --stable-search 16384 --reps 2 \
  --compile reproducible --out $OUT/ctx32k > $OUT/ctx32k_log.txt 2>&1
grep -E "tok/s|rror" $OUT/ctx32k_log.txt | grep -v -i warn | tail -5; left "32k done"
timeout 300 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --new-tokens 128 --reps 1 --batch 4 --stable-gap 0.25 \
  --stable-search 8192 --compile reproducible --out $OUT/b4 > $OUT/b4_log.txt 2>&1
grep -E "tok/s|rror" $OUT/b4_log.txt | grep -v -i warn | tail -5; left "batch 4 done"
