"""Speculative decoding on the H200: per-round phase times, end-to-end tokens/s and tau, draft-state bytes.

    python -m infer.bench_spec --out DIR --fixture FIXTURE_DIR --pad-script pad_model.py   # GPU
    python -m infer.bench_spec --out DIR --smoke                                           # CPU, tiny, seconds

Model pair: the code-LM fixture padded by ``pad_model.py`` to Llama-3-8B-like cost (hidden 4608, MLP 14336,
32 layers, 72/18 heads of 64: 8.19 B parameters) computing the small model's function, and a LongSpec draft for
it (a randomly initialised small draft, padded by ``pad_model.py --draft``: 304 M parameters). The random draft
predicts poorly, so acceptance is also measured with the same draft steered by an oracle (the target's own
greedy continuation, exact or wrong at every 4th position) through ``Draft.logits_hook``: the draft still
runs in full, only its logits are replaced.

Prompt: source files of the dev-split repos (pygments, pyparsing, mpmath) concatenated, cut to each context
(from ``--stable-gap`` on: starting at an offset whose float32 greedy continuation has no near-tie, since in bf16
the plain and the speculative output may part at a near-tie, after which an oracle replaying the plain output
predicts the wrong text). Where a speculative output differs from plain greedy, the float32 top-2 logit gap at
the first difference is recorded (the small fixture computes the padded model's function).
Timings: jitted functions, compile excluded, ``block_until_ready``. Generation loops: median over runs. Phases:
each phase repeated ``--phase-reps`` times inside one jitted ``fori_loop`` from the post-prefill state (carries
such as the KV cache updated in place), so no per-call dispatch or cache copy is counted; the phases of the two
commit schemes are timed in turn, ``--commit-repeats`` times.

H200 runs of 2026-11-29 (docs/benchmarks.md section 3):
    python -m infer.bench_spec --out DIR --fixture F --pad-script P                 # 16k + 32k, ~7 min
    python -m infer.bench_spec --out DIR --fixture F --pad-script P --contexts 32768 --phase-contexts "" \
        --e2e-contexts 32768 --stable-gap 0.25 --stable-search 16384             # 32k tokens/s, ~5 min
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from infer.generate import pad_prompts
from infer.near_tie import first_divergence, greedy_top2_gaps, top2_logit_gap
from infer.speculative import (SpecSettings, DraftWeights, commit, compact_path, draft_prefill, draft_root, exact_acceptance,
                               grow_tree, plan_speculative, spec_round, speculative_loop, speculative_start,
                               start_tree, verify, Tree)
from infer.vanilla import Progress, StopCriteria, prefill_and_first_token, vanilla_loop
from longspec_jax.kv_cache import KVCache
from longspec_jax.oracle import oracle_hook, oracle_table
from longspec_jax.sampling import SamplingConfig
from longspec_jax.tree import TreeSpec

PAD_ARGS = ["--hidden-size", "4608", "--intermediate-size", "14336", "--num-layers", "32", "--num-heads", "72",
            "--num-kv-heads", "18"]
DEV_REPOS = ("pygments", "pyparsing", "mpmath")
TREE = (4, 16, 16, 16, 16)


def log(msg: str) -> None:
    print(f"[bench_spec {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timeit(fn, args, reps: int, chain=None):
    """Median seconds of ``fn(*args)`` after a warm-up call, and the last output; ``chain(out) -> args`` feeds
    each output back as the next call's arguments (for donated buffers)."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        if chain is not None:
            args = chain(out)
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def time_loop(start, loop, reps: int):
    """Median seconds of ``loop(start())`` over ``reps`` runs (``start`` untimed), after one warm-up run."""
    times = []
    for i in range(reps + 1):
        state = start()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state = loop(state)
        jax.block_until_ready(state)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), state


# --------------------------------------------------------------------------------------------------- models

