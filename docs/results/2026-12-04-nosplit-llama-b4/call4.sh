source .gpu/setup.sh
left start
for mode in autotuned reproducible; do
timeout 240 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --commit-repeats 1 --reps 2 --compile $mode --out $OUT/$mode > $OUT/${mode}_log.txt 2>&1
grep -E "\[bench|rror" $OUT/${mode}_log.txt | grep -v -i warn | tail -8
left $mode done
done
