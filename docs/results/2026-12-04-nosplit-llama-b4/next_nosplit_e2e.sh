# The call the lender took back (7p.1): split-K off in the autotuned speculative loop, end to end, against the
# default, in one machine. Needs .gpu/setup.sh as in call4.sh. ~4 minutes.
source .gpu/setup.sh
for x in '{}' '{"xla_gpu_experimental_force_split_k": 1}'; do
timeout 240 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --reps 2 --compile autotuned --xla-options "$x" --out $OUT/$(echo "$x" | tr -dc a-z | head -c 12)x 2>&1 | grep -E "tok/s|rror" | grep -v -i warn | tail -5
left "$x done"
done
