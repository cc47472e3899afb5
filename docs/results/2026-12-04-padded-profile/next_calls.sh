# Left for the next session (docs/benchmarks.md 7r): does raising the compute warpgroups' registers inside their own
# branch (branch exp/regs-in-branch, one commit) let ptxas give their code the raised count (no spills, wgmmas not
# serialized), and is the Mosaic cache half faster for it? One device call, ~6 min. Before it, here:
#   rm -rf .gpu/old .gpu/regs && mkdir -p .gpu/old .gpu/regs
#   git archive main pallas longspec_jax infer train | tar -x -C .gpu/old
#   git archive exp/regs-in-branch pallas longspec_jax infer train | tar -x -C .gpu/regs
# If ptxas then allocates more than 128 registers to the compute code, next: the overlapped schedules of 7k-7l
# (ring_schedule.diff, the halves) on top of it, with two compute warpgroups (232 registers each).
source .gpu/setup.sh
att() {  # $1 name, $2 PYTHONPATH: the kernel alone at the verify shapes, ptxas's report of each compiled kernel
  MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=$2 timeout 150 python -m infer.bench attention --sections copy,mosaic \
    --mosaic-shapes padded-8b:64:16384:1,llama3-8b:128:32768:1 --new-tokens 72 --mosaic-variants wgs \
    --out $OUT/$1 > $OUT/$1_log.txt 2>&1
  rm -f $OUT/$1/bench_attention.md; grep -E "spill|Used [0-9]+ reg|serialized| us \(" $OUT/$1_log.txt | head -20
  left "attention $1"
}
att old $PWD/.gpu/old; att regs $PWD/.gpu/regs; att old2 $PWD/.gpu/old
