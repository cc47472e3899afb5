source .gpu/setup.sh
XLA_FLAGS="--xla_gpu_dump_autotune_logs_to=$OUT/logs.textproto --xla_gpu_dump_autotune_results_to=$OUT/results.textproto --xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*lambda.*" timeout 100 python .gpu/at_logs.py 2>&1 | grep -v -i warn | head -150
ls $OUT/hlo | head -5; ls $OUT/hlo | wc -l
