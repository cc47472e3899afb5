cd /work/main
for t in 4,16,16,16,16 4,16,16,16,11; do
  JAX_PLATFORMS=cpu python -m infer.bench drafts --out runs/tree_$t --target /work/shared/fixtures/code-lm \
    --drafts ref=/work/shared/fixtures/code-lm-draft-ref --prompts corpus/dev.jsonl --contexts 2048 \
    --temperatures 0,1 --num-prompts 12 --new-tokens 128 --reps 1 --tree $t > runs/tree_$t.log 2>&1
done
