# 2026-12-04 session 25: the reference-recipe draft with verification padded to 8 nodes (default now), as 7o.3
source .gpu/setup.sh
timeout 60 python $F/make_code_lm.py --export-corpus /tmp/corpus --manifest $F/code-lm/manifest.json --splits dev 2>&1 | tail -1
drafts() {  # out, tree, temperatures, timeout
  timeout $4 python -m infer.bench drafts --out $OUT/$1 --target $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsd --drafts ref=$F/code-lm-draft-ref --prompts /tmp/corpus/dev.jsonl --contexts 16384 --temperatures $3 --num-prompts 4 --new-tokens 256 --reps 1 --tree $2 2>&1 | grep -v -i warn | grep -E "^\| 16384|ref tau|plain|rror" | tail -6
  left $1 done
}
drafts tree_default 4,16,16,16,16 0,1 250
drafts tree_444 4,4,4 1 140
