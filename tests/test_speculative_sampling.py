"""T > 0 losslessness: the joint distribution of the first three generated tokens under speculative sampling
equals the target's own sampling distribution (computed exactly), and a biased rule fails the same test."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from infer import generate
from infer.decoding import StopCriteria
from infer.generate import plan_speculative, run_speculative
from longspec_jax.config import TargetConfig
from longspec_jax.kv_cache import init_cache
from longspec_jax.sampling import SamplingConfig, sampling_log_probs
from longspec_jax.target import forward, lm_head_logits
from longspec_jax.tree import accept
from tests.spec_helpers import random_draft, tiny_target

VOCAB = 8
CONFIG = TargetConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
PROMPT = [1, 5, 2, 7, 3]
BATCH = 2048
SEEDS = range(4)  # 8192 samples: the biased rule below scores p < 1e-190 already at 2048
TREE = (4, 8, 8)


def exact_first_three(target, prompt, sampling) -> np.ndarray:
    """P(x1, x2, x3 | prompt) ``[V, V, V]`` under plain sampling, from one causal forward over all V^2
    continuations ``prompt + [x1, x2]``."""
    rows = np.array([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], np.int32)
    R, T = rows.shape
    cache = init_cache(CONFIG.num_layers, R, 16, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (R, T, T))
    positions = jnp.broadcast_to(jnp.arange(T), (R, T))
    hidden, _ = forward(target.params, CONFIG, jnp.asarray(rows), positions, cache, causal, impl="naive")
    probs = np.exp(np.asarray(sampling_log_probs(lm_head_logits(target.params, hidden), sampling), np.float64))
    p1 = probs[0, T - 3]                                       # [V]
    p2 = probs[::VOCAB, T - 2]                                 # [x1, V]
    p3 = probs[:, T - 1].reshape(VOCAB, VOCAB, VOCAB)          # [x1, x2, V]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint / joint.sum()


def chi_square_pvalue(samples_Sx3: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 counts are pooled into one."""
    flat = samples_Sx3 @ np.array([VOCAB * VOCAB, VOCAB, 1])
    observed = np.bincount(flat, minlength=VOCAB ** 3).astype(np.float64)
    expected = expected_probs.reshape(-1) * len(flat)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])
    return float(stats.chi2.sf(chi2, keep.sum() - 1))


def reference_pq_acceptance(tree, target_logits_BxNxV, key, settings):
    """The PyTorch reference's T > 0 rule (reference.md 2.8), test-only negative control: try the children in
    random order, accept child s with probability min(1, p(s)/q(s)), on rejection p <- norm(max(p - q, 0));
    with no child accepted, sample the bonus from the residual. Biased for deterministic top-k children."""
    B, N, V = target_logits_BxNxV.shape
    T = settings.base.sampling.temperature
    p = jnp.exp(sampling_log_probs(target_logits_BxNxV, settings.base.sampling))
    q = jax.nn.softmax(tree.draft_logp / T, axis=-1)
    is_child = (tree.parents[:, None, :] == jnp.arange(N)[None, :, None]) & (jnp.arange(N) > 0)[None, None, :]
    k_order, k_accept, k_bonus = jax.random.split(key, 3)
    priority = jnp.where(is_child, jax.random.uniform(k_order, (B, N, N)), 2.0)
    order = jnp.argsort(priority, axis=-1)
    uniforms = jax.random.uniform(k_accept, (B, N, N))
    accepted = jnp.zeros((B, N), bool)
    choice = jnp.full((B, N), -1, jnp.int32)
    for j in range(max(settings.tree.shape)):
        child = order[:, :, j]
        valid = jnp.take_along_axis(is_child, child[..., None], axis=-1)[..., 0] & ~accepted
        token = jnp.take_along_axis(tree.tokens, child, axis=1)
        p_s = jnp.take_along_axis(p, token[..., None], axis=-1)[..., 0]
        q_s = jnp.take_along_axis(q, token[..., None], axis=-1)[..., 0]
        take = valid & (uniforms[:, :, j] <= (p_s + 1e-9) / (q_s + 1e-9))
        choice = jnp.where(take, token, choice)
        accepted = accepted | take
        residual = jnp.maximum(p - q, 0.0)
        residual = residual / jnp.maximum(residual.sum(-1, keepdims=True), 1e-20)
        p = jnp.where((valid & ~take)[..., None], residual, p)
    bonus = jax.random.categorical(k_bonus, jnp.log(p), axis=-1).astype(jnp.int32)
    walk = accept(tree.tokens, tree.parents, tree.mask, choice, settings.tree)
    last = jnp.take_along_axis(walk.path_BxA, (walk.count_B - 1)[:, None], axis=1)[:, 0]
    tokens = walk.tokens_BxA.at[jnp.arange(B), walk.count_B - 1].set(bonus[jnp.arange(B), last])
    return dataclasses.replace(walk, tokens_BxA=tokens)


@functools.lru_cache(maxsize=None)
def _models():
    return tiny_target(11, CONFIG), random_draft(4, CONFIG, window=8)


def _speculative_samples(sampling: SamplingConfig, acceptance=None) -> np.ndarray:
    target, draft = _models()
    settings = plan_speculative(target, draft, len(PROMPT), 3, sampling, TREE, 512, "xla")
    if acceptance is not None:
        settings = dataclasses.replace(settings, acceptance=acceptance)
    prompts = [PROMPT] * BATCH
    stop = StopCriteria.make(3, [])
    outs = [run_speculative(settings, target, draft, prompts, 3, stop, seed).tokens for seed in SEEDS]
    return np.concatenate(outs)


CASES = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]


@pytest.mark.parametrize("sampling", CASES, ids=["T1", "T0.7-top_p0.9"])
def test_speculative_sampling_matches_target_distribution(sampling):
    target, _ = _models()
    expected = exact_first_three(target, PROMPT, sampling)
    samples = _speculative_samples(sampling)
    assert samples.shape == (BATCH * len(SEEDS), 3) and (samples >= 0).all()
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_plain_sampling_matches_exact_distribution():
    """Calibrates the test itself: plain sampling passes it too."""
    target, _ = _models()
    sampling = CASES[0]
    expected = exact_first_three(target, PROMPT, sampling)
    samples = np.concatenate([generate(target, [PROMPT] * BATCH, max_new_tokens=3, temperature=1.0,
                                       eos_token_id=[], seed=seed).tokens for seed in SEEDS])
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_negative_control_reference_pq_rule_fails():
    """The reference's p/q ratio test on deterministic top-k children is biased; the same test detects it."""
    target, _ = _models()
    sampling = CASES[0]
    expected = exact_first_three(target, PROMPT, sampling)
    samples = _speculative_samples(sampling, acceptance=reference_pq_acceptance)
    assert chi_square_pvalue(samples, expected) < 1e-6
