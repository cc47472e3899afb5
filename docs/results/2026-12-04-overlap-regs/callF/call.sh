source .gpu/setup.sh
t() {  # $1 name, $2 tree, $3 timeout, rest: pytest args
  n=$1; d=$2; s=$3; shift 3
  (cd $d && PYTHONPATH=$PWD timeout $s python -m pytest -q -p no:cacheprovider "$@") > $OUT/$n.txt 2>&1
  tail -2 $OUT/$n.txt | cut -c1-300; left "$n"
}
t spill_new .gpu/new 120 -m gpu tests/test_mosaic_cache.py -k spills
t spill_old .gpu/old 120 -m gpu tests/test_mosaic_cache.py -k spills
grep -oE "[0-9]+ bytes spill stores" $OUT/spill_old.txt | head
t kernel_new .gpu/new 150 -m gpu tests/test_mosaic_cache.py -k "padded-default or llama-default or padded-cross"
t e2e_new .gpu/new 240 -m gpu tests/test_gpu_e2e.py -k "test_bf16_speculative_matches_greedy and auto and not 32k"