def build_padded_pair(fixture: str, pad_script: str, work: str):
    """Pads the fixture and a random small draft to 8B-like cost (reuses WORK if already built)."""
    from longspec_jax import load_target, save_draft
    from longspec_jax.draft import DraftConfig, init_draft

    big, small_draft, big_draft = (os.path.join(work, n) for n in ("big", "small_draft", "big_draft"))
    if not os.path.isfile(os.path.join(big_draft, "model.safetensors")):
        os.makedirs(work, exist_ok=True)
        small = load_target(fixture, dtype=jnp.float32, load_tokenizer=False)
        draft = init_draft(DraftConfig.from_target(small.config), jax.random.PRNGKey(0))
        save_draft(draft, small_draft, format="hf", target=small)
        for cmd in ([sys.executable, pad_script, fixture, big, "--overwrite", *PAD_ARGS],
                    [sys.executable, pad_script, "--draft", small_draft, big, big_draft, "--overwrite"]):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            log(f"{os.path.basename(pad_script)} {'--draft ' if '--draft' in cmd else ''}took "
                f"{time.perf_counter() - t0:.0f} s")
    return big, big_draft


def dev_prompt_tokens(tokenizer, count: int) -> list[int]:
    """The dev-split repos' source, concatenated in sorted path order with corpus-style header lines."""
    ids: list[int] = []
    for repo in DEV_REPOS:
        try:
            module = __import__(repo)
        except ImportError:
            continue
        root = os.path.dirname(module.__file__)
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f"# {repo}/{os.path.relpath(path, root)}\n{f.read()}\n"
            ids.extend(tokenizer(text)["input_ids"])
            if len(ids) >= count:
                return ids[:count]
    raise RuntimeError(f"only {len(ids)} tokens of dev-split source found")


# ------------------------------------------------------------------------------------------------ benchmark

def last_layer_commit(cache: KVCache, path_BxA, count_B, active_B) -> KVCache:
    """The reference's alternative: compact only the last layer (the others recompute next round)."""
    root = cache.lengths
    k, v = list(cache.k), list(cache.v)
    k[-1], v[-1] = compact_path(k[-1], path_BxA, root), compact_path(v[-1], path_BxA, root)
    return cache.replace(k=tuple(k), v=tuple(v), lengths=jnp.where(active_B, root + count_B, root))


def recompute_settings(settings: SpecSettings, B: int) -> tuple[SpecSettings, Tree]:
    """Settings and a tree with A = depth + 1 more nodes: what the last-layer scheme verifies each round
    (the accepted tokens again). Only shapes matter for timing."""
    shape = settings.tree.shape
    spec = TreeSpec(shape[:-1] + (shape[-1] + settings.tree.max_accept,))
    N, V = spec.num_nodes, settings.base.config.vocab_size
    tree = Tree(tokens=jnp.zeros((B, N), jnp.int32), parents=jnp.zeros((B, N), jnp.int32),
                mask=jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool)), (B, N, N)),
                draft_logp=jnp.zeros((B, N, V), jnp.float32))
    return dataclasses.replace(settings, tree=spec), tree


