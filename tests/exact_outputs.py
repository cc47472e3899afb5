"""Exact output distributions of a tiny target, computed without the library's model or sampling code, and
goodness-of-fit statistics of sampled outputs against them.

A float64 NumPy re-implementation of the Llama target forward (RMSNorm, rotate-half RoPE, grouped-query causal
attention, SwiGLU MLP) and of temperature / top-p gives every output a generate call can produce for a short
generation window, with its exact probability. Two statistics compare a large batch of sampled outputs with it:

- Pearson's chi-square over whole outputs (omnibus: any difference in the joint distribution of the tokens);
- a rank-residual test: for every emitted token, the one-hot of its rank in the target's conditional
  distribution (0 = most likely) minus the probabilities of the ranks, summed over the output. Each term has
  mean zero given its prefix, so the sum has mean zero under the target, and its exact covariance comes from
  the enumeration. With V - 1 degrees of freedom instead of hundreds of cells, it sees small drifts towards or
  away from the target's top tokens (a sampler that is slightly greedy or slightly flat) that the chi-square
  spreads too thin. For outputs too long to enumerate, the same residual sums over their tokens, each against
  its own conditional (:func:`sequential_rank_residual_pvalue`).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from scipy import stats

from longspec_jax.config import TargetConfig

NUCLEUS_MARGIN = 1e-5  # 20x the float32 error of cumulative probabilities measured on the test target (5e-7)


# ------------------------------------------------------------------------------------------ the target, in NumPy


def _rms_norm(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x_RxTxHxD, theta, positions_T):
    D = x_RxTxHxD.shape[-1]
    angles = positions_T[:, None] * theta ** (-np.arange(0, D, 2) / D)[None]        # [T, D/2]
    angles = np.concatenate([angles, angles], -1)[None, :, None]
    rotated = np.concatenate([-x_RxTxHxD[..., D // 2:], x_RxTxHxD[..., :D // 2]], -1)
    return x_RxTxHxD * np.cos(angles) + rotated * np.sin(angles)


def target_logits(params: dict, config: TargetConfig, tokens_RxT: np.ndarray, positions_T=None,
                  last: int | None = None) -> np.ndarray:
    """Causal-LM logits ``[R, T, V]`` (float64) of whole sequences at positions 0..T-1 (or ``positions_T``),
    without a cache. With ``last``, the logits of the last ``last`` tokens only, ``[R, last, V]``: the last layer
    attends from those queries alone, so a one-layer target costs O(T) per logit row, not O(T^2).
    Plain Llama: default RoPE, no biases."""
    assert config.model_type == "llama" and config.rope.rope_type == "default"
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)
    f64 = lambda a: np.asarray(a, np.float64)
    R, T = tokens_RxT.shape
    H, K, Dh, I = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    positions_T = f64(np.arange(T) if positions_T is None else positions_T)
    x = f64(params["embed"])[tokens_RxT]
    for i, layer in enumerate(params["layers"]):
        first = T - last if last is not None and i == len(params["layers"]) - 1 else 0   # queries first..T-1
        qkv = _rms_norm(x, f64(layer["attn_norm"]), config.rms_norm_eps) @ f64(layer["wqkv"])
        q = _rope(qkv[:, first:, :H * Dh].reshape(R, T - first, H, Dh), config.rope.theta, positions_T[first:])
        k = _rope(qkv[..., H * Dh:(H + K) * Dh].reshape(R, T, K, Dh), config.rope.theta, positions_T)
        v = qkv[..., (H + K) * Dh:].reshape(R, T, K, Dh)
        k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)   # query head h reads kv head h // G
        causal = np.arange(first, T)[:, None] >= np.arange(T)[None]
        scores = np.where(causal, np.einsum("rthd,rshd->rhts", q, k) / np.sqrt(Dh), -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        x = x[:, first:] + np.einsum("rhts,rshd->rthd", weights, v).reshape(R, T - first, H * Dh) @ f64(layer["wo"])
        gate_up = _rms_norm(x, f64(layer["mlp_norm"]), config.rms_norm_eps) @ f64(layer["w_gate_up"])
        gate, up = gate_up[..., :I], gate_up[..., I:]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f64(layer["w_down"])
    head = f64(params["lm_head"]) if "lm_head" in params else f64(params["embed"]).T
    return _rms_norm(x, f64(params["final_norm"]), config.rms_norm_eps) @ head


def softmax(logits_xV: np.ndarray, temperature: float) -> np.ndarray:
    z = logits_xV / temperature
    probs = np.exp(z - z.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def nucleus(probs_xV: np.ndarray, top_p: float) -> np.ndarray:
    """Restricts each row to its smallest most-likely set of tokens whose mass reaches ``top_p``, renormalised."""
    order = np.argsort(-probs_xV, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs_xV, order, -1)
    keep = np.zeros(probs_xV.shape, bool)
    np.put_along_axis(keep, order, np.cumsum(sorted_probs, -1) - sorted_probs < top_p, -1)
    kept = np.where(keep, probs_xV, 0.0)
    return kept / kept.sum(-1, keepdims=True)


# ------------------------------------------------------------------------------------------ exact outputs


@dataclasses.dataclass
class ExactOutputs:
    """Every output of plain sampling after one prompt and its exact probability.

    An output is the tuple of generated tokens: ``max_new_tokens`` of them, or fewer ending at the first EOS
    (generation stops there). ``conditionals[h]`` is the sampling distribution ``[V]`` of the next token after
    prefix ``h``; ``nucleus_risk`` is the probability of reaching a prefix whose top-p cut lies within
    :data:`NUCLEUS_MARGIN` of ``top_p`` (where float32 sampling may keep a different set of tokens).
    """

    prob: dict[tuple[int, ...], float]
    conditionals: dict[tuple[int, ...], np.ndarray]
    nucleus_risk: float

    def __post_init__(self):
        self._ranked = {}
        for prefix, probs in self.conditionals.items():
            order = np.argsort(-probs, kind="stable")
            self._ranked[prefix] = (np.argsort(order), probs[order])   # rank of each token, sorted probs

    def rank_residual(self, output: tuple[int, ...]) -> np.ndarray:
        """``sum_t onehot(rank of x_t) - p_sorted(. | x_<t)`` ``[V]``: how often the output took the target's
        r-th most likely token, minus how often it was expected to, given its own prefixes. Mean zero under
        the target's distribution."""
        total = 0.0
        for t, token in enumerate(output):
            rank, sorted_probs = self._ranked[output[:t]]
            total = total - sorted_probs
            total[rank[token]] += 1.0
        return total


