"""Tensor-parallel decoding: plain and speculative tokens/s on N devices against one, and the longest context
that fits on each.

    python -m infer.bench shard --out DIR          # every visible GPU against one: Llama-3-8B shapes, 32k context
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m infer.bench shard --out DIR --smoke   # CPU

Model: Llama-3-8B shapes (32 layers, d 4096, 32/8 heads of 128, MLP 14336, vocab 128256, untied), random bf16
weights made on the devices: over N devices sharded (``longspec_jax.tensor_parallel``: grouped fused layout,
attention per shard), on one device the plain single-device target (no mesh). Draft: a random LongSpec draft of
the target's shapes steered by an oracle (:mod:`longspec_jax.testing`) towards the plain greedy output, wrong at
every 4th position (realistic acceptance lengths; the draft still runs in full). Batch 1, greedy, random prompt.

Timed (:func:`infer.bench.harness.time_runs`: compile and prefill excluded, median of ``--reps``): the plain and
the speculative loop from their post-prefill states, ``--new-tokens`` tokens each, compiled as ``generate()`` compiles
them (``--compile``, :mod:`infer.bench.loops`). Fit: KV caches of
``--fit-from``, 2x, 4x, ... slots (at most ``--fit-max``) are allocated and ``--fit-steps`` decode steps run
reading all of it, until the first out-of-memory error (chunked prefill's working memory is bounded by its
chunk, so weights and cache set the longest context). JAX preallocates 75% of each GPU: set
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` to let the fit search use more.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from infer.bench.decode import LLAMA3_8B, TINY
from infer.bench.harness import (add_sized_args, arg_parser, error_text, finish, log, md_header, md_row, parse_sized,
                                 run_header, time_loop, time_runs, write_report)
from infer.bench.loops import add_compile_arg, plain_fns, speculative_fns
from infer.bench.near_tie import first_divergence
from infer.decoding import DecodeSettings, Progress, StopCriteria
from infer.generate import on_mesh, pad_prompts, plan_speculative
from infer.main import tree_shape_arg
from infer.plain import decode_step
from longspec_jax.draft import DraftConfig, DraftWeights, init_draft
from longspec_jax.kv_cache import init_cache
from longspec_jax.mesh import make_mesh
from longspec_jax.sampling import SamplingConfig
from longspec_jax.target import Target
from longspec_jax.tensor_parallel import shard_draft
from longspec_jax.testing import oracle_hook, oracle_table, random_target

DEFAULTS = dict(context=32768, new_tokens=128, reps=2, tree=(4, 16, 16, 16, 16), fit_from=32768, fit_max=4 * 2**20,
                fit_steps=8)
SMOKE = dict(context=64, new_tokens=8, reps=1, tree=(2, 2), fit_from=64, fit_max=256, fit_steps=2)
# (dtype, weight std): bf16 at 8B shapes; the smoke model in float32 with spread logits (no near-ties), so its
# outputs on 1 and N devices, plain and speculative, are equal.
WEIGHTS = {False: (jnp.bfloat16, 0.02), True: (jnp.float32, 0.3)}


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "resource_exhausted" in text or "out of memory" in text


def decode_speed(args, n: int, target: Target, tokens_1xT: np.ndarray, plain_tokens) -> tuple[dict, np.ndarray]:
    """Plain and speculative tokens/s of ``target`` at the prompt's context, on its mesh, and its plain greedy
    tokens (compared with ``plain_tokens``, one device's, when given)."""
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(1), dtype=target.dtype)
    if target.mesh is not None:
        draft = shard_draft(draft, target.mesh)
    settings = plan_speculative(target, draft, args.context, args.new_tokens, SamplingConfig(), args.tree, 512,
                                "auto")
    settings = dataclasses.replace(settings, draft=dataclasses.replace(settings.draft, logits_hook=oracle_hook))
    base, stop, key = settings.base, StopCriteria.make(args.new_tokens, []), jax.random.PRNGKey(0)
    params = target.params
    tokens, lengths = pad_prompts([tokens_1xT], base.prompt_len)
    row: dict = {}
    with on_mesh(target.mesh):
        plain_start, plain_run = plain_fns(base, stop, args.compile)

        def start():
            first, cache, k = plain_start(params, tokens, lengths, key)
            return Progress.start(first, base.out_len, stop), cache, first, k

        sec, progress = time_runs(start, lambda st: plain_run(params, *st), args.reps)
        greedy = np.asarray(progress.tokens)[0, :args.new_tokens]
        steps = int(progress.num_rounds[0])
        row["plain"] = dict(seconds=sec, tokens_per_s=steps / sec, ms_per_token=1e3 * sec / steps,
                            first_mismatch_vs_1_device=None if plain_tokens is None
                            else first_divergence(greedy, plain_tokens))
        del progress
        log(f"{n} device(s): plain {row['plain']['tokens_per_s']:.1f} tok/s")
        weights = DraftWeights(draft.variables, jnp.asarray(oracle_table(
            [tokens_1xT], [greedy], base.capacity + 64, target.config.vocab_size, wrong_every=4, phase=1)))
        spec_start, spec_run = speculative_fns(settings, stop, args.compile)
        sec, state = time_runs(lambda: spec_start(params, weights, tokens, lengths, key),
                               lambda st: spec_run(params, weights, st), args.reps)
        generated, rounds = int(state.progress.num_generated[0]), int(state.progress.num_rounds[0])
        row["speculative"] = dict(seconds=sec, tau=generated / (rounds + 1), tokens_per_s=(generated - 1) / sec,
                                  speedup_vs_plain=(generated - 1) / sec / row["plain"]["tokens_per_s"],
                                  first_mismatch_vs_plain=first_divergence(
                                      np.asarray(state.progress.tokens)[0, :args.new_tokens], greedy))
        log(f"{n} device(s): speculative {row['speculative']['tokens_per_s']:.1f} tok/s, tau "
            f"{row['speculative']['tau']:.2f}")
    return row, greedy


