"""A draft vocabulary: the sorted target token ids a draft proposes from, with the target LM head's columns for them
gathered once, so that every draft level computes K logits instead of V.

Only the draft's proposal distribution changes (zero mass outside the subset, renormalised over it); verification
runs on the target's full vocabulary, so output stays exact: at T = 0 the target's own choice is emitted where the
draft could not propose it, at T > 0 the residual max(p - q, 0) holds the tokens outside the subset.

On disk it is ``draft_vocab.npy`` beside the draft's weights: a 1-D int32 array of sorted, distinct ids (the
PyTorch LongSpec code ignores the file). Choose it with :func:`token_counts` and :func:`most_frequent_tokens`
from a tokenised corpus or from text the target generates.
"""

from __future__ import annotations

import os
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from longspec_jax.errors import WeightsError

VOCAB_NAME = "draft_vocab.npy"


@struct.dataclass
class DraftVocab:
    """The traced half of a draft vocabulary."""

    ids: jax.Array   # [K] int32 target token ids, sorted
    head: jax.Array  # [d, K] the target LM head's columns for them

    @property
    def size(self) -> int:
        return self.ids.shape[0]


def check_draft_vocab(ids, vocab_size: int, where: str = "draft vocabulary") -> np.ndarray:
    """``ids`` as an int32 array, or a ``ValueError`` naming what is wrong: not 1-D, empty, not integers, an id
    outside ``[0, vocab_size)``, a duplicate, or out of order."""
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{where}: expected a 1-D array of token ids, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{where}: empty; a draft vocabulary needs at least one token id")
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{where}: token ids must be integers, got dtype {array.dtype}")
    outside = np.flatnonzero((array < 0) | (array >= vocab_size))
    if outside.size:
        raise ValueError(f"{where}: token id {int(array[outside[0]])} at position {int(outside[0])} is outside the "
                         f"target's vocabulary [0, {vocab_size})")
    steps = np.diff(array)
    if (steps == 0).any():
        at = int(np.flatnonzero(steps == 0)[0]) + 1
        raise ValueError(f"{where}: duplicate token id {int(array[at])} at position {at}")
    if (steps < 0).any():
        at = int(np.flatnonzero(steps < 0)[0]) + 1
        raise ValueError(f"{where}: not sorted: token id {int(array[at])} at position {at} follows "
                         f"{int(array[at - 1])}")
    return array.astype(np.int32)


def gather_draft_vocab(target_params: dict, ids, vocab_size: int) -> DraftVocab:
    """Checks ``ids`` and gathers their columns of the target's LM head (the embedding's rows where it is tied)."""
    ids_K = jnp.asarray(check_draft_vocab(ids, vocab_size))
    if "lm_head" in target_params:
        return DraftVocab(ids=ids_K, head=jnp.take(target_params["lm_head"], ids_K, axis=1))
    return DraftVocab(ids=ids_K, head=jnp.take(target_params["embed"], ids_K, axis=0).T)


def scatter_to_vocab(x_BxK: jax.Array, ids_K: jax.Array | None, vocab_size: int, fill: float) -> jax.Array:
    """``[B, V]`` with the K columns of ``x`` at ``ids`` and ``fill`` elsewhere (``x`` itself without ids)."""
    if ids_K is None:
        return x_BxK
    return jnp.full((x_BxK.shape[0], vocab_size), fill, x_BxK.dtype).at[:, ids_K].set(x_BxK)


def vocab_columns(ids_K, tokens) -> jax.Array:
    """Each token's column in the draft vocabulary ``ids`` (int32), ``-1`` where it is not in it; traceable."""
    ids_K, tokens = jnp.asarray(ids_K), jnp.asarray(tokens)
    at = jnp.minimum(jnp.searchsorted(ids_K, tokens), ids_K.shape[0] - 1)
    return jnp.where(ids_K[at] == tokens, at, -1).astype(jnp.int32)


def token_counts(token_arrays: Iterable, vocab_size: int) -> np.ndarray:
    """``[V]`` int64 occurrences of every token id in ``token_arrays`` (negative ids, padding, are skipped)."""
    counts_V = np.zeros(vocab_size, np.int64)
    for tokens in token_arrays:
        tokens = np.asarray(tokens).ravel()
        tokens = tokens[tokens >= 0]
        if tokens.size and tokens.max() >= vocab_size:
            raise ValueError(f"token id {int(tokens.max())} is outside the vocabulary [0, {vocab_size})")
        counts_V += np.bincount(tokens, minlength=vocab_size)
    return counts_V


def most_frequent_tokens(counts_V, k: int) -> np.ndarray:
    """The sorted ids of the ``k`` most frequent tokens (ties: the lower id)."""
    counts_V = np.asarray(counts_V)
    if not 1 <= k <= counts_V.size:
        raise ValueError(f"draft vocabulary size must be in [1, {counts_V.size}], got {k}")
    return np.sort(np.argsort(-counts_V, kind="stable")[:k]).astype(np.int32)


def save_draft_vocab(ids, directory: str | os.PathLike) -> str:
    """Writes ``directory/draft_vocab.npy``; returns its path."""
    path = os.path.join(os.fspath(directory), VOCAB_NAME)
    os.makedirs(os.fspath(directory), exist_ok=True)
    np.save(path, np.asarray(ids, np.int32), allow_pickle=False)
    return path


def read_draft_vocab(path: str | os.PathLike, vocab_size: int) -> np.ndarray:
    """The checked ids of a ``.npy`` file."""
    path = os.fspath(path)
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise WeightsError(f"{path}: not a readable .npy array ({type(e).__name__}: {e})") from None
    return check_draft_vocab(ids, vocab_size, where=path)


def load_draft_vocab(directory: str | os.PathLike, vocab_size: int) -> np.ndarray | None:
    """The checked ids of ``directory/draft_vocab.npy``, or ``None`` where there is none."""
    path = os.path.join(os.fspath(directory), VOCAB_NAME)
    return read_draft_vocab(path, vocab_size) if os.path.isfile(path) else None
