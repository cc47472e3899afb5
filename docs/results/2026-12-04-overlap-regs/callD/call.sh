source .gpu/setup.sh
ph() {  # $1 name, $2 memory-warpgroup registers
  (cd .gpu/ring && JAX_PLATFORMS=cuda,cpu LS_MEM_REGS=$2 PYTHONPATH=$PWD timeout 150 python -m infer.bench attention --sections phases \
    --mosaic-shapes padded-8b:64:16384:1 --new-tokens 72 --mosaic-variants ring --out $OUT/$1) > $OUT/$1_log.txt 2>&1
  grep -E "kcycles|FAIL" $OUT/$1_log.txt | sed 's/MosaicConfig(num_splits=11, //; s/accumulate=.state., pingpong=True, //' | cut -c1-260
  left "phases $1"
}
ph p24 24; ph p40 40