def run(args) -> dict:
    from longspec_jax import load_draft, load_target

    results: dict = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
                     "jax": jax.__version__, "tree_shape": list(TREE), "contexts": {}}
    t0 = time.perf_counter()
    if args.smoke:
        from tests.spec_helpers import random_draft, tiny_target
        target, draft = tiny_target(0), random_draft(1)
        prompt_stream = list(np.random.default_rng(0).integers(0, target.config.vocab_size,
                                                                max(args.contexts) + args.stable_search))
        impl = "xla"
    else:
        big, big_draft = build_padded_pair(args.fixture, args.pad_script, args.work)
        target = load_target(big, dtype=jnp.bfloat16)
        draft = load_draft(big_draft, target)
        prompt_stream = dev_prompt_tokens(target.tokenizer, max(args.contexts) + args.stable_search)
        impl = "auto"
    results["load_s"] = time.perf_counter() - t0

    @functools.cache
    def reference32():
        """The target's function in float32, for near-tie checks: the small fixture (the padded model computes
        the same function), or the tiny model itself in smoke mode."""
        return target if args.smoke else load_target(args.fixture, dtype=jnp.float32, load_tokenizer=False)

    tparams = target.params
    cfg = target.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(tparams))
    draft_bytes = sum(x.nbytes for x in jax.tree.leaves(draft.variables))
    results.update(target_param_bytes=int(weight_bytes), draft_param_bytes=int(draft_bytes))
    log(f"target {weight_bytes / 1e9:.2f} GB, draft {draft_bytes / 1e9:.3f} GB, loaded in {results['load_s']:.0f} s")

    N_new = args.new_tokens
    greedy = SamplingConfig()
    # One settings object (capacity and padded prompt for the longest context) serves every context: one compile.
    settings = plan_speculative(target, draft, max(args.contexts), N_new, greedy, TREE, 512, impl)
    base = settings.base
    stop = StopCriteria.make(N_new, [])
    key = jax.random.PRNGKey(0)
    dvars = DraftWeights(variables=draft.variables)

    vanilla_start = jax.jit(lambda p, t, l, k: prefill_and_first_token(p, base, t, l, k))
    vanilla_run = jax.jit(lambda p, pr, c, last, k: vanilla_loop(p, base, stop, pr, c, last, k), donate_argnums=2)

    def spec_fns(s: SpecSettings):
        start = jax.jit(lambda p, d, t, l, k: speculative_start(s, p, d, t, l, stop, k))
        loop = jax.jit(lambda p, d, st: speculative_loop(s, p, d, stop, st), donate_argnums=2)
        return start, loop

    real_fns = spec_fns(settings)
    oracle_settings = dataclasses.replace(settings, logits_hook=oracle_hook)
    oracle_fns = spec_fns(oracle_settings)

    for ctx in args.contexts:
        if time.perf_counter() - t0 > args.budget_s:
            log(f"budget of {args.budget_s:.0f} s spent: skipping context {ctx}")
            break
        row: dict = {}
        results["contexts"][ctx] = row
        offset = 0
        if args.stable_gap > 0 and ctx in args.e2e_contexts:
            offset, min_gap = stable_prompt_offset(reference32(), prompt_stream, ctx, N_new, args.stable_gap,
                                                   args.stable_search)
            row.update(prompt_offset=offset, min_f32_top2_gap=min_gap)
            log(f"ctx {ctx}: prompt offset {offset}: smallest float32 top-2 gap over the greedy continuation "
                f"{min_gap:.3f}")
        prompt = prompt_stream[offset:offset + ctx]
        tokens, lengths = pad_prompts([np.asarray(prompt, np.int32)], base.prompt_len)
        try:
            # -- plain decoding: the baseline, and the greedy continuation the oracle replays
            def start():
                first, cache, k = vanilla_start(tparams, tokens, lengths, key)
                return Progress.start(first, base.out_len, stop), cache, first, k

            sec, progress = time_loop(start, lambda st: vanilla_run(tparams, *st), args.reps)
            greedy_tokens = np.asarray(progress.tokens)[0, :N_new]
            rounds = int(progress.num_rounds[0])
            row["vanilla"] = dict(seconds=sec, decode_steps=rounds, tokens_per_s=rounds / sec)
            row["decode_step_s"] = sec / rounds  # one plain decode step, inside the jitted loop
            log(f"ctx {ctx}: vanilla {row['vanilla']['tokens_per_s']:.1f} tok/s, step {row['decode_step_s']*1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["vanilla_error"] = f"{type(e).__name__}: {e}"[:1500]
            continue

        if ctx in args.phase_contexts and time.perf_counter() - t0 < args.budget_s:
            try:
                row["phases"] = phase_times(settings, tparams, dvars, tokens, lengths, stop, key, args.phase_reps,
                                            real_fns[0], args.commit_repeats)
                log(f"ctx {ctx}: phases " + ", ".join(f"{k} {v*1e3:.2f} ms" for k, v in row["phases"].items()
                                                      if k != "samples"))
                log(f"ctx {ctx}: commit-scheme samples (ms) " + "; ".join(
                    f"{k} " + " ".join(f"{t * 1e3:.3f}" for t in v) for k, v in row["phases"]["samples"].items()))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["phases_error"] = f"{type(e).__name__}: {e}"[:1500]
        slots = base.capacity + 64

        def oracle_weights(wrong_every: int, phase: int = 0):  # replays the plain greedy output
            return DraftWeights(draft.variables, jnp.asarray(oracle_table(
                [prompt], [greedy_tokens], slots, cfg.vocab_size, wrong_every=wrong_every, phase=phase)))

        kinds = {} if ctx not in args.e2e_contexts else {
            "random_draft": (real_fns, lambda: dvars),
            "oracle_exact": (oracle_fns, lambda: oracle_weights(0)),
            "oracle_wrong_every_4th": (oracle_fns, lambda: oracle_weights(4, 1))}
        for name, ((start_fn, loop_fn), make_weights) in kinds.items():
            try:
                weights = make_weights()
                sec, state = time_loop(lambda: start_fn(tparams, weights, tokens, lengths, key),
                                       lambda st: loop_fn(tparams, weights, st), args.reps)
                gen = int(state.progress.num_generated[0])
                rounds = int(state.progress.num_rounds[0])
                out = np.asarray(state.progress.tokens)[0, :N_new]
                first = first_divergence(out, greedy_tokens)
                row[name] = dict(seconds=sec, rounds=rounds, generated=gen, tau=gen / (rounds + 1),
                                 tokens_per_s=(gen - 1) / sec,
                                 speedup=((gen - 1) / sec) / row["vanilla"]["tokens_per_s"],
                                 accept_counts=np.asarray(state.accept_counts)[0].tolist(),
                                 first_mismatch_vs_greedy=first)
                del state
                if first is not None:  # is it a bf16 near-tie? float32 top-2 gap of the (same-function) small model
                    row[name]["top2_gap_at_mismatch_f32"] = top2_logit_gap(
                        reference32(), list(prompt) + [int(t) for t in greedy_tokens[:first]])
                log(f"ctx {ctx}: {name} tau {row[name]['tau']:.2f}, {row[name]['tokens_per_s']:.1f} tok/s "
                    f"({row[name]['speedup']:.2f}x), first mismatch {first}"
                    + (f" (float32 top-2 gap there {row[name]['top2_gap_at_mismatch_f32']:.4f})" if first is not None
                       else ""))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:1500]
        write_outputs(args.out, results)

    try:
        results["draft_state_bytes"] = draft_state_bytes(settings, tparams, dvars, prompt_stream, args.smoke)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        results["draft_state_error"] = f"{type(e).__name__}: {e}"[:1500]
    return results


