"""Per-op GPU time of one speculative round's phases and of a plain step, from a profiler trace.

    python -m tools.profile --out DIR --fixture FIXTURE_DIR --pad-script pad_model.py   # GPU
    python -m tools.profile --out DIR --smoke                                           # CPU, tiny

Same model pair, prompt and settings as ``python -m infer.bench spec`` (the padded 8B-cost pair, its ``--batch``,
``--tree`` and ``--temperature``), or with ``--model llama3-8b`` a target of true Llama-3-8B shapes (128k vocabulary,
head_dim 128) with random bf16 weights and a random draft of its shapes, on a random prompt (phase times depend on
shapes, not on what the draft predicts). Each phase (plain decode step, draft step 0, every tree level, verify, the
whole round) is profiled in the in-loop timing from the post-prefill state (:mod:`tools.trace`): kernels per
step, summed kernel time, GPU-busy time and wall time per step, where the time goes by source function and by
kernel, and the GPU's idle gaps by the source of the kernel that ended each, and the compiled program's temporary
bytes. Every phase is compiled as ``generate()`` compiles its loop (``--compile``: autotuned, or the default
reproducible; every phase but the plain step with the speculative loop's options,
:data:`infer.speculative.SPECULATIVE_OPTIONS`). ``--options`` adds XLA compiler-option variants (e.g. command
buffers off) of every phase, added to those; ``--ablate`` adds one variant per named part with that part
computed twice (:mod:`tools.ablation`): its time over the default's is the part's marginal cost in the
round; ``--impls`` adds one variant per attention impl, timed after the default (``--attention``) in the same
process, so ``--attention auto --impls mosaic,auto`` times A, B, A; ``--mosaic`` adds variants of the Mosaic GPU
cache half's launch shape (:mod:`tools.mosaic_override`); ``--verify-node-multiples`` adds variants that
verify the tree padded to a multiple of nodes (``SpecSettings.verify_node_multiple``); ``--draft-vocabs`` adds
variants whose draft proposes from a draft vocabulary of K ids (:mod:`longspec_jax.draft_vocab`; the first K, which
on random weights times as any other K would). ``--phases`` picks the phases.

Wall and idle time include gaps that occur once per profiled call, not per step (e.g. one of 3.2-3.6 ms a call
in verification and the round under ``xla_gpu_experimental_force_split_k``): with few
``--reps`` compare busy time, and read the call's longest gap and ``idle_before_kernel``'s launch counts (1 / reps
marks such a gap).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tools.ablation import PARTS, doubling, parse_parts
from infer.bench.decode import LLAMA3_8B, TINY
from infer.bench.harness import arg_parser, json_object_arg, log, md_header, md_row, names_arg, write_report
from infer.bench.loops import add_compile_arg, loop_options
from tools.mosaic_override import check_fields, mosaic_override
from longspec_jax.testing import random_target
from infer.bench.spec import (add_pair_args, add_sampling_args, batch_starts, batch_stream_length, check_pair_args,
                              check_sampling_args, load_pair)
from tools.spec_phases import after
from tools.trace import profile_loop
from infer.decoding import StopCriteria
from infer.generate import pad_prompts, plan_speculative
from infer.main import positive_ints_arg
from infer.plain import decode_step
from infer.speculative import VERIFY_NODE_MULTIPLE, spec_round, speculative_start, verify
from longspec_jax.attention import IMPLS
from longspec_jax.draft import DraftConfig, draft_root, init_draft
from longspec_jax.draft_vocab import gather_draft_vocab
from longspec_jax.sampling import SamplingConfig
from longspec_jax.tree import grow_tree, start_tree


ABLATE_PREFIX = "x2_"  # variant name of a doubled part
IMPL_PREFIX = "impl_"  # variant name of another attention impl
MOSAIC_PREFIX = "mosaic_"  # variant name of another Mosaic launch shape
NODES_PREFIX = "nodes_"  # variant name of verification on a tree padded to a multiple of nodes
VOCAB_PREFIX = "vocab_"  # variant name of a draft proposing from a draft vocabulary


class Variant(NamedTuple):
    """XLA compiler options of every phase's compile, the parts computed twice (:mod:`tools.ablation`), the
    attention impl (None: the pair's), Mosaic launch-shape fields (:func:`mosaic_override`), the round's
    ``SpecSettings.verify_node_multiple`` and the size of the draft's vocabulary (0: the target's)."""
    options: dict
    doubled: tuple = ()
    impl: str | None = None
    mosaic: tuple = ()
    verify_node_multiple: int = VERIFY_NODE_MULTIPLE
    draft_vocab: int = 0


def level_phase(k: int) -> str:
    """Name of the phase that grows tree level ``k + 1`` from level ``k``."""
    return f"tree_level{k + 1}"


def phase_names(depth: int) -> tuple[str, ...]:
    """The phases profiled, in order, for a tree of ``depth`` levels."""
    return ("plain", "draft_step0", *(level_phase(k) for k in range(1, depth)), "verify", "round")


def phase_steps(settings, stop):
    """``{phase: step(carry, *consts) -> carry}`` for one round's phases, in :func:`phase_names` order."""
    spec, ds, base = settings.tree, settings.draft, settings.base

    def plain(carry, p):
        token_B, cache = carry
        return decode_step(p, base, cache, token_B, jax.random.PRNGKey(0))

    def step0(carry, p, d):
        st, _ = carry
        logp_BxV, ring = draft_root(ds, d, p, st.cache, st.ring, st.pending, st.num_pending)
        return st.replace(ring=ring), logp_BxV

    def level(k):
        def grow(builder, p, d, cache, ring):
            return grow_tree(spec, ds, d, p, cache, ring, builder, k)
        return grow

    def verify_step(carry, p, cache, tree):
        return verify(settings, p, after(cache, carry[0]), tree)

    def round_step(st, p, d):
        return spec_round(settings, p, d, stop, st)

    steps = (plain, step0, *(level(k) for k in range(1, spec.depth)), verify_step, round_step)
    return dict(zip(phase_names(spec.depth), steps, strict=True))


