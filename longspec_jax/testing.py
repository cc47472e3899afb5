"""Models for tests, ``--smoke`` runs and benchmarks, without a checkpoint: tiny random targets and drafts,
random targets of real shapes, and oracle drafts.

An oracle draft is a real draft whose logits are steered, through ``Draft.logits_hook``, towards a known
continuation (e.g. the target's own greedy output). The draft still runs in full, so timings stay real; only its
predictions are replaced. Wrong positions can be planted to make acceptance lengths vary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.config import RopeConfig, TargetConfig
from longspec_jax.draft import Draft, DraftConfig, init_draft
from longspec_jax.draft_vocab import vocab_columns
from longspec_jax.target import Target, init_target_params
from longspec_jax.tensor_parallel import group_params, target_shardings

TINY = TargetConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
ORACLE_BONUS = 1e4
# The LM head's std: logits of std ~32 leave top-2 gaps far above bf16 rounding, so the speculative path's argmax
# equals the plain one's and an oracle replaying the plain output holds. With the layers' std 0.02 the gaps were
# within rounding: on the H200, tau 1.03 with the plain output parting at token 3.
LM_HEAD_STD = 0.5


# ------------------------------------------------------------------------------------------------ tiny models

def tiny_target(seed: int, config: TargetConfig = TINY) -> Target:
    """float32 random weights; std 0.3 spreads the logits, so greedy argmax is never decided by rounding."""
    return Target(config, init_target_params(config, jax.random.PRNGKey(seed), std=0.3))


def random_draft(seed: int, config: TargetConfig = TINY, window: int = 16) -> Draft:
    return init_draft(DraftConfig.from_target(config, window=window), jax.random.PRNGKey(seed))


# ------------------------------------------------------------------------------------------ real-shape models

def random_target(s: dict, mesh, dtype, std: float) -> Target:
    """Random weights of shapes ``s``, made on the devices: sharded over ``mesh``, or on one device."""
    config = TargetConfig(model_type="llama", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                          intermediate_size=s["intermediate_size"], num_layers=s["num_layers"],
                          num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                          rms_norm_eps=s["rms_norm_eps"], rope=RopeConfig(theta=s["rope_theta"]),
                          max_position_embeddings=2**30)
    key = jax.random.PRNGKey(0)

    def init(k):
        params = init_target_params(config, k, dtype, std=std)
        return {**params, "lm_head": params["lm_head"] * (LM_HEAD_STD / std)} if "lm_head" in params else params

    if mesh is None:
        return Target(config, jax.jit(init)(key))
    grouped = lambda k: group_params(init(k), config, mesh.shape["model"])
    shardings = target_shardings(jax.eval_shape(grouped, key), config, mesh)
    return Target(config, jax.jit(grouped, out_shardings=shardings)(key), mesh=mesh)


# ---------------------------------------------------------------------------------------------- oracle drafts

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
