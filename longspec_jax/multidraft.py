"""Lossless verification of trees sampled from the draft (multi-draft speculative sampling).

The trees come from :func:`longspec_jax.tree.sample_children`: a node's children are draws from the draft's
tempered distribution q = softmax(logp / T) without replacement, or (``top_plus_one``) its top tokens and one draw.
Verification is recursive rejection sampling down the tree. At a node whose target sampling distribution is p,
the children are tried in rank order: child i was drawn from q_i (q without its earlier siblings, renormalised;
a point mass for a deterministic child) and is accepted with probability min(1, p_i(x_i) / q_i(x_i)), with
p_1 = p; a rejection sets p_{i+1} = max(p_i - q_i, 0), renormalised. The walk moves to the accepted child; where
every child is rejected it emits a draw from the last residual, and at a leaf a draw from p. Each step hands on
exactly p_i's distribution given everything drawn before it, so every emitted token is an exact draw from the
target's p given its prefix, for any q: the draft decides only how often the walk goes deep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.draft_vocab import scatter_to_vocab
from longspec_jax.sampling import categorical, greedy_rows, sampling_log_probs, split, tempered, uniform
from longspec_jax.tree import Acceptance, Tree, TreeSpec, check_sampling_kind

def deterministic_ranks(spec: TreeSpec, kind: str) -> np.ndarray:
    """``[N, K]`` bool, like ``spec.children_table``: which children are the draft's top tokens rather than
    draws (``top_plus_one``: every child of a node but its last)."""
    check_sampling_kind(kind)
    table = spec.children_table
    if kind == "without_replacement":
        return np.zeros(table.shape, bool)
    num_children = np.sum(table >= 0, axis=1, keepdims=True)
    return np.arange(table.shape[1])[None] < num_children - 1


def _row(x_BxNx, node_B):
    return jnp.take_along_axis(x_BxNx, node_B[:, None, None], axis=1)[:, 0]


def rejection_step(p_BxV, logq_BxV, excluded_BxV, token_B, live_B, deterministic_B, u_B):
    """One step of recursive rejection: accept ``token`` (drawn from q without the excluded tokens, or the
    draft's top token where ``deterministic``) with probability min(1, p / q_i); on a rejection, p becomes the
    renormalised residual max(p - q_i, 0). Returns (accepted, p, excluded)."""
    V = p_BxV.shape[-1]
    token_BxV = jax.nn.one_hot(token_B, V, dtype=bool)
    kept_BxV = jnp.where(excluded_BxV, -jnp.inf, logq_BxV)
    q_BxV = jnp.exp(kept_BxV - jax.nn.logsumexp(kept_BxV, axis=-1, keepdims=True))
    q_BxV = jnp.where(deterministic_B[:, None], token_BxV.astype(jnp.float32), q_BxV)
    p_token_B = jnp.sum(jnp.where(token_BxV, p_BxV, 0.0), axis=-1)
    q_token_B = jnp.sum(jnp.where(token_BxV, q_BxV, 0.0), axis=-1)
    accepted_B = live_B & (u_B * q_token_B < p_token_B)
    residual_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)
    mass_B = jnp.sum(residual_BxV, axis=-1)
    rejected_B = live_B & ~accepted_B & (mass_B > 0)
    p_BxV = jnp.where(rejected_B[:, None], residual_BxV / jnp.where(mass_B > 0, mass_B, 1.0)[:, None], p_BxV)
    return accepted_B, p_BxV, excluded_BxV | (token_BxV & live_B[:, None])


def multidraft_acceptance(tree: Tree, target_logits_BxNxV: jax.Array, key: jax.Array, spec: TreeSpec,
                          sampling, kind: str, step=rejection_step) -> Acceptance:
    """The recursive-rejection walk of the module docstring down a sampled tree of static topology ``spec``.
    ``tree.draft_logp`` holds the draft's log-probs after every node; q is their softmax at the sampling
    temperature, as :func:`longspec_jax.tree.sample_children` drew from (over a draft vocabulary's columns
    ``tree.draft_ids``, scattered to the target's vocabulary, zero elsewhere, at the nodes the walk visits).
    ``sampling``: a :class:`~longspec_jax.sampling.SamplingConfig`, or per-row
    :class:`~longspec_jax.sampling.RowSampling` (``key`` then one key per row), whose greedy rows' children are
    their draft's top tokens, tried as point masses against the target's argmax.
    ``step``: one trial of a child (:func:`rejection_step`; the tests pass biased ones)."""
    B, N, V = target_logits_BxNxV.shape
    children_NxK = jnp.asarray(spec.children_table)
    deterministic_NxK = jnp.asarray(deterministic_ranks(spec, kind))
    greedy_B = greedy_rows(sampling, 1)
    node_B = jnp.zeros((B,), jnp.int32)
    walking_B = jnp.ones((B,), bool)
    path, emitted = [node_B], []
    for d in range(spec.depth + 1):
        key, k_try, k_draw = split(key, 3)
        p_BxV = jnp.exp(sampling_log_probs(_row(target_logits_BxNxV, node_B), sampling))
        chosen_B = jnp.full((B,), -1, jnp.int32)
        if d < spec.depth:
            logq_BxV = scatter_to_vocab(jax.nn.log_softmax(tempered(_row(tree.draft_logp, node_B), sampling),
                                                           axis=-1), tree.draft_ids, V, -jnp.inf)
            excluded_BxV = jnp.zeros((B, V), bool)
            K = int(max(spec.branching[d]))
            u_BxK = uniform(k_try, (B, K))
            for r in range(K):
                child_B = children_NxK[node_B, r]
                live_B = walking_B & (child_B >= 0) & (chosen_B < 0)
                token_B = jnp.take_along_axis(tree.tokens, jnp.maximum(child_B, 0)[:, None], axis=1)[:, 0]
                accepted_B, p_BxV, excluded_BxV = step(p_BxV, logq_BxV, excluded_BxV, token_B, live_B,
                                                       deterministic_NxK[node_B, r] | greedy_B, u_BxK[:, r])
                chosen_B = jnp.where(accepted_B, child_B, chosen_B)
        draw_B = categorical(k_draw, jnp.log(p_BxV)).astype(jnp.int32)
        moved_B = chosen_B >= 0
        chosen_token_B = jnp.take_along_axis(tree.tokens, jnp.maximum(chosen_B, 0)[:, None], axis=1)[:, 0]
        emitted.append(jnp.where(moved_B, chosen_token_B, draw_B))
        walking_B = walking_B & moved_B
        node_B = jnp.where(walking_B, chosen_B, node_B)
        path.append(node_B)
    count_B = 1 + sum(jnp.not_equal(path[d + 1], path[d]).astype(jnp.int32) for d in range(spec.depth))
    # slot d: the accepted child at depth d + 1, or the draw where the walk stopped (slots after it: unused)
    return Acceptance(path_BxA=jnp.stack(path[:-1], axis=1), count_B=count_B, tokens_BxA=jnp.stack(emitted, axis=1))
