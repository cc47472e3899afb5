source .gpu/setup.sh
left start
timeout 250 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 5 --phases draft_step0,tree_level2,verify,round --attention auto --options '{"nosplit": {"xla_gpu_experimental_force_split_k": 1}, "default_again": {}}' --out $OUT/split > $OUT/split_log.txt 2>&1
grep -E "\[bench|rror" $OUT/split_log.txt | grep -v -i warn | tail -20
left split done
timeout 230 python -m infer.bench profile --model llama3-8b --contexts 16384 --reps 5 --attention auto --out $OUT/llama > $OUT/llama_log.txt 2>&1
grep -E "\[bench|rror" $OUT/llama_log.txt | grep -v -i warn | tail -14
left end
