# Left for the next session (docs/benchmarks.md 7p); needs .gpu/setup.sh as in call4.sh. One call, ~7 minutes.
# 1. Verification on the tree padded to 72 nodes (SpecSettings.verify_node_multiple = 8, so that XLA's cuBLAS GEMMs
#    need no row padding and slicing in every layer), end to end, in generate()'s default (reproducible) compile
#    and the autotuned one. If it wins, make 8 the default in infer.generate.plan_speculative and run the GPU e2e
#    tests (tests/test_gpu_e2e.py -k "test_bf16_speculative_matches_greedy and auto and not 32k").
# 2. The call the lender took back in 7p: split-K off in the autotuned speculative loop, end to end.
source .gpu/setup.sh
run() {  # NAME ARGS...: one end-to-end spec run at 16k
  local name=$1; shift
  timeout 200 python -m infer.bench spec --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb \
    --contexts 16384 --phase-contexts "" --e2e-contexts 16384 --reps 2 --out $OUT/$name "$@" > $OUT/$name.log 2>&1
  grep -E "tok/s|rror" $OUT/$name.log | grep -v -i warn | tail -4; left "$name done"
}
run repro1 --compile reproducible
run repro8 --compile reproducible --verify-node-multiple 8
run auto1 --compile autotuned
run auto8 --compile autotuned --verify-node-multiple 8
run nosplit --compile autotuned --xla-options '{"xla_gpu_experimental_force_split_k": 1}'
# at most 8 files come back: one JSON of every run's report, one log
python - <<'PY'
import glob, json, os
out = os.environ["OUT"]
reports = {os.path.basename(os.path.dirname(p)): json.load(open(p)) for p in glob.glob(f"{out}/*/bench_spec.json")}
json.dump(reports, open(f"{out}/spec_runs.json", "w"), indent=1)
with open(f"{out}/spec_runs_log.txt", "w") as f:
    for p in sorted(glob.glob(f"{out}/*.log")):
        f.write(f"== {p}\n" + "".join(l for l in open(p) if "[bench" in l or "rror" in l))
PY
find $OUT -mindepth 1 -not -name 'spec_runs*' -delete
