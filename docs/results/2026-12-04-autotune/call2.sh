source .gpu/setup.sh
R='{"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": false}'
prof() {  # name, extra args
  name=$1; shift
  timeout 200 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases verify,round --attention auto --out $OUT/$name "$@" 2>&1 | grep -v -i warn | grep -E "^## |^\| (verify|round) |rror|Trace|Duplicate" | tail -12
}
left start
XLA_FLAGS="--xla_gpu_dump_autotune_results_to=$OUT/at.textproto" prof p1_dump
left p1 done
ls -la $OUT/at.textproto
python .gpu/at_edit.py $OUT/at.textproto $OUT/at_edit.textproto 2>&1 | tail -60
left edit done
XLA_FLAGS="--xla_gpu_load_autotune_results_from=$OUT/at_edit.textproto" prof p2_edit
left p2 done
XLA_FLAGS="--xla_gpu_load_autotune_results_from=$OUT/at.textproto" prof p3_control --options "{\"repro\": $R}"
left end
