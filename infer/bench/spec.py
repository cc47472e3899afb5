"""Speculative decoding on an 8B-cost pair: end-to-end tokens/s and tau against plain decoding, draft-state bytes.

    python -m infer.bench spec --out DIR --fixture FIXTURE_DIR --pad-script pad_model.py   # GPU
    python -m infer.bench spec --out DIR --smoke                                           # CPU, tiny, seconds

Model pair: the code-LM fixture padded by ``pad_model.py`` to Llama-3-8B-like cost (hidden 4608, MLP 14336,
32 layers, 72/18 heads of 64: 8.19 B parameters) computing the small model's function, and a LongSpec draft for
it (a randomly initialised small draft, padded by ``pad_model.py --draft``: 304 M parameters). The random draft
predicts poorly, so acceptance is also measured with the same draft steered by an oracle (the target's own
greedy continuation, exact or wrong at every 4th position) through ``Draft.logits_hook``: the draft still
runs in full, only its logits are replaced.

Prompt: source files of the dev-split repos (pygments, pyparsing, mpmath) concatenated, cut to each context
(from ``--stable-gap`` on: starting at an offset whose float32 greedy continuation has no near-tie, since in bf16
the plain and the speculative output may part at a near-tie, after which an oracle replaying the plain output
predicts the wrong text). With ``--batch B``, row b starts ``b * BATCH_STRIDE`` tokens after row 0 (with
``--stable-gap``: searched from there, each row on its own); tokens/s are
summed over the rows and tau is their mean. Where a speculative output differs from plain greedy, the float32
top-2 logit gap at the first difference is recorded (the small fixture computes the padded model's function).
The round is the reference's tree (4,16,16,16,16) at T=0 unless ``--tree`` says otherwise (the oracles replay
greedy output, so the runs are greedy). Every loop is compiled with autotuned kernels
(``generate(reproducible=False)``), or with ``--compile reproducible`` as ``generate()`` compiles by default
(:func:`infer.generate.compile_options`); ``--xla-options`` adds XLA options to the speculative compiles.
Timings: jitted functions, compile excluded, ``block_until_ready``, median over runs. The time of each phase of
a round: ``python -m tools.spec_phases`` (same pair and options).
"""

from __future__ import annotations

import dataclasses
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from infer.bench.harness import (add_sized_args, arg_parser, error_text, finish, json_object_arg, log, md_header,
                                 md_row, nbytes, parse_sized, run_header, time_runs, write_report)
from infer.bench.loops import add_compile_arg, plain_fns, speculative_fns
from infer.bench.near_tie import earliest_parting, float32_reference, partings
from infer.bench.spec_inputs import build_padded_pair, dev_prompt_tokens, stable_row_starts
from infer.decoding import Progress, StopCriteria
from infer.generate import pad_prompts, plan_speculative
from infer.main import positive_ints_arg, temperature_arg, tree_shape_arg
from infer.speculative import VERIFY_NODE_MULTIPLE
from longspec_jax.attention import IMPLS
from longspec_jax.draft import DraftWeights, draft_prefill
from longspec_jax.sampling import SamplingConfig
from longspec_jax.testing import oracle_hook, oracle_table

TREE = (4, 16, 16, 16, 16)
DRAFT_KINDS = ("random_draft", "oracle_exact", "oracle_wrong_every_4th")
BATCH_STRIDE = 4099  # tokens between the prompt starts of two batch rows
DEFAULTS = dict(contexts=(16384, 32768), new_tokens=256, reps=2)
SMOKE = dict(contexts=(40,), new_tokens=12, reps=1)


