"""Draft vocabularies (longspec_jax.draft_vocab): a draft proposing from a subset of the target's tokens.

Bad vocabularies are named; the subset's log-probs are the draft's full ones renormalised over it; greedy output
equals plain decoding where the target emits tokens the draft cannot propose (oracle drafts, batch > 1, beams and
chains); a vocabulary of every id reproduces the full-vocabulary run draw for draw at T > 0. The T > 0 output
distribution tests are in tests/test_speculative_sampling.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer import generate
from infer.decoding import StopCriteria
from infer.generate import pad_prompts, plan_speculative
from infer.speculative import speculative_start
from longspec_jax.draft import draft_root
from longspec_jax.draft_vocab import (check_draft_vocab, gather_draft_vocab, most_frequent_tokens, token_counts,
                                      vocab_columns)
from longspec_jax.sampling import SamplingConfig
from longspec_jax.target import init_target_params
from tests.spec_helpers import TINY, noisy_oracle_draft, random_draft, tiny_target

PROMPTS = [[5, 9, 2, 33, 17, 8], [40, 1, 12], [7, 7, 60, 3, 21]]
MAX_NEW = 40


@pytest.mark.parametrize("ids, words", [
    ([3, 1, 2], "not sorted: token id 1 at position 1 follows 3"),
    ([0, 64], r"token id 64 at position 1 is outside the target's vocabulary \[0, 64\)"),
    ([-1, 4], "token id -1 at position 0 is outside"),
    ([], "empty"),
    ([1, 2, 2, 5], "duplicate token id 2 at position 2"),
    ([1.0, 2.0], "token ids must be integers, got dtype float64"),
    ([True, False], "token ids must be integers, got dtype bool"),
    ([[1, 2]], r"expected a 1-D array of token ids, got shape \(1, 2\)"),
])
def test_bad_vocabularies_raise_a_named_value_error(ids, words):
    with pytest.raises(ValueError, match=words):
        check_draft_vocab(ids, 64)
    with pytest.raises(ValueError, match=words):
        random_draft(0).with_vocab(tiny_target(0), ids)


def test_counts_and_most_frequent_tokens():
    counts = token_counts([np.asarray([[3, 3, 1], [2, -1, -1]]), [3, 0, 2]], vocab_size=6)
    np.testing.assert_array_equal(counts, [1, 1, 2, 3, 0, 0])
    np.testing.assert_array_equal(most_frequent_tokens(counts, 2), [2, 3])
    np.testing.assert_array_equal(most_frequent_tokens(counts, 4), [0, 1, 2, 3])  # ties: the lower ids
    assert most_frequent_tokens(counts, 4).dtype == np.int32
    with pytest.raises(ValueError, match=r"size must be in \[1, 6\], got 7"):
        most_frequent_tokens(counts, 7)
    with pytest.raises(ValueError, match=r"token id 6 is outside the vocabulary \[0, 6\)"):
        token_counts([[6]], 6)
    np.testing.assert_array_equal(vocab_columns([2, 5, 9], [[9, 2, 3, -1, 10]]), [[2, 0, -1, -1, -1]])


@pytest.mark.parametrize("tied", [False, True])
def test_the_gathered_head_is_the_lm_heads_columns(tied):
    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    params = init_target_params(config, jax.random.PRNGKey(0))
    ids = [0, 7, 63]
    vocab = gather_draft_vocab(params, ids, config.vocab_size)
    full_dxV = params["embed"].T if tied else params["lm_head"]
    np.testing.assert_array_equal(vocab.head, full_dxV[:, np.asarray(ids)])
    assert vocab.size == 3 and vocab.ids.dtype == jnp.int32


def test_the_subsets_log_probs_are_the_full_ones_renormalised():
    """draft_root over a draft vocabulary gives log_softmax of the full logits' columns at its ids."""
    target, draft = tiny_target(1), random_draft(1)
    ids = np.arange(0, 64, 3)
    restricted = draft.with_vocab(target, ids)
    settings = plan_speculative(target, draft, 8, 8, SamplingConfig(), (2, 2), 512, "xla")
    tokens, lengths = pad_prompts([np.asarray(p, np.int32) for p in PROMPTS], settings.base.prompt_len)
    state = speculative_start(settings, target.params, draft.weights, tokens, lengths, StopCriteria.make(8, []),
                              jax.random.PRNGKey(0))
    full_BxV, _ = draft_root(settings.draft, draft.weights, target.params, state.cache, state.ring, state.pending,
                             state.num_pending)
    sub_BxK, _ = draft_root(settings.draft, restricted.weights, target.params, state.cache, state.ring,
                            state.pending, state.num_pending)
    assert sub_BxK.shape == (len(PROMPTS), ids.size)
    np.testing.assert_allclose(sub_BxK, jax.nn.log_softmax(full_BxV[:, ids], axis=-1), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def greedy_run():
    target = tiny_target(2)
    return target, generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])


@pytest.mark.parametrize("tree_shape, wrong_rate", [((4, 16, 16), 0.3), ((1, 1, 1, 1), 0.0)],
                         ids=["beams-4,16,16", "chain-4"])
def test_greedy_output_is_plain_decoding_where_the_target_emits_tokens_outside_the_vocabulary(
        greedy_run, tree_shape, wrong_rate):
    """A third of the distinct tokens of the plain output are left out of the draft vocabulary: the oracle
    draft cannot propose them, the target emits them anyway, and rounds still accept several tokens."""
    target, ref = greedy_run
    emitted = np.unique(ref.tokens)
    excluded = emitted[::3]
    ids = np.setdiff1d(np.arange(TINY.vocab_size), excluded)
    draft = noisy_oracle_draft(random_draft(2).with_vocab(target, ids), PROMPTS, ref.tokens, wrong_rate, seed=2)
    out = generate(target, PROMPTS, draft=draft, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=tree_shape)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert np.isin(out.tokens, excluded).sum() >= 10
    assert out.mean_accepted > 1.3 and out.accept_counts[:, -1].sum() > 0


@pytest.mark.slow
def test_a_vocabulary_of_every_id_reproduces_the_full_vocabulary_draws():
    """T > 0, same seed, a tree sampled from the draft: the same tokens, rounds and acceptance as the draft
    without a vocabulary."""
    target, draft = tiny_target(3), random_draft(3)
    kwargs = dict(max_new_tokens=24, eos_token_id=[], temperature=1.0, tree_shape=(2, 2, 2), seed=5,
                  draft_sampling=True)
    full = generate(target, PROMPTS, draft=draft, **kwargs)
    every = generate(target, PROMPTS, draft=draft.with_vocab(target, np.arange(TINY.vocab_size)), **kwargs)
    np.testing.assert_array_equal(every.tokens, full.tokens)
    np.testing.assert_array_equal(every.accept_counts, full.accept_counts)


def test_without_a_vocabulary_the_draft_is_as_before():
    target, draft = tiny_target(0), random_draft(0)
    assert draft.vocab is None and draft.weights.vocab is None and draft.vocab_size(64) == 64
    small = draft.with_vocab(target, [1, 2, 3, 4])
    assert small.vocab_size(64) == 4 and small.with_vocab(target, None).vocab is None
    with pytest.raises(ValueError, match="tree_shape\\[0\\] = 5 exceeds the 1 x 4"):
        generate(target, PROMPTS, draft=small, max_new_tokens=4, tree_shape=(5,))
