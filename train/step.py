"""One optimizer step of draft training, and the offline evaluation of a draft, as pure functions.

A step: for each micro-batch, the frozen target's causal forward (no gradient) gives its last-layer K/V at the
sequence's (anchor-offset) positions; the draft runs over the same positions with flash noisy cross-attention;
next-token cross-entropy (plus an optional KL term against the target) goes through the shared LM head in
chunks, or through its columns of the run's draft vocabulary (``StepSettings.vocab``). Gradients are summed over
micro-batches, divided by the number of label tokens, clipped, and applied by AdamW with warmup + cosine. Master
weights and optimizer state are float32; compute is ``compute_dtype``.
Each sequence's draws come from ``fold_in(fold_in(PRNGKey(seed), step), row)`` (``row``: its place in the global
batch), so a resumed run draws what an uninterrupted one does, however the batch is split.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from longspec_jax.config import TargetConfig
from longspec_jax.draft import DraftConfig, DraftLayer
from longspec_jax.draft_vocab import DraftVocab, gather_draft_vocab
from longspec_jax.target import causal_forward, embed_tokens
from train.config import AnchorSection, OptimSection
from train.loss import TokenSums, chunked_argmax, chunked_token_sums
from train.recipe import anchor_offset_positions, draft_train_hidden, noise_shifts


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Everything static about the step (a jit cache key)."""

    target: TargetConfig
    draft: DraftConfig
    compute_dtype: Any
    anchor: AnchorSection
    max_shift: int
    kl_weight: float
    chunk_tokens: int
    seed: int
    vocab: tuple[int, ...] | None = None  # the draft vocabulary the loss is over (sorted ids); None: every token
    impl: str = "auto"

    @property
    def module(self) -> DraftLayer:
        return DraftLayer(self.draft, self.compute_dtype)

    def loss_vocab(self, target_params) -> DraftVocab | None:
        """The loss's draft vocabulary with the LM head's columns for it, gathered once per step."""
        return None if self.vocab is None else gather_draft_vocab(target_params, self.vocab, self.target.vocab_size)


@struct.dataclass
class TrainState:
    step: jax.Array   # int32 scalar: optimizer steps taken
    params: dict      # draft variables {"params": ...}, float32
    opt_state: Any


def lm_head_kernel(target_params) -> jax.Array:
    """The shared LM head ``[d, V]`` (the embedding's transpose when tied)."""
    return target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T


def make_optimizer(optim: OptimSection, total_steps: int):
    """AdamW (decay on matrices only) after global-norm clipping; linear warmup over ``warmup_ratio`` of the
    steps, then cosine to ``lr * min_lr_ratio``. Returns ``(optimizer, schedule)``."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=int(optim.warmup_ratio * total_steps),
        decay_steps=total_steps, end_value=optim.lr * optim.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    optimizer = optax.chain(optax.clip_by_global_norm(optim.clip),
                            optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                                        weight_decay=optim.weight_decay, mask=decay_mask))
    return optimizer, schedule


def init_state(params, optimizer) -> TrainState:
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))


def _draft_hidden(s: StepSettings, params, target_params, tokens_BxT, positions_BxT, target_k, target_v, shift_B):
    variables = jax.tree.map(lambda p: p.astype(s.compute_dtype), params)
    x_BxTxd = embed_tokens(target_params, tokens_BxT).astype(s.compute_dtype)
    return draft_train_hidden(s.module, variables, x_BxTxd, positions_BxT, target_k, target_v, shift_B, impl=s.impl)


def micro_batch_sums(s: StepSettings, params, target_params, batch: dict, row_keys_B,
                     vocab: DraftVocab | None = None) -> TokenSums:
    """Loss sums of one micro-batch: ``batch`` holds ``tokens [B, T]``, ``targets [B, T]`` (1 where the token
    is a training target, predicted from the position before it) and ``lengths [B]``; ``row_keys_B`` one
    random key per sequence (its anchor-offset positions and noise shift); ``vocab``: the loss's draft
    vocabulary (:meth:`StepSettings.loss_vocab`)."""
    tokens_BxT, lengths_B = batch["tokens"], batch["lengths"]
    B, T = tokens_BxT.shape
    k_pos = jax.vmap(lambda k: jax.random.fold_in(k, 0))(row_keys_B)
    k_noise = jax.vmap(lambda k: jax.random.fold_in(k, 1))(row_keys_B)
    if s.anchor.enabled:
        positions_BxT = anchor_offset_positions(k_pos, lengths_B, T, s.anchor, s.target.max_position_embeddings)
    else:
        positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    target_k, target_v, target_h = jax.lax.stop_gradient(causal_forward(
        target_params, s.target, tokens_BxT, positions_BxT, final_hidden=s.kl_weight > 0, impl=s.impl))
    y_BxTxd = _draft_hidden(s, params, target_params, tokens_BxT, positions_BxT, target_k, target_v,
                            noise_shifts(k_noise, s.max_shift))
    d = y_BxTxd.shape[-1]
    return chunked_token_sums(y_BxTxd[:, :-1].reshape(-1, d), lm_head_kernel(target_params),
                              tokens_BxT[:, 1:].reshape(-1), batch["targets"][:, 1:].reshape(-1), s.chunk_tokens,
                              None if target_h is None else target_h[:, :-1].reshape(-1, d), vocab)


def train_step(s: StepSettings, optimizer, schedule, state: TrainState, target_params, batch: dict):
    """One optimizer step over ``batch`` (arrays ``[micro_batches, rows, ...]``). Returns the new state and
    the step's metrics (means over its label tokens; ``grad_norm`` before clipping)."""
    key = jax.random.fold_in(jax.random.PRNGKey(s.seed), state.step)
    micro_batches, rows = batch["tokens"].shape[:2]
    vocab = s.loss_vocab(target_params)

    def objective(params, micro, row_keys_B):
        sums = micro_batch_sums(s, params, target_params, micro, row_keys_B, vocab)
        return sums.nll + s.kl_weight * sums.kl, sums

    def accumulate(carry, xs):
        grads, sums = carry
        micro, index = xs
        row_keys_B = jax.vmap(lambda r: jax.random.fold_in(key, r))(index * rows + jnp.arange(rows))
        (_, micro_sums), micro_grads = jax.value_and_grad(objective, has_aux=True)(state.params, micro, row_keys_B)
        return (jax.tree.map(jnp.add, grads, micro_grads), sums + micro_sums), None

    zero = jnp.float32(0)
    init = (jax.tree.map(jnp.zeros_like, state.params), TokenSums(nll=zero, kl=zero, correct=zero, count=zero))
    (grads, sums), _ = jax.lax.scan(accumulate, init, (batch, jnp.arange(micro_batches)))
    count = jnp.maximum(sums.count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                           opt_state=opt_state)
    metrics = {"loss": sums.nll / count, "kl": sums.kl / count, "accuracy": sums.correct / count,
               "grad_norm": jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads))), "lr": schedule(state.step),
               "label_tokens": sums.count}
    return new_state, metrics


