# 64-node tree (4,16,16,16,11): verify and round with the default Mosaic config (3 warpgroups: 2 row blocks, one
# warpgroup computing in the second), with 2 warpgroups x 11 splits (256 rows = 2 whole row blocks; 7k: -9% alone),
# and padded to 72 nodes (what the default tree's verification costs), one process, generate()'s default compile.
source .gpu/setup.sh
timeout 175 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
  --contexts 16384 --reps 5 --phases verify,round --attention auto --tree 4,16,16,16,11 \
  --mosaic '{"w2s11": {"compute_wgs": 2, "num_splits": 11}}' --verify-node-multiples 72 \
  --out $OUT/tree64 > $OUT/tree64_log.txt 2>&1
grep -E "\[bench|rror" $OUT/tree64_log.txt | grep -v -i warn | tail -10 | cut -c1-220; left "profile done"
