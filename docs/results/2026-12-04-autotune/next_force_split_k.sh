source .gpu/setup.sh
left start
timeout 105 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 5 --phases round --attention auto --options '{"nosplit": {"xla_gpu_experimental_force_split_k": 1}}' --out $OUT/p 2>&1 | grep -v -i warn | grep -E "^## |^\| round |rror|Trace|padded|\[bench" | tail -12
left end
