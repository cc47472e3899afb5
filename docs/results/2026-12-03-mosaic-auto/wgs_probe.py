"""In-round A/B/C/A of the Mosaic cache half's launch shape (batch 1, padded pair): the default config (two compute
warpgroups at head_dim 64), three warpgroups with the waves rule's split count, three with the default's split
count, the default again; one process, `infer.bench.profile`'s loop. Usage: python wgs_probe.py OUT profile-args..."""
import dataclasses
import sys

import pallas.mosaic_cache_attention as mca
from infer.bench import profile
from infer.bench.harness import log, write_report
from infer.decoding import StopCriteria
from infer.generate import pad_prompts, plan_speculative
from longspec_jax.sampling import SamplingConfig
import jax
import numpy as np

DEFAULT = mca.default_mosaic_config


def wg3(keep_splits: bool):
    def config(batch, kv_heads, rows, capacity, head_dim, **kw):
        base = DEFAULT(batch, kv_heads, rows, capacity, head_dim, **kw)
        if head_dim > 64 or base.compute_wgs == 1:
            return base
        if keep_splits:
            return dataclasses.replace(base, compute_wgs=3)
        blocks = batch * kv_heads * -(-rows // (3 * mca.ROWS_PER_WG))
        splits = min(round(mca.WAVES[64] * mca.NUM_SMS / blocks), capacity // mca.MIN_SPLIT_KEYS)
        return dataclasses.replace(base, compute_wgs=3, num_splits=max(splits, 1))
    return config


SCHEDULE = {"wg2": DEFAULT, "wg3_waves": wg3(False), "wg3_same_splits": wg3(True), "wg2_again": DEFAULT}

out_dir, argv = sys.argv[1], sys.argv[2:]
args = profile.parse_args(argv + ["--out", out_dir])
target, draft, stream, impl = profile.load_models(args)
variants = {name: profile.Variant({}, impl="auto") for name in SCHEDULE}
order = iter(SCHEDULE.items())
results = {"schedule": list(SCHEDULE), "contexts": {}}
stop = StopCriteria.make(args.new_tokens, [])
for ctx in args.contexts:
    def plan(variant_impl, ctx=ctx):
        name, fn = next(order, (None, DEFAULT))
        seen = set()

        def logged(*a, _fn=fn, _name=name, **kw):
            cfg = _fn(*a, **kw)
            if a not in seen:
                seen.add(a)
                log(f"  {_name}: default_mosaic_config{a} -> {cfg}")
            return cfg
        mca.default_mosaic_config = logged
        jax.clear_caches()  # mosaic_cache_attention is jitted with config=None static: retrace it
        if name:
            log(f"variant {name}: verify config {fn(1, 18, 276, 16640, 64)}")
        return plan_speculative(target, draft, ctx, args.new_tokens, SamplingConfig(args.temperature), args.tree,
                                512, variant_impl or impl, args.draft_sampling)
    prompt_len = plan_speculative(target, draft, ctx, args.new_tokens, SamplingConfig(args.temperature), args.tree,
                                  512, impl, args.draft_sampling).base.prompt_len
    tokens, lengths = pad_prompts([np.asarray(stream[:ctx], np.int32)], prompt_len)
    results["contexts"][ctx] = {}
    profile.profile_context(plan, stop, target.params, draft.weights, tokens, lengths, args.reps, variants,
                            None, args.phases, out=results["contexts"][ctx])
write_report(out_dir, "wgs_probe", results, profile.markdown(results))
