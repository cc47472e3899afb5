# Light-split grid: explicit (num_splits, light_splits) pairs, kernel alone, twice.
source .gpu/setup.sh
export LIGHT_GRID_3="7:0,7:3,7:5,8:3,6:0,6:4,3:0,3:2,4:3,10:6,12:10,11:8"
export LIGHT_GRID_2="6:4,6:3,6:2,12:4,12:9,5:3,10:6,4:4,14:5,7:5"
att() {
  (cd .gpu/light && PYTHONPATH=$PWD timeout 200 python -m infer.bench attention --sections copy,mosaic \
    --mosaic-shapes padded-8b:64:16384:1,padded-8b:64:32768:1,llama3-8b:128:32768:1 --new-tokens 72 \
    --mosaic-variants light --out $OUT/$1) > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_attention.md; grep -E " us \(|rror" $OUT/$1_log.txt | sed -E 's/MosaicConfig\(num_splits=([0-9]+).*light_splits=([A-Za-z0-9]+)\)/s=\1 l=\2/' | cut -c12-140; left "attention $1"
}
att grid1; att grid2
