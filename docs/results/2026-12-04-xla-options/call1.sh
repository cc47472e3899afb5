source .gpu/setup.sh
left start
timeout 560 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases verify,round --attention auto --options '{"pdl_off": {"xla_gpu_enable_pdl": false}, "pdl_on": {"xla_gpu_enable_pdl": true}, "tws": {"xla_gpu_experimental_enable_triton_warp_specialization": true}}' --out $OUT/profile 2>&1 | grep -v -i warn | tail -30
left end
