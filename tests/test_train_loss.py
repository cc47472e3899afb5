"""Chunked next-token losses through the LM head equal the losses of full logits, in value and gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.loss import chunked_argmax, chunked_token_sums


def _inputs(seed: int, N=50, d=16, V=37):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    h = jax.random.normal(ks[0], (N, d))
    w = 0.5 * jax.random.normal(ks[1], (d, V))
    labels = jax.random.randint(ks[2], (N,), 0, V)
    mask = jax.random.bernoulli(ks[3], 0.8, (N,)).astype(jnp.int8)
    target_h = jax.random.normal(ks[4], (N, d))
    return h, w, labels, mask, target_h


def _full(h, w, labels, mask, target_h):
    logp = jax.nn.log_softmax(h @ w, axis=-1)
    m = mask.astype(jnp.float32)
    nll = -jnp.sum(jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0] * m)
    target_logp = jax.nn.log_softmax(target_h @ w, axis=-1)
    kl = jnp.sum(jnp.sum(jnp.exp(target_logp) * (target_logp - logp), axis=-1) * m)
    correct = jnp.sum((jnp.argmax(logp, -1) == labels) * m)
    return nll, kl, correct, jnp.sum(m)


@pytest.mark.parametrize("chunk", [7, 16, 50, 4096])  # ragged last chunk, exact, one chunk, chunk > N
def test_chunked_sums_equal_full_logits(chunk):
    h, w, labels, mask, target_h = _inputs(0)
    sums = chunked_token_sums(h, w, labels, mask, chunk, target_h)
    nll, kl, correct, count = _full(h, w, labels, mask, target_h)
    np.testing.assert_allclose([sums.nll, sums.kl, sums.correct, sums.count], [nll, kl, correct, count],
                               rtol=1e-5)
    assert float(sums.kl) > 0 and float(sums.nll) > 0


@pytest.mark.parametrize("chunk", [7, 50])
def test_chunked_gradient_equals_full_logits_gradient(chunk):
    h, w, labels, mask, target_h = _inputs(1)

    def chunked(h_):
        s = chunked_token_sums(h_, w, labels, mask, chunk, target_h)
        return s.nll + 0.3 * s.kl

    def full(h_):
        nll, kl, _, _ = _full(h_, w, labels, mask, target_h)
        return nll + 0.3 * kl

    np.testing.assert_allclose(jax.grad(chunked)(h), jax.grad(full)(h), atol=1e-5, rtol=1e-5)
    # masked tokens get no gradient
    g = np.asarray(jax.grad(chunked)(h))
    assert np.abs(g[np.asarray(mask) == 0]).max() == 0.0


def test_without_target_hidden_there_is_no_kl_term():
    h, w, labels, mask, _ = _inputs(2)
    sums = chunked_token_sums(h, w, labels, mask, 8)
    assert float(sums.kl) == 0.0
    np.testing.assert_allclose(sums.nll, _full(h, w, labels, mask, h)[0], rtol=1e-5)


def test_chunked_argmax():
    h, w, _, _, _ = _inputs(3)
    np.testing.assert_array_equal(chunked_argmax(h, w, 9), jnp.argmax(h @ w, axis=-1))
