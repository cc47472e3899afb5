"""Tiny targets and drafts (random, oracle) shared by the speculative-decoding tests."""

from __future__ import annotations

from infer.bench import oracle
from infer.bench.tiny import TINY, random_draft, tiny_target
from longspec_jax.draft import Draft

__all__ = ["TINY", "ORACLE_SLOTS", "tiny_target", "random_draft", "oracle_draft"]

ORACLE_SLOTS = 512


def oracle_draft(base: Draft, prompts, continuations, wrong_every: int = 0, phase: int = 0,
                 vocab_size: int = TINY.vocab_size, slots: int = ORACLE_SLOTS) -> Draft:
    """:func:`infer.bench.oracle.oracle_draft` with the tiny test model's defaults."""
    return oracle.oracle_draft(base, prompts, continuations, vocab_size, slots, wrong_every, phase)
