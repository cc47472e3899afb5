"""Chunked next-token losses through the LM head equal the losses of full logits, in value and gradient; over a
draft vocabulary they equal a NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.draft_vocab import DraftVocab
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


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _subset_reference(h, w, labels, mask, target_h, ids):
    """The subset loss in float64 NumPy, its KL as P_K * KL(p_K || q)."""
    h, w, target_h = (np.asarray(a, np.float64) for a in (h, w, target_h))
    labels, m, ids = np.asarray(labels), np.asarray(mask, np.float64), np.asarray(ids)
    logq = _log_softmax(h @ w[:, ids])
    inside = np.isin(labels, ids)
    col = {int(t): k for k, t in enumerate(ids)}
    picked = np.array([logq[n, col[int(t)]] if ok else 0.0 for n, (t, ok) in enumerate(zip(labels, inside))])
    p_K = np.exp(_log_softmax(target_h @ w))[:, ids]
    mass = p_K.sum(axis=-1)
    p_K = p_K / mass[:, None]
    kl = mass * np.sum(p_K * (np.log(p_K) - logq), axis=-1)
    correct = ids[np.argmax(logq, axis=-1)] == labels
    return -np.sum(picked * m), np.sum(kl * m), np.sum(correct * m), np.sum(m)


def test_subset_sums_equal_a_numpy_reference(chunk=7):
    """Over a draft vocabulary: labels outside it add no cross-entropy and are never correct; the KL term is the
    target's mass on the vocabulary times the KL of its renormalised distribution; every id is the full loss."""
    h, w, labels, mask, target_h = _inputs(4)
    V = w.shape[1]
    ids = np.asarray([0, 2, 3, 8, 11, 19, 20, 30, 36], np.int32)
    outside = ~np.isin(np.asarray(labels), ids) & (np.asarray(mask) == 1)
    assert outside.sum() >= 10
    vocab = DraftVocab(ids=jnp.asarray(ids), head=w[:, ids])
    sums = chunked_token_sums(h, w, labels, mask, chunk, target_h, vocab=vocab)
    np.testing.assert_allclose([sums.nll, sums.kl, sums.correct, sums.count],
                               _subset_reference(h, w, labels, mask, target_h, ids), rtol=1e-5)
    assert float(sums.kl) > 0 and float(sums.correct) > 0
    every = DraftVocab(ids=jnp.arange(V, dtype=jnp.int32), head=w)
    full = chunked_token_sums(h, w, labels, mask, chunk, target_h)
    np.testing.assert_allclose(jax.tree.leaves(chunked_token_sums(h, w, labels, mask, chunk, target_h, vocab=every)),
                               jax.tree.leaves(full), rtol=1e-5)


def test_subset_gradient_is_finite_and_skips_labels_outside():
    """Without the KL term a label outside the vocabulary gives no gradient; the KL term reaches every
    counted token."""
    h, w, labels, mask, target_h = _inputs(5)
    ids = np.asarray([1, 4, 5, 9, 16, 25, 33], np.int32)
    vocab = DraftVocab(ids=jnp.asarray(ids), head=w[:, ids])

    def loss(h_, kl_weight):
        s = chunked_token_sums(h_, w, labels, mask, 16, target_h, vocab=vocab)
        return s.nll + kl_weight * s.kl

    inside = np.isin(np.asarray(labels), ids)
    counted = np.asarray(mask) == 1
    g = np.abs(np.asarray(jax.grad(loss)(h, 0.0))).max(axis=-1)
    assert (g[counted & inside] > 0).all() and (g[~(counted & inside)] == 0).all()
    g = np.abs(np.asarray(jax.grad(loss)(h, 0.5))).max(axis=-1)
    assert np.isfinite(g).all() and (g[counted] > 0).all() and (g[~counted] == 0).all()


def test_chunked_argmax_over_a_draft_vocabulary_gives_token_ids():
    h, w, _, _, _ = _inputs(6)
    ids = np.asarray([3, 7, 10, 22, 31], np.int32)
    vocab = DraftVocab(ids=jnp.asarray(ids), head=w[:, ids])
    np.testing.assert_array_equal(chunked_argmax(h, w, 9, vocab), ids[np.argmax(np.asarray(h @ w)[:, ids], -1)])
