"""Contexts past 64k tokens (CPU, float32): speculative decoding stays exact at positions past 2^16, and nothing
that computes positions (RoPE angles, cache slots, the draft's ring and window mask) overflows or loses precision.

The prompts really reach past 2^16; the cheapest honest target for that has a 131,072-token window and one layer
of one head: generate()'s prefill of a ragged batch of 65,600 and 65,500 tokens scores 2 x 65k^2 / 2 query-key
pairs, about 20 s on two CPU cores, once per test. The references avoid that cost: the K/V of a one-layer target
do not depend on its attention, so where only a prefill's cache is used XLA drops the prefill's attention and
the reference costs O(T) (:func:`_plain_greedy`, :func:`_cached_logits`); the float64 NumPy target
(:func:`tests.exact_outputs.target_logits` with ``last``) attends from the scored positions only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer import generate
from infer.decoding import DecodeSettings, Progress, StopCriteria
from infer.generate import pad_prompts, plan_shapes, to_output
from infer.plain import decode_step, plain_loop
from longspec_jax.attention import windowed_ring_attention
from longspec_jax.config import RopeConfig
from longspec_jax.draft import Draft, draft_self_kv
from longspec_jax.kv_cache import RingCache, init_cache
from longspec_jax.rope import inverse_frequencies, rope_tables
from longspec_jax.sampling import SamplingConfig
from longspec_jax.target import causal_forward, forward, lm_head_logits, prefill
from pallas.reference import masked_attention_reference
from tests.exact_outputs import nucleus, sequential_rank_residual_pvalue, softmax, target_logits
from tests.spec_helpers import TINY, noisy_oracle_draft, random_draft, tiny_target
from tests.test_speculative_sampling import ALPHA, first_layer_draft

LONG = dataclasses.replace(TINY, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=32,
                           max_position_embeddings=131072)
PAST = 2 ** 16
PROMPT_LENGTHS = (65_600, 65_500)  # row 0 starts past 2^16, row 1 crosses it at its 37th new token
MAX_NEW = 64
CHUNK = 512                        # generate()'s default prefill chunk
GREEDY_TREE = (3, 2, 4)
SAMPLED_TREE = (4, 4)
TEMPERATURE, TOP_P = 0.7, 0.9
NUCLEUS_MARGIN = 0.01  # the library's float32 probabilities were within 0.0014 of the float64 ones at 66k


pytestmark = pytest.mark.slow


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, LONG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def _numpy_params(target) -> dict:
    return jax.tree_util.tree_map(np.asarray, target.params)


@functools.partial(jax.jit, static_argnames="settings")
def _plain_greedy_loop(params, tokens_BxT, lengths_B, stop, settings: DecodeSettings):
    c = settings.config
    cache = init_cache(c.num_layers, tokens_BxT.shape[0], settings.capacity, c.num_kv_heads, c.head_dim,
                       params["embed"].dtype)
    _, cache = prefill(params, c, tokens_BxT, lengths_B - 1, cache, chunk=settings.prefill_chunk, impl=settings.impl)
    last_B = jnp.take_along_axis(tokens_BxT, (lengths_B - 1)[:, None], axis=1)[:, 0]
    key = jax.random.PRNGKey(0)
    first_B, cache = decode_step(params, settings, cache, last_B, key)
    progress = Progress.start(first_B, settings.out_len, stop)
    return plain_loop(params, settings, stop, progress, cache.replace(lengths=lengths_B), first_B, key)


def _plain_greedy(target, prompts):
    """Plain greedy decoding (generate()'s shapes and :func:`infer.plain.plain_loop`) after a prefill of each
    prompt but its last token, which the first decode step reads: the prefill's attention is dead code."""
    padded, chunk, out_len, capacity = plan_shapes(max(map(len, prompts)), MAX_NEW, 1, CHUNK)
    settings = DecodeSettings(config=target.config, sampling=SamplingConfig(), capacity=capacity,
                              prefill_chunk=chunk, out_len=out_len, prompt_len=padded, impl="xla")
    tokens_BxT, lengths_B = pad_prompts([np.asarray(p, np.int32) for p in prompts], padded)
    stop = StopCriteria.make(MAX_NEW, [])
    return to_output(_plain_greedy_loop(target.params, tokens_BxT, lengths_B, stop, settings), MAX_NEW)


def test_speculative_greedy_past_64k_equals_plain_greedy():
    """A ragged batch whose rows start past 2^16 and cross it: speculative greedy output equals plain greedy
    decoding. The draft is an oracle steered to the output at 80% of positions, which it reads at the draft's
    positions: every row's rounds accept every length, 2.8 tokens on average (with the tree's positions wrapped
    at 2^16, the row past it never accepted more than 2)."""
    target = tiny_target(3, LONG)
    prompts = _prompts(0)
    ref = _plain_greedy(target, prompts)
    assert (ref.num_generated == MAX_NEW).all() and min(len(set(row)) for row in ref.tokens.tolist()) >= 8
    assert (ref.tokens[0] != ref.tokens[1]).any()
    draft = noisy_oracle_draft(random_draft(1, LONG), prompts, ref.tokens, wrong_rate=0.2, seed=0,
                               vocab_size=LONG.vocab_size, slots=LONG.max_position_embeddings)
    out = generate(target, prompts, draft=draft, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=GREEDY_TREE)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.num_generated, ref.num_generated)
    assert out.mean_accepted > 2.5 and (out.accept_counts > 0).all(), out.accept_counts


