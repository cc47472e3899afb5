"""Tiny random targets and drafts: what ``--smoke`` runs on the CPU (and the speculative-decoding tests use)."""

from __future__ import annotations

import jax

from longspec_jax.config import TargetConfig
from longspec_jax.draft import Draft, DraftConfig, init_draft
from longspec_jax.target import Target, init_target_params

TINY = TargetConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)


def tiny_target(seed: int, config: TargetConfig = TINY) -> Target:
    """float32 random weights; std 0.3 spreads the logits, so greedy argmax is never decided by rounding."""
    return Target(config, init_target_params(config, jax.random.PRNGKey(seed), std=0.3))


def random_draft(seed: int, config: TargetConfig = TINY, window: int = 16) -> Draft:
    return init_draft(DraftConfig.from_target(config, window=window), jax.random.PRNGKey(seed))
