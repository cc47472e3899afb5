"""In-round A/B/.../A of the Mosaic cache half's split count at the verify shape (calls of more than 128 folded
rows; other calls keep the default): one process, `infer.bench.profile`'s loop, the pair and prompt of
`infer.bench profile`. Usage: python splits_probe.py OUT SPLITS(e.g. 0,11,10,14,0; 0 = default) profile-args..."""
import dataclasses
import sys

import jax
import numpy as np

import pallas.mosaic_cache_attention as mca
from infer.bench import profile
from infer.bench.harness import log, write_report
from infer.bench.spec import batch_starts
from infer.decoding import StopCriteria
from infer.generate import pad_prompts, plan_speculative
from longspec_jax.sampling import SamplingConfig

DEFAULT = mca.default_mosaic_config


def with_splits(n: int):
    def config(batch, kv_heads, rows, capacity, head_dim, **kw):
        base = DEFAULT(batch, kv_heads, rows, capacity, head_dim, **kw)
        return dataclasses.replace(base, num_splits=n) if n and rows > 2 * mca.ROWS_PER_WG else base
    return config


out_dir, counts, argv = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
args = profile.parse_args(argv + ["--out", out_dir])
target, draft, stream, impl = profile.load_models(args)
schedule = [(f"v{i}_splits{n or 'default'}", with_splits(n)) for i, n in enumerate(counts)]
variants = {name: profile.Variant({}, impl="auto") for name, _ in schedule}
order = iter(schedule)
results = {"schedule": [name for name, _ in schedule], "contexts": {}}
stop = StopCriteria.make(args.new_tokens, [])
for ctx in args.contexts:
    def plan(variant_impl, ctx=ctx):
        name, fn = next(order, (None, DEFAULT))
        mca.default_mosaic_config = fn
        jax.clear_caches()  # mosaic_cache_attention is jitted with config=None static: retrace it
        if name:
            log(f"variant {name}: verify config {fn(args.batch, 18, 276, 16640, 64)}")
        return plan_speculative(target, draft, ctx, args.new_tokens, SamplingConfig(args.temperature), args.tree,
                                512, variant_impl or impl, args.draft_sampling)
    prompt_len = plan(None).base.prompt_len
    order = iter(schedule)
    rows = [np.asarray(stream[s:s + ctx], np.int32) for s in batch_starts(args.batch)]
    tokens, lengths = pad_prompts(rows, prompt_len)
    results["contexts"][ctx] = {}
    profile.profile_context(plan, stop, target.params, draft.weights, tokens, lengths, args.reps, variants,
                            None, args.phases, out=results["contexts"][ctx],
                            on_variant=lambda: write_report(out_dir, "splits_probe", results,
                                                            profile.markdown(results)))
