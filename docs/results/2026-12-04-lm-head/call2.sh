source .gpu/setup.sh
R='{"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": false}'
left start
timeout 80 python .gpu/hlo_probe2.py 2>&1 | grep -v -i warn | tail -8
left probe done
timeout 330 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases plain,draft_step0,verify,round --attention auto --options "{\"repro\": $R, \"default_again\": {}, \"repro_again\": $R}" --out $OUT/profile16 2>&1 | grep -v -i warn | grep -E "^## |^\| (plain|draft_step0|verify|round) |rror|Trace" | tail -30
left 16k done
timeout 150 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 32768 --reps 10 --phases round --attention auto --options "{\"repro\": $R}" --out $OUT/profile32 2>&1 | grep -v -i warn | grep -E "^## |^\| (plain|draft_step0|verify|round) |rror|Trace" | tail -30
left end
