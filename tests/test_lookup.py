"""Prompt-lookup decoding: proposals equal a brute-force n-gram search, and greedy output equals plain greedy
decoding (ragged batch, EOS inside the window), with rounds that accept several tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer import PromptLookup, generate
from longspec_jax.testing import tiny_target
from infer.lookup import propose


def brute_force(history: list[int], length: int, lookup: PromptLookup) -> list[int]:
    """The continuation of the latest earlier occurrence of the last n tokens, largest n first; 0 where unknown."""
    for n in range(lookup.max_ngram, lookup.min_ngram - 1, -1):
        if length < n:
            continue
        suffix = history[length - n:length]
        for j in range(length - n - 1, -1, -1):
            if history[j:j + n] == suffix:
                return [history[j + n + i] if j + n + i < length else 0 for i in range(lookup.num_tokens)]
    return [0] * lookup.num_tokens


@pytest.mark.parametrize("lookup", [PromptLookup(num_tokens=4, max_ngram=3, min_ngram=1),
                                    PromptLookup(num_tokens=6, max_ngram=2, min_ngram=2)])
def test_proposals_equal_brute_force_search(lookup):
    rng = np.random.default_rng(0)
    B, H = 256, 40
    history = rng.integers(1, 5, (B, H)).astype(np.int32)  # 4 symbols: many matches of every length
    length = rng.integers(0, H + 1, B).astype(np.int32)
    got = np.asarray(jax.jit(propose, static_argnums=2)(jnp.asarray(history), jnp.asarray(length), lookup))
    want = np.array([brute_force(history[b].tolist(), int(length[b]), lookup) for b in range(B)])
    np.testing.assert_array_equal(got, want)
    assert (want != 0).any(axis=1).mean() > 0.5  # most rows found a match


def test_greedy_lookup_equals_plain_greedy():
    target = tiny_target(0)
    rng = np.random.default_rng(1)
    motif = rng.integers(0, target.config.vocab_size, 12).tolist()
    prompts = [motif * 4, (motif * 3)[:29]]
    plain = generate(target, prompts, max_new_tokens=40, eos_token_id=[])
    eos = int(plain.tokens[0, 25])  # a token the first row emits late in the window
    for eos_ids in ([], [eos]):
        plain = generate(target, prompts, max_new_tokens=40, eos_token_id=eos_ids)
        ours = generate(target, prompts, draft=PromptLookup(num_tokens=5), max_new_tokens=40, eos_token_id=eos_ids)
        np.testing.assert_array_equal(ours.tokens, plain.tokens)
        np.testing.assert_array_equal(ours.num_generated, plain.num_generated)
        assert ours.accept_counts[:, 1:].sum() >= 3, ours.accept_counts  # rounds that accepted proposals
        assert (ours.num_rounds < plain.num_rounds).all()


@pytest.mark.parametrize("kwargs", [dict(num_tokens=0), dict(max_ngram=True), dict(min_ngram=3, max_ngram=2)])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError, match="PromptLookup"):
        PromptLookup(**kwargs)


def test_a_draft_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="PromptLookup"):
        generate(tiny_target(0), [[1, 2, 3]], draft="ngram", max_new_tokens=4)
