source .gpu/setup.sh
att() {  # $1 name, $2 memory-warpgroup registers
  (cd .gpu/ring && LS_MEM_REGS=$2 MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=$PWD timeout 150 python -m infer.bench attention --sections copy,mosaic \
    --mosaic-shapes padded-8b:64:16384:1,llama3-8b:128:32768:1 --new-tokens 72 --mosaic-variants ring \
    --out $OUT/$1) > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_attention.md; grep -E "spill stores|serialized| us \(" $OUT/$1_log.txt | sed 's/MosaicConfig(num_splits=11, //' | cut -c1-170
  left "attention $1"
}
att m40 40; att m24 24; att m40b 40; att m24b 24
(cd .gpu/ring && LS_MEM_REGS=24 PYTHONPATH=$PWD timeout 200 python -m pytest -q -m gpu tests/test_mosaic_cache.py -p no:cacheprovider \
  -k "padded-default or padded-ring or llama-default") > $OUT/m24_tests.txt 2>&1; tail -3 $OUT/m24_tests.txt; left "m24 tests"