def fits(args, target: Target, capacity: int) -> dict:
    """A KV cache of ``capacity`` slots and ``--fit-steps`` decode steps reading all of it: ms per step."""
    cfg = target.config
    settings = DecodeSettings(config=cfg, sampling=SamplingConfig(), capacity=capacity, prefill_chunk=512,
                              out_len=args.fit_steps, prompt_len=512, impl="auto")

    def step(carry, params):
        cache, last_B, key = carry
        key, sub = jax.random.split(key)
        token_B, cache = decode_step(params, settings, cache, last_B, sub)
        return cache.replace(lengths=cache.lengths + 1), token_B, key

    with on_mesh(target.mesh):
        cache = jax.jit(lambda: init_cache(cfg.num_layers, 1, capacity, cfg.num_kv_heads, cfg.head_dim,
                                           target.dtype).replace(
            lengths=jnp.full((1,), capacity - args.fit_steps - 1, jnp.int32)))()
        t, carry = time_loop(step, (cache, jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0)), (target.params,),
                             reps=args.fit_steps)
    del carry
    return dict(ms_per_token=1e3 * t.per_step_s)


def fit_search(args, n: int, target: Target) -> dict:
    out, capacity = {}, args.fit_from
    while capacity <= args.fit_max:
        try:
            out[capacity] = fits(args, target, capacity)
            log(f"{n} device(s): context {capacity} fits ({out[capacity]['ms_per_token']:.2f} ms per decode step)")
        except Exception as e:  # noqa: BLE001
            out[capacity] = dict(error=error_text(e, 500), oom=is_oom(e))
            log(f"{n} device(s): context {capacity}: {'out of memory' if is_oom(e) else 'failed'}")
            if not is_oom(e):
                traceback.print_exc()
            break
        finally:
            gc.collect()
        capacity *= 2
    fitted = [c for c, r in out.items() if "error" not in r]
    return dict(largest_context=max(fitted, default=None), contexts=out)