def profile_context(plan, stop, tparams, weights, tokens, lengths, reps: int, variants: dict[str, Variant],
                    hlo_dir: str | None = None, phases: tuple[str, ...] | None = None, out: dict | None = None,
                    on_variant=lambda: None, compile_mode: str = "autotuned") -> dict:
    """Every phase (or those of ``phases``) under every variant, into ``out`` (``{variant: {phase: summary}}``;
    ``on_variant()`` runs after each, e.g. to write the report so far); ``plan(impl)`` gives the round's settings
    with attention impl ``impl`` (None: the pair's); the carries are rebuilt from the post-prefill state; each phase
    is compiled with generate()'s options for ``compile_mode`` (:mod:`infer.bench.loops`) plus the variant's.
    ``hlo_dir``: each phase's compiled module is written there too, as ``VARIANT_PHASE.hlo.txt``."""
    out = {} if out is None else out
    for variant, how in variants.items():
        settings = dataclasses.replace(plan(how.impl), verify_node_multiple=how.verify_node_multiple)
        start = jax.jit(lambda p, d, t, l, k: speculative_start(settings, p, d, t, l, stop, k))  # noqa: B023
        fresh_state = functools.partial(start, tparams, weights, tokens, lengths, jax.random.PRNGKey(0))
        drafted = weights if not how.draft_vocab else weights.replace(vocab=gather_draft_vocab(
            tparams, np.arange(how.draft_vocab), settings.base.config.vocab_size))
        with doubling(how.doubled), mosaic_override(dict(how.mosaic)):  # the phases are traced afresh inside
            out[variant] = _profile_variant(variant, how.options, fresh_state, settings, stop, tparams, drafted,
                                            reps, hlo_dir, phases, compile_mode)
        on_variant()
    return out


