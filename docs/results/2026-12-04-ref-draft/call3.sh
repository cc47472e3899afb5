source .gpu/setup.sh
left start
timeout 90 python $F/make_code_lm.py --export-corpus /tmp/corpus --manifest $F/code-lm/manifest.json --splits dev 2>&1 | tail -3
ls -la /tmp/corpus
left corpus done
drafts() {  # out, tree
  timeout $3 python -m infer.bench drafts --out $OUT/$1 --target $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsd --drafts ref=$F/code-lm-draft-ref --prompts /tmp/corpus/dev.jsonl --contexts 16384 --temperatures 0,1 --num-prompts 4 --new-tokens 256 --reps 1 --tree $2 2>&1 | grep -v -i warn | tail -14
}
drafts tree_default 4,16,16,16,16 250
left default tree done
drafts tree_488 4,8,8 170
left end