def stable_prompt_offset(target32, stream, ctx: int, num_new: int, min_gap: float, search: int,
                         step: int = 2048) -> tuple[int, float]:
    """First offset (a multiple of ``step`` up to ``search``) of a ``ctx``-token prompt from ``stream`` whose
    float32 greedy continuation of ``num_new`` tokens has no top-2 logit gap below ``min_gap``: bf16 paths then
    cannot part (no near-tie), so an oracle replaying the plain output stays valid. Falls back to the offset
    with the largest smallest gap."""
    best = (0, -1.0)
    for offset in range(0, search + 1, step):
        prompt = stream[offset:offset + ctx]
        if len(prompt) < ctx:
            break
        smallest = float(greedy_top2_gaps(target32, prompt, num_new)[1].min())
        if smallest >= min_gap:
            return offset, smallest
        best = max(best, (offset, smallest), key=lambda x: x[1])
    return best


@functools.cache
def loop_runner(step, reps: int):
    """jit(carry, *consts) -> carry after ``reps`` steps inside one ``fori_loop``; the carry is donated. Cached,
    so timing the same step function again does not recompile."""
    return jax.jit(lambda c, *k: jax.lax.fori_loop(0, reps, lambda i, x: step(x, *k), c), donate_argnums=0)


def loop_time(step, carry, consts, reps: int) -> tuple[float, object]:
    """Seconds per ``carry = step(carry, *consts)``, repeated ``reps`` times inside one jitted ``fori_loop``
    (no per-call dispatch; the carry, e.g. a KV cache, is donated and updated in place). Every step reads the
    carry, so nothing can be hoisted out of the loop. Returns the time and the final carry."""
    run = loop_runner(step, reps)
    carry = run(carry, *consts)  # compile (first use) + warm-up
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    carry = run(carry, *consts)
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) / reps, carry


