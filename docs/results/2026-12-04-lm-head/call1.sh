source .gpu/setup.sh
left start
timeout 90 python .gpu/hlo_probe.py 2>&1 | grep -v -i warn | tail -60
left probe done
timeout 470 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases plain,tree_level3,verify,round --attention auto --options '{"repro": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": false}, "repro_lt": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": false, "xla_gpu_enable_cublaslt": true}, "cublas": {"xla_gpu_enable_triton_gemm": false}}' --out $OUT/profile 2>&1 | grep -v -i warn | grep -E "^## |^\| (plain|tree_level3|verify|round) |rror|Trace" | tail -30
left end
