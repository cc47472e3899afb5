source .gpu/setup.sh
att() {  # $1 name, $2 memory-warpgroup registers
  (cd .gpu/ovl && LS_MEM_REGS=$2 MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=$PWD timeout 150 python -m infer.bench attention --sections copy,mosaic \
    --mosaic-shapes padded-8b:64:16384:1,llama3-8b:128:32768:1 --new-tokens 72 --mosaic-variants overlap \
    --out $OUT/$1) > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_attention.md; grep -E "spill stores|serialized| us \(|rror" $OUT/$1_log.txt | grep -v "^ptxas warn" | sed 's/MosaicConfig(num_splits=[0-9]*, //; s/accumulate=.state., pingpong=True, //; s/^\[bench [0-9:]*\]//; s/bytes stack frame, //; s/ (.*//; s/Potential Performance Loss: wgmma.mma_async instructions are serialized.*/SERIALIZED/' | cut -c1-200
  left "attention $1"
}
att o24 24; att o40 40
(cd .gpu/ovl && LS_MEM_REGS=24 PYTHONPATH=$PWD timeout 240 python -m pytest -q -m gpu tests/test_mosaic_cache.py -p no:cacheprovider \
  -k "ovl" -x) > $OUT/ovl_tests.txt 2>&1; tail -15 $OUT/ovl_tests.txt | cut -c1-300; left "ovl tests"