def add_pair_args(p) -> None:
    """The padded pair (``--fixture``, ``--pad-script``, ``--work``), its ``--attention`` impl, ``--batch`` and
    the round's ``--tree``: what :func:`load_pair` and the timed round read (the spec benchmark and the phase
    tools share them)."""
    p.add_argument("--fixture", help="the small code-LM fixture directory")
    p.add_argument("--pad-script", help="path of the fixture's pad_model.py")
    p.add_argument("--work", default="/tmp/longspec_bench", help="where the padded pair is written (reused)")
    p.add_argument("--attention", default="auto", choices=IMPLS,
                   help="attention impl of the padded pair (longspec_jax.attention; --smoke: xla)")
    p.add_argument("--batch", type=int, default=1, help="sequences per generate call (rows start BATCH_STRIDE apart)")
    p.add_argument("--tree", type=tree_shape_arg, default=TREE, metavar="C0,C1,...",
                   help="tree shape (default the reference's 4,16,16,16,16; 1,1,1,1 is a chain)")


def check_pair_args(p, args) -> None:
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if not args.smoke and not (args.fixture and args.pad_script):
        p.error("--fixture and --pad-script are required (or --smoke)")


def add_sampling_args(p) -> None:
    """``--temperature`` and ``--draft-sampling`` of a timed round (the phase tools; the spec benchmark's
    oracles replay greedy output)."""
    p.add_argument("--temperature", type=temperature_arg, default=0.0,
                   help="sampling temperature of the timed round and plain step (default 0: greedy)")
    p.add_argument("--draft-sampling", action="store_true",
                   help="a tree sampled from the draft, verified by recursive rejection sampling (--temperature > 0)")


def check_sampling_args(p, args) -> None:
    """What ``generate(draft_sampling=True)`` would refuse, as a command-line error before the pair loads."""
    if args.draft_sampling and SamplingConfig(args.temperature).greedy:
        p.error("--draft-sampling needs --temperature > 0")


def load_pair(args, stream_length: int):
    """(target, draft, prompt token stream of ``stream_length`` tokens, attention impl): the padded 8B-cost pair,
    or the tiny smoke pair."""
    from longspec_jax import load_draft, load_target

    if args.smoke:
        from longspec_jax.testing import random_draft, tiny_target
        target = tiny_target(0)
        stream = list(np.random.default_rng(0).integers(0, target.config.vocab_size, stream_length))
        return target, random_draft(1), stream, "xla"
    big, big_draft = build_padded_pair(args.fixture, args.pad_script, args.work)
    target = load_target(big, dtype=jnp.bfloat16)
    return (target, load_draft(big_draft, target), dev_prompt_tokens(target.tokenizer, stream_length),
            args.attention)


def batch_starts(batch: int) -> list[int]:
    """Where each batch row's prompt starts in the token stream (before any ``--stable-gap`` search)."""
    return [b * BATCH_STRIDE for b in range(batch)]


def batch_stream_length(context: int, batch: int, search: int = 0) -> int:
    """Tokens of the stream that ``batch`` rows of ``context`` tokens need, each searched ``search`` on."""
    return context + search + (batch - 1) * BATCH_STRIDE


