# Left for the next session (docs/benchmarks.md 7r): does raising the compute warpgroups' registers at the head of
# their own branches (branch exp/regs-in-branch) let ptxas give their code the raised count (152 registers with
# three compute warpgroups, 232 with two; setmaxnreg_probe.cu shows ptxas does so only when the setmaxnreg dominates
# the code), is the Mosaic cache half faster for it, and does 7k's ring schedule (branch exp/ring-regs, on top of
# it; MosaicConfig(ring=True)) now fit without spills and win? ~6 min, then Call B, ~6 min. Before them, here:
#   D=docs/results/2026-12-04-padded-profile; rm -rf .gpu/old .gpu/ring .gpu/regs
#   for t in old ring regs; do mkdir -p .gpu/$t; git archive HEAD pallas longspec_jax infer train tests | tar -x -C .gpu/$t; done
#   git apply --directory=.gpu/regs $D/regs_in_branch.diff; git apply --directory=.gpu/ring $D/ring_regs.diff
# (the branches exp/regs-in-branch and exp/ring-regs hold the same two changes, if they still exist; the diffs are
# against main at 7r, the ring one includes the registers one)
# Two calls: split this file at "# Call B". Call A:
source .gpu/setup.sh
att() {  # $1 name, $2 tree, $3 variant kinds: the kernel alone at the verify shapes, ptxas's report of each kernel
  (cd $2 && MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=$PWD timeout 200 python -m infer.bench attention --sections copy,mosaic \
    --mosaic-shapes padded-8b:64:16384:1,llama3-8b:128:32768:1 --new-tokens 72 --mosaic-variants $3 \
    --out $OUT/$1) > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_attention.md; grep -E "spill|Used [0-9]+ reg|serialized| us \(" $OUT/$1_log.txt | head -24
  left "attention $1"
}
att old .gpu/old wgs; att ring .gpu/ring wgs,ring
(cd .gpu/ring && PYTHONPATH=$PWD timeout 120 python -m pytest -q -m gpu tests/test_mosaic_cache.py -p no:cacheprovider \
  -k "padded-default or padded-ring or llama-default") > $OUT/ring_tests.txt 2>&1; tail -3 $OUT/ring_tests.txt; left "ring tests"