def _cross_attention_draft(target) -> Draft:
    """:func:`tests.test_speculative_sampling.first_layer_draft` with the layer's attention moved into the draft's
    cross-attention (the self-attention's output is zero): over a one-layer target's cache it attends as the
    target does, so it sees the whole context and proposes what the target is likely to emit."""
    draft = first_layer_draft(target)
    p = draft.variables["params"]
    kernel = p["self_attn"]["o_proj"]["kernel"]
    params = {**p, "post_self_attention_layernorm": p["input_layernorm"],
              "cross_attn": {**p["cross_attn"], "q_proj": p["self_attn"]["q_proj"], "o_proj": p["self_attn"]["o_proj"]},
              "self_attn": {**p["self_attn"], "o_proj": {"kernel": jnp.zeros_like(kernel)}}}
    return dataclasses.replace(draft, variables={**draft.variables, "params": params})


def _fit(target, prompts, tokens_BxN, wrap: int | None = None) -> tuple[int, float, float]:
    """How the generated tokens fit the float64 target's sampling distributions given their prefixes (at positions
    wrapped mod ``wrap``, when given): how many lie clearly outside the nucleus (the target's mass ranked above
    them is at least ``top_p`` + :data:`NUCLEUS_MARGIN`), the rank-residual p-value of those whose membership no
    rounding can decide (that mass farther than the margin from ``top_p``), and their share."""
    params, N = _numpy_params(target), tokens_BxN.shape[1]
    probs = []
    for prompt, tokens_N in zip(prompts, tokens_BxN.tolist()):
        sequence_1xT = np.asarray(prompt + tokens_N[:-1])[None]
        positions_T = np.arange(sequence_1xT.shape[1])
        positions_T = positions_T if wrap is None else positions_T % wrap
        probs.append(softmax(target_logits(params, target.config, sequence_1xT, positions_T, last=N)[0], TEMPERATURE))
    probs_NxV, tokens_N = np.concatenate(probs), tokens_BxN.reshape(-1)
    p_N = probs_NxV[np.arange(len(tokens_N)), tokens_N]
    above_N = np.sum(np.where(probs_NxV > p_N[:, None], probs_NxV, 0.0), axis=-1)
    clear_N = np.abs(above_N - TOP_P) >= NUCLEUS_MARGIN
    pvalue = sequential_rank_residual_pvalue(nucleus(probs_NxV[clear_N], TOP_P), tokens_N[clear_N])
    return int(np.sum(above_N >= TOP_P + NUCLEUS_MARGIN)), pvalue, float(clear_N.mean())


def test_sampled_tree_past_64k_follows_the_target():
    """Recursive rejection sampling down trees sampled from the draft, at positions past 2^16: no generated token
    lies outside the nucleus of the float64 target's distribution at its true position, and their ranks in it
    pass the rank-residual test (p 0.41). Against the target at positions wrapped mod 2^16 the same tokens fail
    both (22 outside, p 2e-182), and so does the greedy output in their place (p 3e-34)."""
    target = tiny_target(5, LONG)
    prompts = _prompts(1)
    out = generate(target, prompts, draft=_cross_attention_draft(target), max_new_tokens=MAX_NEW, eos_token_id=[],
                   temperature=TEMPERATURE, top_p=TOP_P, tree_shape=SAMPLED_TREE, draft_sampling=True, seed=0)
    assert (out.num_generated == MAX_NEW).all()
    rounds_by_emitted = out.accept_counts.sum(axis=0)  # rounds that emitted 1, 2, 3 tokens
    assert (rounds_by_emitted >= 0.1 * rounds_by_emitted.sum()).all(), rounds_by_emitted
    outside, pvalue, clear = _fit(target, prompts, out.tokens)
    assert outside == 0 and pvalue > ALPHA and clear > 0.9, (outside, pvalue, clear)
    outside, pvalue, _ = _fit(target, prompts, out.tokens, wrap=PAST)
    assert outside >= 3 and pvalue < ALPHA, (outside, pvalue)