def phase_times(settings: SpecSettings, tparams, dvars, tokens, lengths, stop, key, reps, start_fn,
                commit_repeats: int = 3) -> dict:
    """Each phase of one round, repeated inside a jitted loop from the post-prefill state.

    Parameters are passed as arguments, never closed over (a closure would make the weights compile-time
    constants)."""
    spec = settings.tree
    B = tokens.shape[0]
    phases: dict = {}
    state = start_fn(tparams, dvars, tokens, lengths, key)
    root = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]

    def step0(carry, p, d):
        st, _ = carry
        logp, ring = draft_root(settings, d, p, st)
        return st.replace(ring=ring), logp

    logp0 = jnp.zeros((B, settings.base.config.vocab_size), jnp.float32)
    phases["draft_step0"], (state, logp_root) = loop_time(step0, (state, logp0), (tparams, dvars), reps)

    def level1(builder, r, lp):
        # reads the carry so the loop cannot hoist it: a zero that XLA cannot fold away
        return start_tree(settings, r, lp + builder.scores[:, :1] * 1e-30)

    builder = start_tree(settings, root, logp_root)
    phases["tree_level1_topk"], builder = loop_time(level1, builder, (root, logp_root), reps)
    for k in range(1, spec.depth):
        grow = functools.partial(lambda k, b, p, d, c, rg: grow_tree(settings, d, p, c, rg, b, k), k)
        # growing level k again only rewrites level k + 1: the final carry is the grown tree
        phases[f"tree_level{k + 1}"], builder = loop_time(grow, builder, (tparams, dvars, state.cache, state.ring),
                                                          reps)
    tree = builder.tree
    cache = state.cache
    del state

    def verify_step(carry, p, t, s=settings):
        logits, cache = verify(s, p, carry[1], t)
        return logits, cache

    V = settings.base.config.vocab_size
    zeros = jnp.zeros((B, spec.num_nodes, V), jnp.float32)
    alt_settings, alt_tree = recompute_settings(settings, B)
    alt_zeros = jnp.zeros((B, alt_settings.tree.num_nodes, V), jnp.float32)
    _, (logits, cache) = loop_time(verify_step, (zeros, cache), (tparams, tree), 1)
    zeros = jnp.zeros_like(logits)
    acc = exact_acceptance(tree, logits, key, settings)

    def accept_step(acc_carry, t, lg, k):
        return exact_acceptance(t, lg + acc_carry.count_B[:, None, None] * 1e-30, k, settings)

    phases["accept"], acc = loop_time(accept_step, acc, (tree, logits, key), reps)
    # The two commit schemes differ by a few hundredths of a millisecond: their four phases are timed in
    # turn, ``commit_repeats`` times, and the medians kept (all samples under "samples").
    inactive = jnp.zeros((B,), bool)  # commit without advancing the lengths, so it can repeat
    samples: dict = {k: [] for k in ("verify", "verify_with_recompute", "commit_all_layers", "commit_last_layer")}
    verify_alt = functools.partial(verify_step, s=alt_settings)
    commit_args = (acc.path_BxA, acc.count_B, inactive)
    for _ in range(commit_repeats):  # carries are donated: keep the returned ones
        t, (zeros, cache) = loop_time(verify_step, (zeros, cache), (tparams, tree), reps)
        samples["verify"].append(t)
        t, (alt_zeros, cache) = loop_time(verify_alt, (alt_zeros, cache), (tparams, alt_tree), reps)
        samples["verify_with_recompute"].append(t)
        for name, fn in (("commit_all_layers", commit), ("commit_last_layer", last_layer_commit)):
            t, cache = loop_time(fn, cache, commit_args, reps)
            samples[name].append(t)
    for name, ts in samples.items():
        phases[name] = statistics.median(ts)
    phases["samples"] = samples
    del cache, logits, zeros, alt_zeros
    state = start_fn(tparams, dvars, tokens, lengths, key)
    phases["full_round"], state = loop_time(lambda st, p, d: spec_round(settings, p, d, stop, st), state,
                                            (tparams, dvars), reps)
    return phases