def _mib(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _profile_variant(variant, opts, fresh_state, settings, stop, tparams, weights, reps, hlo_dir, phases,
                     compile_mode: str):
    """The phases of one variant (its doubled parts already patched in): ``{phase: summary}``."""
    spec, ds = settings.tree, settings.draft
    steps = {n: f for n, f in phase_steps(settings, stop).items() if phases is None or n in phases}
    state = fresh_state()
    root_B = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]
    logp_root_BxV, ring = draft_root(ds, weights, tparams, state.cache, state.ring, state.pending,
                                     state.num_pending)
    builder = start_tree(spec, ds, root_B, logp_root_BxV, ids_V=None if weights.vocab is None else weights.vocab.ids)
    levels = [builder]
    for k in range(1, spec.depth):
        levels.append(grow_tree(spec, ds, weights, tparams, state.cache, ring, levels[-1], k))
    plans = dict(plain=lambda: ((state.pending[:, 0], state.cache), (tparams,)),
                 draft_step0=lambda: ((state, logp_root_BxV), (tparams, weights)),
                 verify=lambda: (verify(settings, tparams, state.cache, levels[-1].tree),
                                 (tparams, state.cache, levels[-1].tree)),
                 round=lambda: (state, (tparams, weights)))
    for k in range(1, spec.depth):
        plans[level_phase(k)] = functools.partial(lambda k: (levels[k - 1], (tparams, weights, state.cache,
                                                                                    ring)), k)
    rows = {}
    for name, step in steps.items():
        carry, consts = plans[name]()
        t0 = time.perf_counter()
        try:
            hlo_path = os.path.join(hlo_dir, f"{variant}_{name}.hlo.txt") if hlo_dir else None
            options = loop_options("plain" if name == "plain" else "speculative", compile_mode, opts)
            rows[name], carry = profile_loop(step, carry, consts, reps, options, hlo_path)
        except Exception as e:  # noqa: BLE001
            rows[name] = dict(error=f"{type(e).__name__}: {e}"[:800])
            log(f"{variant} {name}: {rows[name]['error']}")
            continue
        if name in ("plain", "round", "draft_step0"):  # the carry held the (donated) cache
            state = fresh_state()
        r = rows[name]
        log(f"{variant} {name}: wall {r['wall_us']:.1f} us/step, busy {r['busy_us']:.1f}, idle {r['idle_us']:.1f} "
            f"(longest gap {r['longest_gap_us']:.0f} a call), kernels {r['kernel_sum_us']:.1f} in "
            f"{r['launches']:.0f} launches ({time.perf_counter() - t0:.0f} s)")
    return rows


def load_models(args):
    """(target, draft, prompt token stream, attention impl) of ``--model``."""
    length = batch_stream_length(max(args.contexts), args.batch)
    if args.model == "padded":
        return load_pair(args, length)
    target = random_target(TINY if args.smoke else LLAMA3_8B, None, jnp.float32 if args.smoke else jnp.bfloat16,
                           0.02)
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(1), dtype=target.dtype)
    stream = np.random.default_rng(0).integers(0, target.config.vocab_size, length).tolist()
    return target, draft, stream, "xla" if args.smoke else "auto"


