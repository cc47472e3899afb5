source .gpu/setup.sh
left start
timeout 60 python $F/make_code_lm.py --export-corpus /tmp/corpus --manifest $F/code-lm/manifest.json --splits dev 2>&1 | tail -1
t1() {  # out, tree, timeout
  timeout $3 python -m infer.bench drafts --out $OUT/$1 --target $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsd --drafts ref=$F/code-lm-draft-ref --prompts /tmp/corpus/dev.jsonl --contexts 16384 --temperatures 1 --num-prompts 4 --new-tokens 256 --reps 1 --tree $2 2>&1 | grep -v -i warn | grep -E "^\| 16384|ref tau|plain" | tail -4
  left $1 done
}
t1 tree_444 4,4,4 140
t1 tree_2444 2,4,4,4 140
t1 tree_48 4,8 120