def enumerate_outputs(params: dict, config: TargetConfig, prompt, max_new_tokens: int, eos: int,
                      temperature: float, top_p: float) -> ExactOutputs:
    """:class:`ExactOutputs` after ``prompt``: ``P(x_1..x_n) = prod_t p(x_t | prompt, x_<t)``, with every
    conditional read from one causal forward over the prompt and each EOS-free continuation of length
    ``max_new_tokens - 1``."""
    V, n = config.vocab_size, max_new_tokens
    others = [t for t in range(V) if t != eos]
    continuations = np.array(list(itertools.product(others, repeat=n - 1)), np.int64).reshape(-1, n - 1)
    rows = np.concatenate([np.broadcast_to(np.asarray(prompt), (len(continuations), len(prompt))),
                           continuations], axis=1)
    logits = target_logits(params, config, rows)[:, len(prompt) - 1:]              # [R, n, V]
    probs = softmax(logits, temperature)
    sampling = nucleus(probs, top_p) if top_p < 1 else probs
    near_cut = np.abs(np.cumsum(-np.sort(-probs, -1), -1)[..., :-1] - top_p).min(-1) < NUCLEUS_MARGIN
    conditionals, risky = {}, set()
    for continuation, row_probs, row_near in zip(continuations, sampling, near_cut):
        for t in range(n):
            conditionals[tuple(continuation[:t])] = row_probs[t]
            if row_near[t] and top_p < 1:
                risky.add(tuple(continuation[:t]))
    prob, reach = {}, {(): 1.0}
    for prefix in sorted(conditionals, key=len):                  # parents before children
        for token, p in enumerate(conditionals[prefix]):
            if token == eos or len(prefix) == n - 1:
                prob[prefix + (token,)] = reach[prefix] * p
            else:
                reach[prefix + (token,)] = reach[prefix] * p
    return ExactOutputs(prob=prob, conditionals=conditionals, nucleus_risk=sum(reach[h] for h in risky))


