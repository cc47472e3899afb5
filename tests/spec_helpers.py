"""Tiny targets and drafts (random, oracle) shared by the speculative-decoding tests."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np

from longspec_jax import testing
from longspec_jax.testing import TINY, random_draft, tiny_target
from longspec_jax.draft import Draft

__all__ = ["TINY", "ORACLE_SLOTS", "tiny_target", "random_draft", "oracle_draft", "noisy_oracle_draft",
           "record_tree_passes"]

ORACLE_SLOTS = 512


def oracle_draft(base: Draft, prompts, continuations, wrong_every: int = 0, phase: int = 0,
                 vocab_size: int = TINY.vocab_size, slots: int = ORACLE_SLOTS) -> Draft:
    """:func:`longspec_jax.testing.oracle_draft` with the tiny test model's defaults."""
    return testing.oracle_draft(base, prompts, continuations, vocab_size, slots, wrong_every, phase)


def noisy_oracle_draft(base: Draft, prompts, continuations, wrong_rate: float, seed: int,
                       vocab_size: int = TINY.vocab_size, slots: int = ORACLE_SLOTS) -> Draft:
    """:func:`oracle_draft` left unsteered (``base``'s own logits) at random positions, each with probability
    ``wrong_rate``: 0 is the perfect oracle, 1 is ``base`` itself, and every rate runs one compiled program."""
    draft = oracle_draft(base, prompts, continuations, vocab_size=vocab_size, slots=slots)
    unsteered = np.random.default_rng(seed).random(draft.hook_data.shape) < wrong_rate
    return dataclasses.replace(draft, hook_data=jnp.where(unsteered, -1, draft.hook_data))  # one_hot(-1) = 0


def record_tree_passes(monkeypatch) -> list[int]:
    """The node count of every verification pass traced from now on (``infer.speculative.forward_tree``'s
    tokens), appended to the returned list."""
    speculative = importlib.import_module("infer.speculative")
    forward_tree, passes = speculative.forward_tree, []

    def recorded(params, config, tokens_BxT, *args, **kwargs):
        passes.append(tokens_BxT.shape[1])
        return forward_tree(params, config, tokens_BxT, *args, **kwargs)

    monkeypatch.setattr(speculative, "forward_tree", recorded)
    return passes