def draft_state_bytes(settings: SpecSettings, tparams, dvars, prompt_stream, smoke: bool) -> dict:
    """The draft's ring cache after prefilling a 4k and a 64k prompt: equal by construction."""
    out = {}
    for ctx in ((64, 256) if smoke else (4096, 65536)):
        reps = -(-ctx // len(prompt_stream))
        prompt = np.asarray((list(prompt_stream) * reps)[:ctx], np.int32)[None]
        ring = jax.jit(lambda p, d, t, l: draft_prefill(settings, d, p, t, l))(
            tparams, dvars, jnp.asarray(prompt), jnp.asarray([ctx], jnp.int32))
        out[str(ctx)] = dict(ring_bytes=int(ring.nbytes()), ring_slots=int(ring.pos.shape[1]),
                             target_kv_bytes=int(ctx * settings.base.config.num_layers * 2 *
                                                 settings.base.config.num_kv_heads * settings.base.config.head_dim *
                                                 jnp.dtype(tparams["embed"].dtype).itemsize))
    return out


def write_outputs(out_dir: str, results: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_spec.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    lines = ["| context | vanilla tok/s | draft | tau | tok/s | speedup | first mismatch |", "|---|---|---|---|---|---|---|"]
    for ctx, row in results["contexts"].items():
        for name in ("random_draft", "oracle_exact", "oracle_wrong_every_4th"):
            if name in row and "vanilla" in row:
                r = row[name]
                lines.append(f"| {ctx} | {row['vanilla']['tokens_per_s']:.1f} | {name} | {r['tau']:.2f} | "
                             f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['first_mismatch_vs_greedy']} |")
    for ctx, row in results["contexts"].items():
        if "phases" in row:
            lines.append(f"\nPhases at {ctx} (ms): plain decode step {row['decode_step_s'] * 1e3:.2f}; " +
                         ", ".join(f"{k} {v * 1e3:.3f}" for k, v in row["phases"].items() if k != "samples"))
    with open(os.path.join(out_dir, "bench_spec.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.bench_spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--fixture", help="the small code-LM fixture directory")
    p.add_argument("--pad-script", help="path of the fixture's pad_model.py")
    p.add_argument("--work", default="/tmp/longspec_bench", help="where the padded pair is written (reused)")
    p.add_argument("--contexts", default="16384,32768")
    p.add_argument("--phase-contexts", default="16384,32768")
    p.add_argument("--e2e-contexts", default="16384,32768", help="contexts of the speculative tokens/s runs")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--phase-reps", type=int, default=10)
    p.add_argument("--stable-gap", type=float, default=0.0,
                   help="for e2e contexts, start the prompt at the first offset whose float32 greedy continuation "
                        "has no top-2 logit gap below this (0 = offset 0)")
    p.add_argument("--stable-search", type=int, default=0, help="largest prompt offset tried for --stable-gap")
    p.add_argument("--commit-repeats", type=int, default=3,
                   help="times the verify / commit phases of both commit schemes are timed, in turn")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new context or phase set after this")
    p.add_argument("--smoke", action="store_true", help="tiny random pair on the CPU")
    args = p.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.phase_contexts = [int(x) for x in args.phase_contexts.split(",") if x]
    args.e2e_contexts = [int(x) for x in args.e2e_contexts.split(",") if x]
    if not args.smoke and not (args.fixture and args.pad_script):
        p.error("--fixture and --pad-script are required (or --smoke)")
    results = run(args)
    write_outputs(args.out, results)
    with open(os.path.join(args.out, "bench_spec.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