def run(args) -> dict:
    shapes = TINY if args.smoke else LLAMA3_8B
    devices = jax.devices()[:args.devices]
    results = run_header(shapes=shapes, context=args.context, new_tokens=args.new_tokens, tree_shape=list(args.tree),
                         compile=args.compile, runs={})
    tokens_1xT = np.random.default_rng(0).integers(0, shapes["vocab_size"], args.context).astype(np.int32)
    plain_tokens = None
    for n in dict.fromkeys((1, len(devices))):
        t0 = time.perf_counter()
        target = random_target(shapes, None if n == 1 else make_mesh(n, 1, devices[:n]), *WEIGHTS[args.smoke])
        jax.block_until_ready(target.params)
        row = results["runs"][n] = {"build_s": time.perf_counter() - t0}
        try:
            speed, greedy = decode_speed(args, n, target, tokens_1xT, plain_tokens)
            row.update(speed)
            plain_tokens = greedy if plain_tokens is None else plain_tokens
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = error_text(e, 1500)
        gc.collect()
        row["fit"] = fit_search(args, n, target)
        del target
        gc.collect()
        write_report(args.out, "bench_shard", results, markdown(results))
    return results


def markdown(results: dict) -> str:
    lines = [f"Tensor-parallel decoding, {results['date']}, {results['device']}, jax {results['jax']}: context "
             f"{results['context']}, {results['new_tokens']} new tokens, tree {tuple(results['tree_shape'])}, "
             f"oracle draft wrong every 4th.", ""]
    lines += md_header(["devices", "plain tok/s", "plain ms/token", "spec tok/s", "tau", "spec / plain",
                        "plain tokens = 1 device", "largest context fitting"])
    for n, row in results["runs"].items():
        plain, spec = row.get("plain"), row.get("speculative")
        same = "-" if not plain or n == 1 else ("yes" if plain["first_mismatch_vs_1_device"] is None
                                                 else f"no (from {plain['first_mismatch_vs_1_device']})")
        lines.append(md_row([n, f"{plain['tokens_per_s']:.1f}" if plain else "error",
                             f"{plain['ms_per_token']:.2f}" if plain else "-",
                             f"{spec['tokens_per_s']:.1f}" if spec else "-", f"{spec['tau']:.2f}" if spec else "-",
                             f"{spec['speedup_vs_plain']:.2f}x" if spec else "-", same,
                             row.get("fit", {}).get("largest_context")]))
    lines += ["", "Decode step at each context (ms; OOM: out of memory):", ""]
    contexts = sorted({c for row in results["runs"].values() for c in row.get("fit", {}).get("contexts", {})})
    lines += md_header(["devices"] + contexts)
    for n, row in results["runs"].items():
        cells = row.get("fit", {}).get("contexts", {})
        lines.append(md_row([n] + [("OOM" if cells[c].get("oom") else "error") if "error" in cells.get(c, {})
                                   else f"{cells[c]['ms_per_token']:.2f}" if c in cells else "-" for c in contexts]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = arg_parser("shard", __doc__, "tiny shapes on the CPU (several devices: set XLA_FLAGS before starting)")
    p.add_argument("--devices", type=int, default=None, help="devices of the sharded runs (default: all)")
    add_compile_arg(p)
    add_sized_args(p, (("context", int, "prompt tokens of the speed runs"),
                       ("new-tokens", int, "tokens per generation"), ("reps", int, "timed runs (median)"),
                       ("tree", tree_shape_arg, "speculative tree shape"), ("fit-from", int, "first context tried"),
                       ("fit-max", int, "last context tried"), ("fit-steps", int, "decode steps per try")),
                   DEFAULTS, SMOKE)
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    args.devices = args.devices or jax.device_count()
    if not 1 <= args.devices <= jax.device_count():
        p.error(f"--devices must be between 1 and the {jax.device_count()} visible devices")
    results = run(args)
    return finish(args.out, "shard", results, markdown(results))