# ------------------------------------------------------------------------------------------ statistics


def impossible_outputs(samples: list[tuple[int, ...]], exact: ExactOutputs) -> list[tuple[int, ...]]:
    """The sampled outputs that have probability zero (tokens outside the nucleus, tokens after EOS, ...)."""
    return [x for x in samples if exact.prob.get(x, 0.0) == 0.0]


def chi_square_pvalue(samples_per_prompt: list[list[tuple]], exact_per_prompt: list[ExactOutputs]) -> float:
    """Pearson chi-square of whole outputs, stratified by prompt: each prompt's observed output counts against
    ``n_prompt * P(output)``; per prompt, the outputs expecting fewer than 5 samples are pooled into one cell.
    Degrees of freedom: the cells minus one per prompt."""
    chi2, dof = 0.0, 0
    for samples, exact in zip(samples_per_prompt, exact_per_prompt):
        outputs = list(exact.prob)
        index = {x: i for i, x in enumerate(outputs)}
        observed = np.bincount([index[x] for x in samples], minlength=len(outputs)).astype(np.float64)
        expected = np.array([exact.prob[x] for x in outputs]) * len(samples)
        big = expected >= 5
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        chi2 += np.sum((obs - exp) ** 2 / exp)
        dof += len(obs) - 1
    return float(stats.chi2.sf(chi2, dof))


def rank_residual_pvalue(samples_per_prompt: list[list[tuple]], exact_per_prompt: list[ExactOutputs]) -> float:
    """``S^T Cov(S)^+ S ~ chi2(rank of Cov)`` for the rank residuals ``S`` summed over all samples
    (:meth:`ExactOutputs.rank_residual`): mean zero, and ``Cov(S) = sum over prompts of n_prompt *
    E[r r^T]``, the expectation over every output of the prompt."""
    total, covariance = 0.0, 0.0
    for samples, exact in zip(samples_per_prompt, exact_per_prompt):
        outputs = [x for x, p in exact.prob.items() if p > 0]
        residuals = np.stack([exact.rank_residual(x) for x in outputs])              # [K, V]
        probs = np.array([exact.prob[x] for x in outputs])
        assert np.allclose(probs @ residuals, 0.0, atol=1e-9)
        by_output = dict(zip(outputs, residuals))
        total = total + np.sum([by_output[x] for x in samples], axis=0)
        covariance = covariance + len(samples) * (residuals.T * probs) @ residuals
    return _mean_zero_pvalue(total, covariance)


def sequential_rank_residual_pvalue(conditionals_NxV: np.ndarray, tokens_N: np.ndarray) -> float:
    """The rank-residual test for N tokens of long outputs, each drawn from ``conditionals[n]`` (its sampling
    distribution given its own prefix): ``S = sum_n onehot(rank of x_n) - p_sorted_n`` is a sum of martingale
    differences, of mean zero and covariance ``sum_n diag(p_sorted_n) - p_sorted_n p_sorted_n^T``."""
    order_NxV = np.argsort(-conditionals_NxV, -1, kind="stable")
    sorted_NxV = np.take_along_axis(conditionals_NxV, order_NxV, -1)
    ranks_N = np.argsort(order_NxV, -1)[np.arange(len(tokens_N)), tokens_N]
    total = np.bincount(ranks_N, minlength=conditionals_NxV.shape[1]) - sorted_NxV.sum(0)
    return _mean_zero_pvalue(total, np.diag(sorted_NxV.sum(0)) - sorted_NxV.T @ sorted_NxV)


def _mean_zero_pvalue(total_V: np.ndarray, covariance_VxV: np.ndarray) -> float:
    """``S^T Cov^+ S ~ chi2(rank of Cov)`` for a sum ``S`` of mean zero and covariance ``Cov``."""
    eigenvalues, eigenvectors = np.linalg.eigh(covariance_VxV)
    keep = eigenvalues > 1e-9 * eigenvalues.max()
    projected = eigenvectors[:, keep].T @ total_V
    return float(stats.chi2.sf(np.sum(projected ** 2 / eigenvalues[keep]), keep.sum()))
