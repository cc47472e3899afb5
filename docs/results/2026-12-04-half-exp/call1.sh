source .gpu/setup.sh
left start
timeout 200 python .gpu/kprobe_hx.py $OUT/kprobe_hx.json 2>&1 | grep -v -i warn | tail -30
left kprobe done
timeout 120 python -m pytest -q -m gpu tests/test_mosaic_cache.py -k "half_exp or padded-default or padded-cross" -x 2>&1 | tail -5
left tests done
timeout 230 python -m infer.bench profile --fixture $F/code-lm --pad-script $F/pad_model.py --work /tmp/lsb --contexts 16384 --reps 10 --phases verify,round --attention auto --mosaic '{"hx": {"half_exp": true}, "base": {}}' --out $OUT/profile16 2>&1 | grep -v -i warn | grep -E "^## |^\| (plain|draft_step0|verify|round) |rror|Trace" | tail -30
left end
