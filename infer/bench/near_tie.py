"""Where a bf16 speculative output leaves the plain greedy output, and whether that is a near-tie.

Lossless decoding is exact in float32; in bf16 two attention paths (plain decode vs tree verification) round
differently, so greedy outputs may part where the target's two best logits are closer than that rounding
(docs/architecture.md, "Numerics and testing"). These helpers find the first divergence and measure the float32
top-2 gap there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from infer.generate import pad_prompts
from longspec_jax.checkpoint import load_target
from longspec_jax.kv_cache import init_cache
from longspec_jax.target import forward, lm_head_logits, prefill

__all__ = ["first_divergence", "top2_logit_gap", "greedy_top2_gaps", "NEAR_TIE_GAP", "parting", "partings",
           "earliest_parting", "lossless_cell", "float32_reference"]

# bf16 logits of the fixture differ between attention paths by up to a few hundredths: a bf16 greedy output may
# part from another only where the float32 top-2 logit gap is below this (a near-tie).
NEAR_TIE_GAP = 0.1


def first_divergence(ours, ref) -> int | None:
    """Index of the first differing token over the common length, or None."""
    n = min(len(ours), len(ref))
    diff = np.nonzero(np.asarray(ours[:n]) != np.asarray(ref[:n]))[0]
    return int(diff[0]) if diff.size else None


def parting(target32, prompt, ours, ref, tolerance: float = NEAR_TIE_GAP) -> dict | None:
    """None where ``ours`` equals ``ref`` over their common length; else where it parts (``at``), the float32
    top-2 logit gap after ``prompt + ref[:at]`` (``target32``: the target's function in float32) and whether that
    is a near-tie. A parting that is not a near-tie breaks losslessness."""
    at = first_divergence(ours, ref)
    if at is None:
        return None
    gap = top2_logit_gap(target32, [int(t) for t in prompt] + [int(t) for t in ref[:at]])
    return dict(at=at, f32_top2_gap=gap, near_tie=gap < tolerance)


def partings(load_target32, prompts, outputs, refs, tolerance: float = NEAR_TIE_GAP) -> list[dict | None]:
    """:func:`parting` of each (prompt, output, reference); ``load_target32()`` runs only if some output parts."""
    if all(first_divergence(o, r) is None for o, r in zip(outputs, refs)):
        return [None] * len(outputs)
    target32 = load_target32()
    return [parting(target32, p, o, r, tolerance) for p, o, r in zip(prompts, outputs, refs)]


def earliest_parting(partings: list) -> dict | None:
    """The parting at the smallest position (the first row's on a tie), None if no output parts."""
    parted = [p for p in partings if p is not None]
    return min(parted, key=lambda p: p["at"]) if parted else None


def float32_reference(path: str | None, target):
    """A cached zero-argument loader of the model whose float32 logits judge partings: the HF directory ``path``
    in float32 (for a padded target, the small model computing its function), or ``target`` itself when
    ``path`` is None (a float32 smoke model). Nothing is loaded until it is called."""
    @functools.cache
    def load():
        return target if path is None else load_target(path, dtype=jnp.float32, load_tokenizer=False)
    return load


def lossless_cell(partings: list) -> str:
    """``equal/total``, then how many partings are near-ties and how many are NOT (a lossless failure)."""
    equal = sum(p is None for p in partings)
    near = sum(p is not None and p["near_tie"] for p in partings)
    bad = len(partings) - equal - near
    notes = ([f"{near} near-tie"] if near else []) + ([f"{bad} NOT a near-tie"] if bad else [])
    return f"{equal}/{len(partings)}" + (f" ({', '.join(notes)})" if notes else "")


def top2_logit_gap(target, prefix, chunk: int = 512) -> float:
    """Gap between the two largest next-token logits after ``prefix`` (chunked prefill, XLA attention, in the
    target's dtype: load it in float32 for the reference gap)."""
    return float(greedy_top2_gaps(target, prefix, 1, chunk)[1][0])


@functools.partial(jax.jit, static_argnames=("config", "num_new", "chunk", "capacity"))
def _greedy_gaps(params, tokens_1xT, length_1, *, config, num_new: int, chunk: int, capacity: int):
    cache = init_cache(config.num_layers, 1, capacity, config.num_kv_heads, config.head_dim,
                       params["embed"].dtype)
    logits, cache = prefill(params, config, tokens_1xT, length_1, cache, chunk=chunk, impl="xla")

    def step(carry, _):
        logits_1xV, cache = carry
        top2 = jax.lax.top_k(logits_1xV.astype(jnp.float32), 2)[0]
        token_1 = jnp.argmax(logits_1xV, axis=-1).astype(jnp.int32)
        hidden, cache = forward(params, config, token_1[:, None], cache.lengths[:, None], cache,
                                jnp.ones((1, 1, 1), bool), impl="xla")
        cache = cache.replace(lengths=cache.lengths + 1)
        return (lm_head_logits(params, hidden)[:, 0], cache), (token_1[0], top2[0, 0] - top2[0, 1])

    _, (tokens, gaps) = jax.lax.scan(step, (logits, cache), None, length=num_new)
    return tokens, gaps


def greedy_top2_gaps(target, prompt, num_new: int, chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """The target's greedy continuation of ``prompt`` (XLA attention, in the target's dtype) and, at each of
    its ``num_new`` steps, the gap between the two largest logits."""
    T = -(-len(prompt) // chunk) * chunk
    tokens_1xT, length_1 = pad_prompts([np.asarray(prompt, np.int32)], T)
    capacity = -(-(T + num_new) // chunk) * chunk
    out, gaps = _greedy_gaps(target.params, tokens_1xT, length_1, config=target.config, num_new=num_new,
                             chunk=chunk, capacity=capacity)
    return np.asarray(out), np.asarray(gaps, np.float32)