ROPES = {"default": RopeConfig(), "linear": RopeConfig(rope_type="linear", factor=4.0),
         "llama3": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_tables_past_64k_are_the_float32_angles(name):
    """cos / sin at positions past float16's largest value (65,504), across 2^16 and up to 2^17 - 1 are those of
    the float32 angle ``p * inv_freq`` (as transformers computes it): within half an ulp of that angle (0.004 rad
    at 131,071) of float64 cos / sin of the exact product, and within 1e-6 of float64 cos / sin of the rounded
    angle (the range reduction of large angles loses nothing). Positions through bfloat16 or float16 would not
    be: bfloat16 rounds 131,071 to 131,072, float16 overflows past 65,504."""
    D = 128
    inv_freq_F = inverse_frequencies(ROPES[name], D)
    rng = np.random.default_rng(0)
    positions_P = np.concatenate([np.arange(65_490, 65_560), [2 ** 17 - 1], rng.integers(PAST, 2 ** 17, 500)])
    cos_PxD, sin_PxD = (np.asarray(t) for t in rope_tables(jnp.asarray(positions_P, jnp.int32), inv_freq_F))
    rounded_PxF = (positions_P.astype(np.float32)[:, None] * inv_freq_F[None]).astype(np.float64)
    exact_PxF = positions_P.astype(np.float64)[:, None] * inv_freq_F.astype(np.float64)[None]
    half_ulp_PxF = 0.5 * np.spacing(rounded_PxF.astype(np.float32)).astype(np.float64)
    for table_PxD, fn in ((cos_PxD, np.cos), (sin_PxD, np.sin)):
        np.testing.assert_array_equal(table_PxD[:, D // 2:], table_PxD[:, :D // 2])
        np.testing.assert_allclose(table_PxD[:, :D // 2], fn(rounded_PxF), atol=1e-6, rtol=0)
        assert (np.abs(table_PxD[:, :D // 2] - fn(exact_PxF)) <= half_ulp_PxF + 1e-6).all()


@functools.partial(jax.jit, static_argnames=("capacity", "chunk"))
def _cached_logits(params, prompts_BxT, lengths_B, new_BxN, capacity: int, chunk: int):
    """The logits after each of ``new`` fed through the cache after a prefill of the prompts: ``[B, N, V]``."""
    B, N = new_BxN.shape
    cache = init_cache(LONG.num_layers, B, capacity, LONG.num_kv_heads, LONG.head_dim, params["embed"].dtype)
    _, cache = prefill(params, LONG, prompts_BxT, lengths_B, cache, chunk=chunk, impl="xla")
    causal_BxNxN = jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool)), (B, N, N))
    hidden_BxNxd, _ = forward(params, LONG, new_BxN, lengths_B[:, None] + jnp.arange(N)[None], cache, causal_BxNxN,
                              impl="xla")
    return lm_head_logits(params, hidden_BxNxd)


def test_cached_forward_past_64k_matches_float64():
    """The prefill writes K/V at slots past 2^16 and a cached forward of new tokens (ragged rows: at 65,600.. and
    across 2^16 from 65,500) reads them: its logits equal the float64 NumPy target's at the true positions
    within float32 RoPE rounding, and are far from its logits at positions wrapped mod 2^16."""
    target = tiny_target(0, LONG)
    N = 48
    rng = np.random.default_rng(2)
    prompts, new = _prompts(2), rng.integers(0, LONG.vocab_size, (2, N))
    padded, chunk, _, capacity = plan_shapes(max(PROMPT_LENGTHS), N, 1, CHUNK)
    tokens_BxT, lengths_B = pad_prompts([np.asarray(p, np.int32) for p in prompts], padded)
    logits_BxNxV = np.asarray(_cached_logits(target.params, tokens_BxT, lengths_B, jnp.asarray(new, jnp.int32),
                                             capacity, chunk))
    params = _numpy_params(target)
    for b, prompt in enumerate(prompts):
        sequence_1xT = np.asarray(prompt + new[b].tolist())[None]
        exact_NxV = target_logits(params, LONG, sequence_1xT, last=N)[0]
        np.testing.assert_allclose(logits_BxNxV[b], exact_NxV, atol=0.02, rtol=0)
        wrapped_NxV = target_logits(params, LONG, sequence_1xT, np.arange(sequence_1xT.shape[1]) % PAST, last=N)[0]
        assert np.abs(wrapped_NxV - exact_NxV).max() > 1.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_models_rotate_past_64k_in_float32(dtype):
    """A bfloat16 or float16 target's keys (what its cache holds) and a draft's ring keys, at positions past
    65,504 and 2^16 and up to 2^17 - 1, are the float32 model's rounded to the dtype: RoPE runs in float32
    whatever the weights' dtype."""
    cast = lambda tree: jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)
    target, draft = tiny_target(0, LONG), random_draft(0, LONG)
    half = dataclasses.replace(target, params=cast(target.params))
    half_draft = dataclasses.replace(draft, variables=cast(draft.variables))
    positions_BxT = jnp.asarray([np.arange(65_480, 65_544), np.arange(2 ** 17 - 64, 2 ** 17)], jnp.int32)
    tokens_BxT = jnp.asarray(np.random.default_rng(0).integers(0, LONG.vocab_size, (2, 64)), jnp.int32)

    def keys(model, d):  # the target's last-layer keys and the draft's self-attention keys
        return (causal_forward(model.params, LONG, tokens_BxT, positions_BxT)[0],
                draft_self_kv(d.settings("xla"), d.weights, model.params, tokens_BxT, positions_BxT)[0])

    for got, want in zip(keys(half, half_draft), keys(target, draft)):
        assert got.dtype == dtype
        err = np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
        assert err < 4 * float(jnp.finfo(dtype).eps), err


def test_ring_window_mask_past_64k():
    """The draft's ring keeps position p in slot p % R and its window mask compares positions: written a few
    tokens a round, rows whose windows straddle 2^16 and end at 2^17 - 1 attend (root and tree queries) to
    exactly the ring keys at positions ``[t - window, t)``, as dense attention under that mask built from int64
    positions."""
    B, R, window, K, H, D = 2, 24, 16, 1, 2, 8
    steps = [3, 1, 4, 4, 2, 4, 3, 4, 1, 4, 4, 2, 4, 4, 3, 4, 4, 1]  # tokens committed each round, 56 in all
    total = sum(steps)
    starts = (PAST + 6 - total, 2 ** 17 - 4 - total)  # last committed: 2^16 + 5 and 2^17 - 5
    rng = np.random.default_rng(0)
    k_BxPxKxD, v_BxPxKxD = (rng.standard_normal((B, total, K, D)).astype(np.float32) for _ in range(2))
    positions_BxP = np.asarray(starts)[:, None] + np.arange(total)[None]
    ring = RingCache.empty(B, R, K, D, jnp.float32)
    done = 0
    for n in steps:
        span = slice(done, done + n)
        ring = ring.write(jnp.asarray(k_BxPxKxD[:, span]), jnp.asarray(v_BxPxKxD[:, span]),
                          jnp.asarray(positions_BxP[:, span], jnp.int32), jnp.ones((B, n), bool))
        done += n
    kept_BxR = positions_BxP[:, -R:]
    np.testing.assert_array_equal(np.sort(np.asarray(ring.pos), axis=1), kept_BxR)
    np.testing.assert_array_equal(np.asarray(ring.pos) % R, np.broadcast_to(np.arange(R), (B, R)))
    depths_M = np.asarray([0, 1, 1, 2, 2, 3])  # a root and its tree, after the last committed position
    M = len(depths_M)
    q_pos_BxM = positions_BxP[:, -1:] + 1 + depths_M[None]
    q_BxMxHxD = rng.standard_normal((B, M, H, D)).astype(np.float32)
    new_k_BxMxKxD, new_v_BxMxKxD = (rng.standard_normal((B, M, K, D)).astype(np.float32) for _ in range(2))
    new_mask_BxMxM = np.broadcast_to(np.eye(M, dtype=bool) | (np.arange(M) == 0), (B, M, M))  # itself and the root
    o_BxMxHxD, _ = windowed_ring_attention(jnp.asarray(q_BxMxHxD), jnp.asarray(q_pos_BxM, jnp.int32), ring.k, ring.v,
                                           ring.pos, window, jnp.asarray(new_k_BxMxKxD), jnp.asarray(new_v_BxMxKxD),
                                           jnp.asarray(new_mask_BxMxM), impl="xla")
    rel_BxMxP = positions_BxP[:, None, :].astype(np.int64) - q_pos_BxM[:, :, None].astype(np.int64)
    mask_BxMxS = np.concatenate([(rel_BxMxP >= -window) & (rel_BxMxP < 0), new_mask_BxMxM], axis=-1)  # S = P + M
    ref_BxMxHxD, _ = masked_attention_reference(
        jnp.asarray(q_BxMxHxD), jnp.concatenate([k_BxPxKxD, new_k_BxMxKxD], 1),
        jnp.concatenate([v_BxPxKxD, new_v_BxMxKxD], 1), jnp.asarray(mask_BxMxS))
    assert mask_BxMxS[:, :, :total].sum(-1).min() == window - 3  # the deepest node's window reaches into the tree
    np.testing.assert_allclose(o_BxMxHxD, ref_BxMxHxD, atol=1e-5, rtol=0)
