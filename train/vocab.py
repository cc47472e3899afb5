"""A training run's draft vocabulary (``draft.vocab_size`` K > 0): the K most frequent tokens the draft is trained to
predict (the target positions of the training rows), written as ``draft_vocab.npy`` beside the run's checkpoints;
``train.export`` copies it beside the exported weights, where ``load_draft`` reads it.

The loss stays over the full vocabulary, so one trained draft serves every K (chosen again at load time with
``load_draft(..., draft_vocab=)``). At their optima the full loss and a loss restricted to the subset propose
alike (the data's next-token distribution renormalised over the subset); whether a finite draft trained with the
restricted loss accepts more is not measured.
"""

from __future__ import annotations

import os

import numpy as np

from longspec_jax.draft_vocab import most_frequent_tokens, save_draft_vocab, token_counts
from longspec_jax.errors import ConfigError
from train.data import TokenRows

ROWS_PER_READ = 1024


def predicted_tokens(rows: TokenRows):
    """The tokens at every target position of ``rows``, a read of :data:`ROWS_PER_READ` rows at a time."""
    for start in range(0, len(rows), ROWS_PER_READ):
        batch = rows.rows(np.arange(start, min(start + ROWS_PER_READ, len(rows))))
        yield batch["tokens"][batch["targets"] > 0]


def write_run_vocab(rows: TokenRows, k: int, vocab_size: int, directory: str) -> str:
    """Writes the ``k`` most frequent predicted tokens of ``rows`` to ``directory/draft_vocab.npy``; returns
    its path."""
    if k > vocab_size:
        raise ConfigError(f"draft.vocab_size {k} exceeds the target's vocabulary of {vocab_size} tokens")
    ids = most_frequent_tokens(token_counts(predicted_tokens(rows), vocab_size), k)
    return save_draft_vocab(ids, os.fspath(directory))