def run(args) -> dict:
    t0 = time.perf_counter()
    target, draft, stream, impl = load_models(args)
    log(f"pair loaded in {time.perf_counter() - t0:.0f} s")
    results: dict = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
                     "jax": jax.__version__, "model": args.model, "tree_shape": list(args.tree),
                     "temperature": args.temperature, "draft_sampling": args.draft_sampling, "attention": impl,
                     "batch": args.batch, "compile": args.compile, "contexts": {}}
    stop = StopCriteria.make(args.new_tokens, [])
    for ctx in args.contexts:
        def plan(variant_impl, ctx=ctx):
            return plan_speculative(target, draft, ctx, args.new_tokens, SamplingConfig(args.temperature), args.tree,
                                    512, variant_impl or impl, args.draft_sampling)
        rows = [np.asarray(stream[start:start + ctx], np.int32) for start in batch_starts(args.batch)]
        tokens, lengths = pad_prompts(rows, plan(None).base.prompt_len)
        hlo_dir = os.path.join(args.out, "hlo", str(ctx)) if args.hlo else None
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
        results["contexts"][ctx] = {}
        profile_context(plan, stop, target.params, draft.weights, tokens, lengths, args.reps, args.variants,
                        hlo_dir, args.phases, out=results["contexts"][ctx],
                        on_variant=lambda: write_report(args.out, "bench_profile", results, markdown(results)),
                        compile_mode=args.compile)
    return results


def ablation_table(variants: dict) -> list[str]:
    """Markdown rows: each doubled part's wall (and GPU-busy) time per step over the default's, by phase."""
    base = variants.get("default", {})
    doubled = {v: rows for v, rows in variants.items() if v.startswith(ABLATE_PREFIX)}
    phases = [n for n, r in base.items() if "error" not in r]
    if not doubled or not phases:
        return []
    lines = ["\nMarginal cost in the round: the part computed twice, minus the default (us per step, wall (busy)):\n"]
    lines += md_header(["part (computed twice)"] + phases)
    for variant, rows in doubled.items():
        cells = [f"{rows[n]['wall_us'] - base[n]['wall_us']:+.1f} ({rows[n]['busy_us'] - base[n]['busy_us']:+.1f})"
                 if "error" not in rows.get(n, {"error": 1}) else "-" for n in phases]
        part = variant[len(ABLATE_PREFIX):]
        lines.append(md_row([f"{part}: {PARTS[part][2]}"] + cells))
    return lines


