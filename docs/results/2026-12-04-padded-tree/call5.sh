# 2026-12-04 session 25: split-K off in the autotuned speculative loop, with the tree padded to 72 (the default now)
source .gpu/setup.sh
timeout 170 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
    --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --reps 2 --out $OUT/nosplit8 --compile autotuned \
    --xla-options '{"xla_gpu_experimental_force_split_k": 1}' 2>&1 | grep -E "\[bench|rror" | grep -v -i warn | tail -8
left done