def eval_counts(s: StepSettings, params, target_params, batch: dict, depth: int) -> dict:
    """Offline measures of a draft on plain positions (sums; divide as :func:`eval_summary` does), its
    predictions over the loss's draft vocabulary where there is one:

    * ``nll`` / ``correct`` of the root prediction (noise shift 1, the gap of step 0) against the data;
    * ``agree``: root prediction == the target's argmax;
    * ``accepted``: per root position r, the accepted length of a greedy chain of ``depth`` drafts against the
      target's argmax, teacher-forced on the data: step k (gap k + 1) counts if the draft's argmax at r + k
      equals the target's and, for k >= 1, the data token at r + k is the target's argmax at r + k - 1 (the
      context the chain would have). ``roots`` counts the positions r with r + depth < length.
    """
    tokens_BxT, lengths_B, targets_BxT = batch["tokens"], batch["lengths"], batch["targets"]
    B, T = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    target_k, target_v, target_h = causal_forward(target_params, s.target, tokens_BxT, positions_BxT,
                                                  final_hidden=True, impl=s.impl)
    w_dxV, vocab = lm_head_kernel(target_params), s.loss_vocab(target_params)
    d = target_h.shape[-1]
    greedy_BxT = chunked_argmax(target_h.reshape(-1, d), w_dxV, s.chunk_tokens).reshape(B, T)
    preds = []
    for shift in range(1, depth + 1):
        y_BxTxd = _draft_hidden(s, params, target_params, tokens_BxT, positions_BxT, target_k, target_v,
                                jnp.full((B,), shift, jnp.int32))
        if shift == 1:
            root = chunked_token_sums(y_BxTxd[:, :-1].reshape(-1, d), w_dxV, tokens_BxT[:, 1:].reshape(-1),
                                      targets_BxT[:, 1:].reshape(-1), s.chunk_tokens, vocab=vocab)
        preds.append(chunked_argmax(y_BxTxd.reshape(-1, d), w_dxV, s.chunk_tokens, vocab).reshape(B, T))
    accepted_BxT, roots_BxT = chain_accepted(jnp.stack(preds), greedy_BxT, tokens_BxT, lengths_B)
    labelled_BxT = targets_BxT[:, 1:].astype(bool)
    return {"nll": root.nll, "correct": root.correct, "count": root.count,
            "agree": jnp.sum((preds[0][:, :-1] == greedy_BxT[:, :-1]) & labelled_BxT),
            "accepted": jnp.sum(jnp.where(roots_BxT, accepted_BxT, 0)), "roots": jnp.sum(roots_BxT)}


def chain_accepted(preds_KxBxT, greedy_BxT, tokens_BxT, lengths_B):
    """Accepted length of the greedy chain rooted at each position r (``[B, T]``) and which roots count
    (``r + K < length``). ``preds[k]``: the draft's argmax at each position with gap k + 1; step k counts if
    ``preds[k][r + k] == greedy[r + k]`` and, for k >= 1, ``tokens[r + k] == greedy[r + k - 1]``; the chain
    stops at the first step that does not count."""
    K, B, T = preds_KxBxT.shape
    t_T = jnp.arange(T)
    steps = []
    for k in range(K):
        index_T = jnp.minimum(t_T + k, T - 1)
        ok_BxT = preds_KxBxT[k][:, index_T] == greedy_BxT[:, index_T]
        if k:
            ok_BxT &= tokens_BxT[:, index_T] == greedy_BxT[:, index_T - 1]
        steps.append(ok_BxT)
    accepted_BxT = jnp.sum(jnp.cumprod(jnp.stack(steps).astype(jnp.int32), axis=0), axis=0)
    return accepted_BxT, (t_T[None] + K) < lengths_B[:, None]


def eval_summary(counts: dict) -> dict:
    """Means from summed :func:`eval_counts`: loss, accuracy, target agreement, and the chain tau estimate."""
    n = max(float(counts["count"]), 1.0)
    roots = max(float(counts["roots"]), 1.0)
    return {"eval_loss": float(counts["nll"]) / n, "eval_accuracy": float(counts["correct"]) / n,
            "eval_target_agreement": float(counts["agree"]) / n,
            "eval_chain_tau": 1.0 + float(counts["accepted"]) / roots}
