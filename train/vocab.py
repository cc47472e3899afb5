"""Draft vocabularies from token frequencies. A training run's draft vocabulary (``draft.vocab_size`` K > 0):
the K most frequent tokens the draft is trained to predict (the target positions of the training rows), written as
``draft_vocab.npy`` beside the run's checkpoints; ``train.export`` copies it beside the exported weights, where
``load_draft`` reads it.

With ``draft.vocab_loss: full`` the loss stays over the full vocabulary, so one trained draft serves every K
(chosen again at load time with ``load_draft(..., draft_vocab=)``); with ``subset`` it is over the K columns the
draft proposes from (:mod:`train.loss`). At their optima both propose alike (the data's next-token distribution
renormalised over the subset); a finite draft trained over the subset spends all of its capacity there.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from longspec_jax.draft_vocab import most_frequent_tokens, save_draft_vocab, token_counts
from longspec_jax.errors import ConfigError
from train.data import TokenRows, load_fields

ROWS_PER_READ = 1024


def predicted_tokens(rows: TokenRows):
    """The tokens at every target position of ``rows``, a read of :data:`ROWS_PER_READ` rows at a time."""
    for start in range(0, len(rows), ROWS_PER_READ):
        batch = rows.rows(np.arange(start, min(start + ROWS_PER_READ, len(rows))))
        yield batch["tokens"][batch["targets"] > 0]


def run_vocab(rows: TokenRows, k: int, vocab_size: int, directory: str | None) -> np.ndarray:
    """The sorted ids of the ``k`` most frequent predicted tokens of ``rows``, also written to
    ``directory/draft_vocab.npy`` unless ``directory`` is ``None``."""
    if k > vocab_size:
        raise ConfigError(f"draft.vocab_size {k} exceeds the target's vocabulary of {vocab_size} tokens")
    ids = most_frequent_tokens(token_counts(predicted_tokens(rows), vocab_size), k)
    if directory is not None:
        save_draft_vocab(ids, os.fspath(directory))
    return ids


def text_token_counts(files: list[str], field: str, tokenizer, vocab_size: int, progress=None) -> np.ndarray:
    """``[V]`` occurrences of every token in the ``field`` texts of ``files`` (a ``.txt`` file's lines are its
    ``text`` field)."""
    texts = load_fields(files, [field], None)
    counts_V = np.zeros(vocab_size, np.int64)
    for start in range(0, len(texts), ROWS_PER_READ):
        counts_V += token_counts(tokenizer(texts[start:start + ROWS_PER_READ][field])["input_ids"], vocab_size)
        if progress:
            progress(f"{min(start + ROWS_PER_READ, len(texts))}/{len(texts)} texts, {int(counts_V.sum())} tokens")
    return counts_V


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.vocab",
                                description="Write the K most frequent tokens of text files as a draft vocabulary "
                                            "(draft_vocab.npy).")
    p.add_argument("--target", required=True, help="target model directory (its tokenizer and vocabulary size)")
    p.add_argument("--data", required=True, nargs="+", help="jsonl / json / parquet / txt files")
    p.add_argument("--field", default="text", 
                   help="the text field of the rows (default text; a .txt file's lines are text)")
    p.add_argument("--size", type=int, required=True, help="K, the number of token ids kept")
    p.add_argument("--out", required=True, help="directory for draft_vocab.npy (e.g. the draft's), or a .npy path")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from longspec_jax.config import TargetConfig

    try:
        vocab_size = TargetConfig.from_dir(args.target).vocab_size
        if not 1 <= args.size <= vocab_size:
            raise ValueError(f"--size must be in [1, {vocab_size}], the target's vocabulary; got {args.size}")
        missing = [f for f in args.data if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"data file {missing[0]} does not exist")
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        counts_V = text_token_counts(args.data, args.field, tokenizer, vocab_size,
                                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, OSError) as e:
        p.error(str(e))
    ids = most_frequent_tokens(counts_V, args.size)
    if args.out.endswith(".npy"):
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        np.save(args.out, ids, allow_pickle=False)
        path = args.out
    else:
        path = save_draft_vocab(ids, args.out)
    print(f"wrote {path}: {args.size} of {vocab_size} tokens, {counts_V[ids].sum() / max(counts_V.sum(), 1):.1%} "
          f"of the {int(counts_V.sum())} token occurrences", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
