source .gpu/setup.sh
left start
timeout 570 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases verify,round --attention auto --options '{"conc": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}, "cublaslt": {"xla_gpu_enable_cublaslt": true}, "splitk1": {"xla_gpu_experimental_force_split_k": 1}, "blockrw": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": true}, "tritonmof": {"xla_gpu_unsupported_enable_triton_multi_output_fusion": true}, "alltriton": {"xla_gpu_experimental_all_fusions_with_triton": true}}' --out $OUT/profile 2>&1 | grep -v -i warn | grep -E "^## |^\| (verify|round) |rror|Trace" | tail -30
left end
