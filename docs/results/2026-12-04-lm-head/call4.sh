source .gpu/setup.sh
left start
timeout 470 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 32768 --phase-contexts 32768 --e2e-contexts 32768 --stable-gap 0.25 --stable-search 16384 --commit-repeats 1 --reps 2 --out $OUT/spec32 2>&1 | grep -v -i warn | grep -E "ms|tok|x |rror|Trace" | tail -40
left end
