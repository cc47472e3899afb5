"""Per-round phase times of speculative decoding, the last-layer commit scheme they are compared with, and the
draft's state bytes.

Every phase is repeated ``reps`` times inside one jitted ``fori_loop`` from the post-prefill state (the harness's
in-loop timing; carries such as the KV cache donated and updated in place), so no per-call dispatch or cache
copy is counted. Every step reads its carry, so nothing can be hoisted out of the loop. Parameters are passed
as arguments, never closed over (a closure would make the weights compile-time constants).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from infer.bench.harness import time_loop
from infer.speculative import SpecSettings, exact_acceptance, spec_round, verify
from longspec_jax.draft import draft_prefill, draft_root
from longspec_jax.kv_cache import KVCache, TreeKV, commit
from longspec_jax.tree import Tree, TreeSpec, grow_tree, start_tree


def loop_time(step, carry, consts, reps: int, options: dict):
    """Seconds per ``carry = step(carry, *consts)`` in the in-loop timing (one timed call, compiled with XLA
    ``options``), and the carry."""
    t, carry = time_loop(step, carry, consts, reps, options=options)
    return t.per_step_s, carry


def after(cache: KVCache, carry_leaf: jax.Array) -> KVCache:
    """``cache`` made to depend on a loop carry (its lengths plus 0 unless the carry holds a NaN), so a step that
    only reads the cache cannot be hoisted out of the timing loop."""
    return cache.replace(lengths=cache.lengths + jnp.isnan(carry_leaf.sum()).astype(jnp.int32))


def last_layer_commit(cache: KVCache, tree_kv: TreeKV, path_BxA, count_B, active_B) -> KVCache:
    """The reference's alternative: commit only the last layer's K/V (the others recompute next round)."""
    last = commit(KVCache(k=cache.k[-1:], v=cache.v[-1:], lengths=cache.lengths),
                  TreeKV(k=tree_kv.k[-1:], v=tree_kv.v[-1:]), path_BxA, count_B, active_B)
    return cache.replace(k=cache.k[:-1] + last.k, v=cache.v[:-1] + last.v, lengths=last.lengths)


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


def phase_times(settings: SpecSettings, tparams, weights, tokens, lengths, stop, key, reps, start_fn,
                commit_repeats: int, options: dict) -> dict:
    """Seconds of each phase of one round. The verify and commit phases of both commit schemes are timed in
    turn, ``commit_repeats`` times, and the medians kept (all samples under ``samples``): they differ by a few
    hundredths of a millisecond. ``options``: XLA options of every phase's compile (the speculative loop's,
    :func:`infer.bench.loops.loop_options`)."""
    timed = functools.partial(loop_time, options=options)
    spec, ds = settings.tree, settings.draft
    B = tokens.shape[0]
    V = settings.base.config.vocab_size
    phases: dict = {}
    state = start_fn(tparams, weights, tokens, lengths, key)
    root_B = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]

    def step0(carry, p, d):
        st, _ = carry
        logp_BxV, ring = draft_root(ds, d, p, st.cache, st.ring, st.pending, st.num_pending)
        return st.replace(ring=ring), logp_BxV

    logp0_BxV = jnp.zeros((B, V), jnp.float32)
    phases["draft_step0"], (state, logp_root_BxV) = timed(step0, (state, logp0_BxV), (tparams, weights), reps)

    def level1(builder, r, lp):
        # reads the carry so the loop cannot hoist it: a zero that XLA cannot fold away
        return start_tree(spec, ds, r, lp + builder.scores[:, :1] * 1e-30)

    builder = start_tree(spec, ds, root_B, logp_root_BxV)
    phases["tree_level1_topk"], builder = timed(level1, builder, (root_B, logp_root_BxV), reps)
    for k in range(1, spec.depth):
        grow = functools.partial(lambda k, b, p, d, c, rg: grow_tree(spec, ds, d, p, c, rg, b, k), k)
        # growing level k again only rewrites level k + 1: the final carry is the grown tree
        phases[f"tree_level{k + 1}"], builder = timed(grow, builder, (tparams, weights, state.cache, state.ring),
                                                      reps)
    tree = builder.tree
    cache = state.cache
    del state

    def verify_step(carry, p, c, t, s=settings):
        return verify(s, p, after(c, carry[0]), t)

    alt_settings, alt_tree = recompute_settings(settings, B)
    first = verify(settings, tparams, cache, tree)
    _, (logits_BxNxV, tree_kv) = timed(verify_step, first, (tparams, cache, tree), 1)
    acc = exact_acceptance(tree, logits_BxNxV, key, settings)

    def accept_step(acc_carry, t, lg, k):
        return exact_acceptance(t, lg + acc_carry.count_B[:, None, None] * 1e-30, k, settings)

    phases["accept"], acc = timed(accept_step, acc, (tree, logits_BxNxV, key), reps)
    inactive_B = jnp.zeros((B,), bool)  # commit without advancing the lengths, so it can repeat
    samples: dict = {k: [] for k in ("verify", "verify_with_recompute", "commit_all_layers", "commit_last_layer")}
    verify_alt = functools.partial(verify_step, s=alt_settings)
    alt = verify(alt_settings, tparams, cache, alt_tree)
    commit_args = (tree_kv, acc.path_BxA, acc.count_B, inactive_B)
    for _ in range(commit_repeats):  # carries are donated: keep the returned ones
        t, (logits_BxNxV, tree_kv) = timed(verify_step, (logits_BxNxV, tree_kv), (tparams, cache, tree), reps)
        samples["verify"].append(t)
        t, alt = timed(verify_alt, alt, (tparams, cache, alt_tree), reps)
        samples["verify_with_recompute"].append(t)
        commit_args = (tree_kv,) + commit_args[1:]
        for name, fn in (("commit_all_layers", commit), ("commit_last_layer", last_layer_commit)):
            t, cache = timed(fn, cache, commit_args, reps)
            samples[name].append(t)
    for name, ts in samples.items():
        phases[name] = statistics.median(ts)
    phases["samples"] = samples
    del cache, logits_BxNxV, tree_kv, alt
    state = start_fn(tparams, weights, tokens, lengths, key)
    phases["full_round"], state = timed(lambda st, p, d: spec_round(settings, p, d, stop, st), state,
                                        (tparams, weights), reps)
    return phases


def draft_state_bytes(settings: SpecSettings, tparams, weights, prompt_stream, smoke: bool) -> dict:
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
