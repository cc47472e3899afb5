"""Tiny targets and drafts (random, oracle) shared by the speculative-decoding tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.config import TargetConfig
from longspec_jax.draft import Draft, DraftConfig, init_draft
from longspec_jax.target import Target, init_target_params

TINY = TargetConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
ORACLE_SLOTS = 512


def tiny_target(seed: int, config: TargetConfig = TINY) -> Target:
    # std 0.3 spreads the logits, so greedy argmax is never decided by float32 rounding.
    return Target(config, init_target_params(config, jax.random.PRNGKey(seed), std=0.3))


def random_draft(seed: int, config: TargetConfig = TINY, window: int = 16) -> Draft:
    return init_draft(DraftConfig.from_target(config, window=window), jax.random.PRNGKey(seed))


def oracle_hook(logits_BxTxV, positions_BxT, next_token_BxS):
    """Adds a large bonus to the token the oracle table says follows each position."""
    favoured = jnp.take_along_axis(next_token_BxS, positions_BxT, axis=1)
    return logits_BxTxV + 50.0 * jax.nn.one_hot(favoured, logits_BxTxV.shape[-1])


def oracle_draft(base: Draft, prompts, continuations, wrong_every: int = 0, phase: int = 0,
                 vocab_size: int = TINY.vocab_size, slots: int = ORACLE_SLOTS) -> Draft:
    """A draft that predicts the given continuation (the target's own greedy output), wrong at every
    ``wrong_every``-th position when > 0, so acceptance lengths vary."""
    table = np.zeros((len(prompts), slots), np.int32)
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
        sequence = list(prompt) + [int(t) for t in cont if t >= 0]
        table[b, :len(sequence) - 1] = sequence[1:]
        if wrong_every:
            wrong = (np.arange(slots) + phase) % wrong_every == 0
            table[b, wrong] = (table[b, wrong] + 1) % vocab_size
    return Draft(base.config, base.variables, logits_hook=oracle_hook, hook_data=jnp.asarray(table))
