"""The time of each phase of one speculative round and of a plain decode step, against its floor.

    python -m tools.spec_phases --out DIR --fixture FIXTURE_DIR --pad-script pad_model.py   # GPU
    python -m tools.spec_phases --out DIR --smoke                                           # CPU, tiny

The pair, prompts and round of ``python -m infer.bench spec`` (``--tree``, ``--batch``, and here also
``--temperature`` / ``--draft-sampling``). Every phase is repeated ``--reps`` times inside one jitted
``fori_loop`` from the post-prefill state (the harness's in-loop timing; carries such as the KV cache donated and
updated in place), so no per-call dispatch or cache copy is counted. Every step reads its carry, so nothing can be
hoisted out of the loop. Parameters are passed as arguments, never closed over (a closure would make the weights
compile-time constants). Each phase is compiled with the speculative loop's XLA options (``--compile``, plus
``--xla-options``), the plain step with plain decoding's. The floors (:mod:`tools.floors`) use the copy bandwidth
measured in the same run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from infer.bench.harness import (add_sized_args, arg_parser, copy_bandwidth, finish, json_object_arg, log, md_header,
                                 md_row, parse_sized, run_header, time_loop)
from infer.bench.loops import add_compile_arg, loop_options
from infer.bench.spec import (add_pair_args, add_sampling_args, batch_starts, batch_stream_length, check_pair_args,
                              check_sampling_args, load_pair)
from infer.decoding import StopCriteria
from infer.generate import pad_prompts, plan_speculative
from infer.main import positive_ints_arg
from infer.plain import decode_step
from infer.speculative import SpecSettings, spec_round, speculative_start, verify
from longspec_jax.draft import draft_root
from longspec_jax.kv_cache import KVCache, commit
from longspec_jax.sampling import SamplingConfig
from longspec_jax.tree import grow_tree, start_tree
from tools.floors import round_floors

DEFAULTS = dict(contexts=(16384, 32768), reps=10)
SMOKE = dict(contexts=(40,), reps=1)
NEW_TOKENS = 256  # planned new tokens: they set the cache capacity


def after(cache: KVCache, carry_leaf: jax.Array) -> KVCache:
    """``cache`` made to depend on a loop carry (its lengths plus 0 unless the carry holds a NaN), so a step that
    only reads the cache cannot be hoisted out of the timing loop."""
    return cache.replace(lengths=cache.lengths + jnp.isnan(carry_leaf.sum()).astype(jnp.int32))


def phase_times(settings: SpecSettings, tparams, weights, tokens, lengths, stop, key, reps: int,
                options: dict, plain_options: dict) -> dict:
    """Seconds of each phase of one round (XLA ``options``) and of a plain decode step (``plain_options``)."""
    def timed(step, carry, consts, opts=options):
        t, carry = time_loop(step, carry, consts, reps, options=opts)
        return t.per_step_s, carry

    spec, ds = settings.tree, settings.draft
    B, V = tokens.shape[0], settings.base.config.vocab_size
    start = jax.jit(lambda p, d, t, l, k: speculative_start(settings, p, d, t, l, stop, k))
    phases: dict = {}

    def plain(carry, p):
        token_B, cache = carry
        return decode_step(p, settings.base, cache, token_B, jax.random.PRNGKey(0))

    state = start(tparams, weights, tokens, lengths, key)  # its cache is donated to the plain step's loop
    phases["plain_step"], _ = timed(plain, (state.pending[:, 0], state.cache), (tparams,), plain_options)
    state = start(tparams, weights, tokens, lengths, key)
    root_B = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]

    def step0(carry, p, d):
        st, _ = carry
        logp_BxV, ring = draft_root(ds, d, p, st.cache, st.ring, st.pending, st.num_pending)
        return st.replace(ring=ring), logp_BxV

    phases["draft_step0"], (state, logp_root_BxV) = timed(step0, (state, jnp.zeros((B, V), jnp.float32)),
                                                          (tparams, weights))

    def level1(builder, r, lp):
        # reads the carry so the loop cannot hoist it: a zero that XLA cannot fold away
        return start_tree(spec, ds, r, lp + builder.scores[:, :1] * 1e-30)

    builder = start_tree(spec, ds, root_B, logp_root_BxV)
    phases["tree_level1_topk"], builder = timed(level1, builder, (root_B, logp_root_BxV))
    for k in range(1, spec.depth):
        grow = functools.partial(lambda k, b, p, d, c, rg: grow_tree(spec, ds, d, p, c, rg, b, k), k)
        # growing level k again only rewrites level k + 1: the final carry is the grown tree
        phases[f"tree_level{k + 1}"], builder = timed(grow, builder, (tparams, weights, state.cache, state.ring))
    tree, cache = builder.tree, state.cache
    del state

    def verify_step(carry, p, c, t):
        return verify(settings, p, after(c, carry[0]), t)

    phases["verify"], (logits_BxNxV, tree_kv) = timed(verify_step, verify(settings, tparams, cache, tree),
                                                      (tparams, cache, tree))

    def accept_step(acc_carry, t, lg, k):
        return settings.acceptance(t, lg + acc_carry.count_B[:, None, None] * 1e-30, k, settings)

    acc = settings.acceptance(tree, logits_BxNxV, key, settings)
    phases["accept"], acc = timed(accept_step, acc, (tree, logits_BxNxV, key))
    inactive_B = jnp.zeros((B,), bool)  # commit without advancing the lengths, so it can repeat
    phases["commit"], cache = timed(commit, cache, (tree_kv, acc.path_BxA, acc.count_B, inactive_B))
    del cache, logits_BxNxV, tree_kv
    state = start(tparams, weights, tokens, lengths, key)
    phases["full_round"], _ = timed(lambda st, p, d: spec_round(settings, p, d, stop, st), state, (tparams, weights))
    return phases


def run(args) -> dict:
    results = run_header(tree_shape=list(args.tree), temperature=args.temperature,
                         draft_sampling=args.draft_sampling, batch=args.batch, compile=args.compile,
                         xla_options=args.xla_options, contexts={})
    target, draft, stream, impl = load_pair(args, batch_stream_length(max(args.contexts), args.batch))
    results["copy"] = copy_bandwidth(args.smoke)  # the byte ceiling of the floors
    copy_bw = results["copy"]["bytes_per_s"]
    stop = StopCriteria.make(NEW_TOKENS, [])
    options = loop_options("speculative", args.compile, args.xla_options)
    plain_options = loop_options("plain", args.compile)
    for ctx in args.contexts:
        settings = plan_speculative(target, draft, ctx, NEW_TOKENS, SamplingConfig(args.temperature), args.tree,
                                    512, impl, args.draft_sampling)
        rows = [np.asarray(stream[start:start + ctx], np.int32) for start in batch_starts(args.batch)]
        tokens, lengths = pad_prompts(rows, settings.base.prompt_len)
        times = phase_times(settings, target.params, draft.weights, tokens, lengths, stop, jax.random.PRNGKey(0),
                            args.reps, options, plain_options)
        floors = round_floors(target.params, draft.variables, target.config, args.tree, args.batch, ctx)
        results["contexts"][ctx] = {name: dict(seconds=t, **({} if name not in floors else dict(
            floor_seconds=floors[name].seconds(copy_bw), bound=floors[name].bound(copy_bw))))
            for name, t in times.items()}
        log(f"ctx {ctx}: " + ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in times.items()))
    return results


def markdown(results: dict) -> str:
    lines = []
    for ctx, row in results["contexts"].items():
        lines += ["", f"Phases at {ctx}: ms, and the floor (bytes / copy bandwidth or FLOPs / peak, the larger):",
                  ""] + md_header(["phase", "ms", "floor ms", "bound by", "x floor"])
        for name, r in row.items():
            cells = ["", "", ""] if "floor_seconds" not in r else [
                f"{r['floor_seconds'] * 1e3:.3f}", r["bound"], f"{r['seconds'] / r['floor_seconds']:.2f}x"]
            lines.append(md_row([name, f"{r['seconds'] * 1e3:.3f}"] + cells))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = arg_parser("spec_phases", __doc__, "tiny random pair on the CPU", prog="python -m tools.spec_phases")
    add_pair_args(p)
    add_sampling_args(p)
    add_sized_args(p, (("contexts", positive_ints_arg, "prompt lengths"),
                       ("reps", int, "steps of each phase's timed loop")), DEFAULTS, SMOKE)
    add_compile_arg(p)
    p.add_argument("--xla-options", type=json_object_arg, default={}, metavar="JSON",
                   help="XLA options added to every phase's compile but the plain step's")
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    check_pair_args(p, args)
    check_sampling_args(p, args)
    results = run(args)
    return finish(args.out, "spec_phases", results, markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
