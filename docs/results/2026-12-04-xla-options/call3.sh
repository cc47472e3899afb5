source .gpu/setup.sh
left start
timeout 575 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases plain,verify,round --attention auto --options '{"conc": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}, "default_again": {}, "repro": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": false}, "repro_conc": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": false, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}}' --out $OUT/profile 2>&1 | grep -v -i warn | grep -E "^## |^\| (plain|verify|round) |rror|Trace" | tail -30
left end
