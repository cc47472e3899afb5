"""Oracle drafts for testing and analysis: a real draft whose logits are steered, through
``Draft.logits_hook``, towards a known continuation (e.g. the target's own greedy output).

The draft still runs in full, so timings stay real; only its predictions are replaced. Wrong positions can be
planted to make acceptance lengths vary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.draft import Draft
from longspec_jax.draft_vocab import vocab_columns

ORACLE_BONUS = 1e4


def oracle_hook(logits_BxTxV, positions_BxT, next_token_BxS):
    """Adds a large bonus to the token the oracle table says follows each position."""
    favoured = jnp.take_along_axis(next_token_BxS, positions_BxT, axis=1)
    return logits_BxTxV + ORACLE_BONUS * jax.nn.one_hot(favoured, logits_BxTxV.shape[-1],
                                                        dtype=logits_BxTxV.dtype)


def oracle_table(prompts, continuations, slots: int, vocab_size: int, wrong_every: int = 0,
                 phase: int = 0) -> np.ndarray:
    """``[B, slots]``: the token that follows each position of ``prompt + continuation`` (ids < 0 in the
    continuation are ignored), off by one at every position p with ``(p + phase) % wrong_every == 0``."""
    table = np.zeros((len(prompts), slots), np.int32)
    wrong = (np.arange(slots) + phase) % wrong_every == 0 if wrong_every else np.zeros(slots, bool)
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
        sequence = list(prompt) + [int(t) for t in cont if t >= 0]
        table[b, :len(sequence) - 1] = sequence[1:]
        table[b, wrong] = (table[b, wrong] + 1) % vocab_size
    return table


def oracle_draft(base: Draft, prompts, continuations, vocab_size: int, slots: int, wrong_every: int = 0,
                 phase: int = 0) -> Draft:
    """``base`` steered to predict ``continuations`` (see :func:`oracle_table`). With a draft vocabulary, the
    table holds each token's column in it, ``-1`` (unsteered) where the token is not in it."""
    table = oracle_table(prompts, continuations, slots, vocab_size, wrong_every, phase)
    if base.vocab is not None:
        table = vocab_columns(np.asarray(base.vocab.ids), table)
    return dataclasses.replace(base, logits_hook=oracle_hook, hook_data=jnp.asarray(table))
