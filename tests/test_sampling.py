"""``longspec_jax.sampling``: temperature, top-p (nucleus) and token selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.sampling import MIN_TEMPERATURE, SamplingConfig, sampling_log_probs, select_tokens

PROBS = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted order: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
LOGITS = np.log(PROBS) + 2.0  # any shift: softmax(LOGITS) == PROBS


def probs(logits, **kwargs):
    return np.exp(np.asarray(sampling_log_probs(jnp.asarray(logits), SamplingConfig(**kwargs))))


def test_temperature_one_is_softmax():
    np.testing.assert_allclose(probs(LOGITS, temperature=1.0), PROBS, atol=1e-6)


@pytest.mark.parametrize("t", [0.25, 0.7, 2.0])
def test_temperature_scaling(t):
    expected = PROBS ** (1 / t) / np.sum(PROBS ** (1 / t))
    np.testing.assert_allclose(probs(LOGITS, temperature=t), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [1]), (0.49, [1]), (0.51, [1, 3]), (0.75, [1, 3]), (0.79, [1, 3]), (0.81, [1, 3, 2]),
    (0.9, [1, 3, 2]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    got = probs(LOGITS, temperature=1.0, top_p=top_p)
    expected = np.zeros_like(PROBS)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert (got[[i for i in range(4) if i not in kept]] == 0).all()


def test_top_p_applies_after_temperature():
    # At T=0.5, p ~ PROBS**2: [0.0025, 0.25, 0.0225, 0.09] / 0.365 -> token 1 alone has 0.685 of the mass.
    got = probs(LOGITS, temperature=0.5, top_p=0.6)
    np.testing.assert_allclose(got, [0, 1, 0, 0], atol=1e-6)
    got = probs(LOGITS, temperature=0.5, top_p=0.7)
    sharp = PROBS ** 2
    np.testing.assert_allclose(got, [0, sharp[1], 0, sharp[3]] / (sharp[1] + sharp[3]), atol=1e-6)


def test_top_p_rowwise_in_a_batch():
    logits = np.stack([LOGITS, LOGITS[::-1], np.zeros(4, np.float32)])
    got = probs(logits, temperature=1.0, top_p=0.7)
    np.testing.assert_allclose(got[0], [0, 0.625, 0, 0.375], atol=1e-6)
    np.testing.assert_allclose(got[1], [0.375, 0, 0.625, 0], atol=1e-6)
    # Ties (uniform): some 3 tokens reach 0.7; the kept ones share the mass equally.
    assert np.sum(got[2] > 0) == 3
    np.testing.assert_allclose(got[2][got[2] > 0], 1 / 3, atol=1e-6)


def test_select_tokens_greedy_is_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(0), (5, 50))
    got = select_tokens(logits, jax.random.PRNGKey(1), SamplingConfig(temperature=0.0))
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), axis=-1))
    assert got.dtype == jnp.int32


def test_select_tokens_samples_the_distribution():
    n = 20000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, 4))
    draws = np.asarray(select_tokens(logits, jax.random.PRNGKey(0), SamplingConfig(temperature=1.0, top_p=0.9)))
    freq = np.bincount(draws, minlength=4) / n
    np.testing.assert_allclose(freq, [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], atol=0.015)


@pytest.mark.parametrize("t", [1e-30, 5e-324, float(np.nextafter(MIN_TEMPERATURE, 0))])
def test_temperature_below_threshold_is_greedy(t):
    config = SamplingConfig(temperature=t, top_p=0.9)
    assert config.greedy and config == SamplingConfig(temperature=0.0, top_p=0.9)  # one compiled program


def test_threshold_temperature_samples_without_overflow():
    """At MIN_TEMPERATURE (sampling, not greedy) logits up to 1e4 in magnitude give finite log-probs, all the mass
    on the argmax, under jit (where T = 1e-30 gave inf / NaN)."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (8, 256))
    logits = logits * (1e4 / jnp.abs(logits).max())
    argmax = np.argmax(np.asarray(logits), axis=-1)
    for top_p in (1.0, 0.9):
        config = SamplingConfig(temperature=MIN_TEMPERATURE, top_p=top_p)
        assert not config.greedy
        logp = np.asarray(jax.jit(sampling_log_probs, static_argnums=1)(logits, config))
        assert not np.isnan(logp).any()
        np.testing.assert_allclose(np.exp(logp), np.eye(256)[argmax], atol=1e-6)
        np.testing.assert_array_equal(select_tokens(logits, jax.random.PRNGKey(1), config), argmax)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
])
def test_bad_sampling_config(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingConfig(**kwargs)
