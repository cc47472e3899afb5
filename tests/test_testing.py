"""longspec_jax.testing: the oracle draft's next-token table and logits hook."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from longspec_jax.testing import ORACLE_BONUS, TINY, oracle_draft, oracle_hook, oracle_table, random_draft


def test_oracle_table_next_tokens_and_planted_errors():
    table = oracle_table([[5, 6], [1]], [[7, 8, -1], [2, 3]], slots=6, vocab_size=10)
    np.testing.assert_array_equal(table, [[6, 7, 8, 0, 0, 0], [2, 3, 0, 0, 0, 0]])  # -1 ignored, rest 0
    wrong = oracle_table([[5, 6]], [[7, 9]], slots=4, vocab_size=10, wrong_every=2, phase=1)
    np.testing.assert_array_equal(wrong, [[6, 8, 9, 1]])  # positions 1 and 3 off by one, modulo the vocabulary


def test_oracle_hook_favours_the_table_token_at_each_position():
    logits = jnp.zeros((1, 2, 5))
    table = jnp.asarray([[3, 1, 4]])
    out = np.asarray(oracle_hook(logits, jnp.asarray([[2, 0]]), table))
    assert out[0, 0].argmax() == 4 and out[0, 1].argmax() == 3
    assert out.max() == ORACLE_BONUS


def test_oracle_draft_keeps_the_weights_and_carries_the_table():
    base = random_draft(0)
    draft = oracle_draft(base, [[1, 2]], [[3]], TINY.vocab_size, slots=8)
    assert draft.variables is base.variables and draft.logits_hook is oracle_hook
    np.testing.assert_array_equal(draft.weights.hook_data, oracle_table([[1, 2]], [[3]], 8, TINY.vocab_size))