def markdown(results: dict, top: int = 12) -> str:
    lines = []
    for ctx, variants in results["contexts"].items():
        ablation = ablation_table(variants)
        if ablation:
            lines += [f"\n## {ctx} tokens: ablation"] + ablation
        for variant, rows in variants.items():
            lines.append(f"\n## {ctx} tokens, {variant}\n")
            lines += md_header(["phase", "wall us", "GPU busy us", "GPU idle us", "longest gap us (a call)",
                                "kernel sum us", "launches", "temp MiB"])
            lines += [md_row([n, f"{r['wall_us']:.1f}", f"{r['busy_us']:.1f}", f"{r['idle_us']:.1f}",
                              f"{r['longest_gap_us']:.1f}", f"{r['kernel_sum_us']:.1f}", f"{r['launches']:.0f}",
                              _mib(r.get("temp_mib"))])
                      for n, r in rows.items() if "error" not in r]
            for name, r in rows.items():
                if "error" in r:
                    continue
                for table, title in (("by_source", "by source (us/step, launches/step)"),
                                     ("idle_before", "idle before (us/step, gaps/step)"),
                                     ("idle_before_kernel", "idle before, by kernel")):
                    lines.append(f"\n{name}, {title}: " + "; ".join(
                        f"{x['what']} {x['us']:.1f} ({x['launches']:.0f})" for x in r[table][:top]))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = arg_parser("profile", __doc__, "tiny random pair on the CPU (CPU ops instead of GPU kernels)",
                   prog="python -m tools.profile")
    p.add_argument("--model", default="padded", choices=("padded", "llama3-8b"),
                   help="padded: the fixture pair padded to 8B cost; llama3-8b: random weights of Llama-3-8B shapes")
    p.add_argument("--contexts", default=None, help="prompt lengths (default 16384,32768; --smoke: 40)")
    p.add_argument("--new-tokens", type=int, default=256, help="planned new tokens (sets the cache capacity)")
    p.add_argument("--reps", type=int, default=None, help="steps per profiled call (default 20; --smoke: 2)")
    p.add_argument("--options", type=json_object_arg, default="{}",
                   help='JSON {variant: {xla option: value}} added to the default, '
                        'e.g. \'{"no_cmd_buffers": {"xla_gpu_enable_command_buffer": ""}}\'')
    p.add_argument("--ablate", type=parse_parts, default=(), metavar="PART,...",
                   help="one more variant per part, computed twice: its marginal cost in the round; parts: "
                        + ", ".join(PARTS))
    p.add_argument("--impls", type=names_arg(IMPLS, "attention impl"), default=(), metavar="IMPL,...",
                   help="one more variant per attention impl, after the default (--attention): e.g. --attention auto "
                        "--impls mosaic,auto times auto, mosaic, auto in one process; impls: " + ", ".join(IMPLS))
    p.add_argument("--mosaic", type=json_object_arg, default="{}", metavar="JSON",
                   help='JSON {variant: {MosaicConfig field: value}}: one more variant each, its Mosaic cache half of '
                        'calls above 128 folded rows with those fields (compute_wgs first, then the split rule), '
                        'e.g. \'{"wgs2": {"compute_wgs": 2}, "s6": {"num_splits": 6}}\'')
    p.add_argument("--verify-node-multiples", type=positive_ints_arg, default=(), metavar="M,...",
                   help="one more variant per M: verification on the tree padded to a multiple of M nodes "
                        f"(SpecSettings.verify_node_multiple; the default variant's is {VERIFY_NODE_MULTIPLE}), "
                        "e.g. 1: unpadded")
    p.add_argument("--draft-vocabs", type=positive_ints_arg, default=(), metavar="K,...",
                   help="one more variant per K: the draft proposes from a draft vocabulary of K token ids, e.g. "
                        "32768 of Llama-3's 128256")
    p.add_argument("--phases", default=None, metavar="PHASE,...",
                   help="phases to profile (default all: plain, draft_step0, tree_levelK, verify, round)")
    p.add_argument("--hlo", action="store_true",
                   help="also write each phase's compiled HLO module (what every kernel computes) under "
                        "OUT/hlo/CONTEXT/")
    add_compile_arg(p)
    add_pair_args(p)
    add_sampling_args(p)
    args = p.parse_args(argv)
    check_sampling_args(p, args)
    args.contexts = [int(x) for x in (args.contexts or ("40" if args.smoke else "16384,32768")).split(",") if x]
    args.reps = args.reps or (2 if args.smoke else 20)
    args.variants = {name: Variant(opts) for name, opts in {"default": {}, **args.options}.items()}
    args.variants.update({ABLATE_PREFIX + part: Variant({}, (part,)) for part in args.ablate})
    if len(set(args.impls)) < len(args.impls):
        p.error(f"--impls: each impl at most once, got {','.join(args.impls)}")
    args.variants.update({IMPL_PREFIX + impl: Variant({}, impl=impl) for impl in args.impls})
    for name, fields in args.mosaic.items():
        try:
            check_fields(fields)
        except ValueError as e:
            p.error(f"--mosaic {name}: {e}")
        args.variants[MOSAIC_PREFIX + name] = Variant({}, mosaic=tuple(sorted(fields.items())))
    args.variants.update({f"{NODES_PREFIX}{m}": Variant({}, verify_node_multiple=m)
                          for m in args.verify_node_multiples})
    args.variants.update({f"{VOCAB_PREFIX}{k}": Variant({}, draft_vocab=k) for k in args.draft_vocabs})
    args.phases = tuple(args.phases.split(",")) if args.phases else None
    known = phase_names(len(args.tree))
    unknown = sorted(set(args.phases or ()) - set(known))
    if unknown:
        p.error(f"--phases: unknown phase(s) {', '.join(unknown)}; with --tree {args.tree} choose from "
                f"{', '.join(known)}")
    if args.model == "padded":
        check_pair_args(p, args)
    elif args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(markdown(run(args)))  # run() has written the report after every variant
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