def run(args) -> dict:
    results = run_header(tree_shape=list(args.tree), batch=args.batch, compile=args.compile,
                         xla_options=args.xla_options, verify_node_multiple=args.verify_node_multiple,
                         attention="xla" if args.smoke else args.attention, contexts={})
    t0 = time.perf_counter()
    target, draft, prompt_stream, impl = load_pair(args, batch_stream_length(max(args.contexts), args.batch,
                                                                           args.stable_search))
    results["load_s"] = time.perf_counter() - t0

    # the target's function in float32, for near-tie checks: the small fixture computes the padded model's
    reference32 = float32_reference(None if args.smoke else args.fixture, target)

    tparams = target.params
    cfg = target.config
    weight_bytes, draft_bytes = nbytes(tparams), nbytes(draft.variables)
    results.update(target_param_bytes=int(weight_bytes), draft_param_bytes=int(draft_bytes))
    log(f"target {weight_bytes / 1e9:.2f} GB, draft {draft_bytes / 1e9:.3f} GB, loaded in {results['load_s']:.0f} s")

    N_new = args.new_tokens
    # One settings object (capacity and padded prompt for the longest context) serves every context: one compile.
    settings = dataclasses.replace(
        plan_speculative(target, draft, max(args.contexts), N_new, SamplingConfig(), args.tree, 512, impl),
        verify_node_multiple=args.verify_node_multiple)
    base = settings.base
    stop = StopCriteria.make(N_new, [])
    key = jax.random.PRNGKey(0)
    weights = draft.weights

    plain_start, plain_run = plain_fns(base, stop, args.compile)
    real_fns = speculative_fns(settings, stop, args.compile, args.xla_options)
    oracle_fns = speculative_fns(dataclasses.replace(settings, draft=dataclasses.replace(settings.draft,
                                                                                         logits_hook=oracle_hook)),
                                 stop, args.compile, args.xla_options)

    for ctx in args.contexts:
        if time.perf_counter() - t0 > args.budget_s:
            log(f"budget of {args.budget_s:.0f} s spent: skipping context {ctx}")
            break
        row: dict = {}
        results["contexts"][ctx] = row
        starts = batch_starts(args.batch)
        if args.stable_gap > 0:
            found = stable_row_starts(reference32(), prompt_stream, ctx, N_new, args.stable_gap, args.stable_search,
                                      args.batch, BATCH_STRIDE)
            starts = [start for start, _ in found]
            row.update(prompt_starts=starts, min_f32_top2_gaps=[gap for _, gap in found])
            log(f"ctx {ctx}: prompt starts {starts}: smallest float32 top-2 gaps over the greedy continuations "
                + ", ".join(f"{gap:.3f}" for _, gap in found))
        prompts = [prompt_stream[start:start + ctx] for start in starts]
        tokens, lengths = pad_prompts([np.asarray(p, np.int32) for p in prompts], base.prompt_len)
        try:
            # -- plain decoding: the baseline, and the greedy continuation the oracle replays
            def start():
                first, cache, k = plain_start(tparams, tokens, lengths, key)
                return Progress.start(first, base.out_len, stop), cache, first, k

            sec, progress = time_runs(start, lambda st: plain_run(tparams, *st), args.reps)
            greedy_BxN = np.asarray(progress.tokens)[:, :N_new]
            rounds = int(progress.num_rounds[0])
            row["vanilla"] = dict(seconds=sec, decode_steps=rounds, tokens_per_s=args.batch * rounds / sec)
            row["decode_step_s"] = sec / rounds  # one plain decode step, inside the jitted loop
            log(f"ctx {ctx}: plain {row['vanilla']['tokens_per_s']:.1f} tok/s, step {row['decode_step_s']*1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["vanilla_error"] = error_text(e, 1500)
            continue
        slots = base.capacity + 64

        def oracle_weights(wrong_every: int, phase: int = 0):  # replays the plain greedy output
            return DraftWeights(draft.variables, jnp.asarray(oracle_table(
                prompts, list(greedy_BxN), slots, cfg.vocab_size, wrong_every=wrong_every, phase=phase)))

        kinds = dict(zip(DRAFT_KINDS, ((real_fns, lambda: weights), (oracle_fns, lambda: oracle_weights(0)),
                                       (oracle_fns, lambda: oracle_weights(4, 1)))))
        for name, ((start_fn, loop_fn), make_weights) in kinds.items():
            try:
                w = make_weights()
                sec, state = time_runs(lambda: start_fn(tparams, w, tokens, lengths, key),
                                       lambda st: loop_fn(tparams, w, st), args.reps)
                gen_B = np.asarray(state.progress.num_generated)
                rounds_B = np.asarray(state.progress.num_rounds)
                row_partings = partings(reference32, prompts, np.asarray(state.progress.tokens)[:, :N_new], greedy_BxN)
                first = earliest_parting(row_partings)
                tps = float((gen_B - 1).sum()) / sec
                row[name] = dict(seconds=sec, rounds=int(rounds_B.sum()), generated=int(gen_B.sum()),
                                 tau=float(np.mean(gen_B / (rounds_B + 1))), tokens_per_s=tps,
                                 speedup=tps / row["vanilla"]["tokens_per_s"],
                                 accept_counts=np.asarray(state.accept_counts).sum(0).tolist(),
                                 first_mismatch_vs_greedy=None if first is None else first["at"],
                                 partings=row_partings)
                del state
                if first is not None:  # is it a bf16 near-tie? float32 top-2 gap of the (same-function) small model
                    row[name]["top2_gap_at_mismatch_f32"] = first["f32_top2_gap"]
                log(f"ctx {ctx}: {name} tau {row[name]['tau']:.2f}, {row[name]['tokens_per_s']:.1f} tok/s "
                    f"({row[name]['speedup']:.2f}x), first mismatch {row[name]['first_mismatch_vs_greedy']}"
                    + (f" (float32 top-2 gap there {row[name]['top2_gap_at_mismatch_f32']:.4f})" if first is not None
                       else ""))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row[f"{name}_error"] = error_text(e, 1500)
        write_report(args.out, "bench_spec", results, markdown(results))

    try:
        results["draft_state_bytes"] = draft_state_bytes(settings, tparams, weights, prompt_stream, args.smoke)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        results["draft_state_error"] = error_text(e, 1500)
    return results


def draft_state_bytes(settings, tparams, weights, prompt_stream, smoke: bool) -> dict:
    """The draft's ring cache after prefilling a 4k and a 64k prompt: equal by construction."""
    config = settings.base.config
    out = {}
    for ctx in ((64, 256) if smoke else (4096, 65536)):
        reps = -(-ctx // len(prompt_stream))
        prompt_1xT = np.asarray((list(prompt_stream) * reps)[:ctx], np.int32)[None]
        ring = jax.jit(lambda p, d, t, l: draft_prefill(settings.draft, d, p, t, l))(
            tparams, weights, jnp.asarray(prompt_1xT), jnp.asarray([ctx], jnp.int32))
        out[str(ctx)] = dict(ring_bytes=int(ring.nbytes()), ring_slots=int(ring.pos.shape[1]),
                             target_kv_bytes=int(ctx * config.num_layers * 2 * config.num_kv_heads * config.head_dim
                                                 * jnp.dtype(tparams["embed"].dtype).itemsize))
    return out


def markdown(results: dict) -> str:
    lines = md_header(["context", "vanilla tok/s", "draft", "tau", "tok/s", "speedup", "first mismatch"])
    for ctx, row in results["contexts"].items():
        for name in DRAFT_KINDS:
            if name in row and "vanilla" in row:
                r = row[name]
                lines.append(md_row([ctx, f"{row['vanilla']['tokens_per_s']:.1f}", name, f"{r['tau']:.2f}",
                                     f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                                     r["first_mismatch_vs_greedy"]]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = arg_parser("spec", __doc__, "tiny random pair on the CPU")
    add_pair_args(p)
    add_sized_args(p, (("contexts", positive_ints_arg, "prompt lengths"),
                       ("new-tokens", int, "tokens per generation"), ("reps", int, "timed generation runs")),
                   DEFAULTS, SMOKE)
    p.add_argument("--stable-gap", type=float, default=0.0,
                   help="start each prompt at the first offset whose float32 greedy continuation has no top-2 "
                        "logit gap below this (0 = offset 0)")
    p.add_argument("--stable-search", type=int, default=0,
                   help="largest prompt offset tried for --stable-gap (per row)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new context after this")
    add_compile_arg(p)
    p.add_argument("--verify-node-multiple", type=int, default=VERIFY_NODE_MULTIPLE, metavar="M",
                   help="verify the tree padded to a multiple of M nodes (SpecSettings.verify_node_multiple; "
                        f"default {VERIFY_NODE_MULTIPLE}, 1: unpadded)")
    p.add_argument("--xla-options", type=json_object_arg, default={}, metavar="JSON",
                   help="XLA options added to the speculative loop's compile, e.g. "
                        '\'{"xla_gpu_experimental_force_split_k": 1}\'')
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    if args.verify_node_multiple < 1:
        p.error(f"--verify-node-multiple must be >= 1, got {args.verify_node_multiple}")
    check_pair_args(p, args)
    results = run(args)
    return finish(args.out, "spec", results, markdown(results))
