"""How ``generate`` speculates when the call does not say: the tree shape and whether the draft samples it, chosen
from the temperature, the batch, the context length and the draft's measured acceptance, against a cost model
of a round on the device; plain decoding where no speculation is predicted to pay.

Tokens per round come from the draft's speculation profile
(:mod:`longspec_jax.speculation_profile`); time per round from a roofline of its phases: the draft's root step
and one step per further level (its weights and the LM head read once per step, its cross-attention over the
target's last-layer cache), and verification (the target's weights read once, or its GEMMs over batch x nodes
rows where those take longer, plus attention over the cache), each with a fixed launch cost, against a plain
step of the same batch and context. The constants were fitted to rounds measured on an H200 (``docs/results.md``
has the fit). The choice is a pure function of the call's arguments, the draft's stored profile and the device
model, never of a timing taken during the call, so it is the same in every process.
"""

from __future__ import annotations

import dataclasses

import jax

from longspec_jax.config import TargetConfig
from longspec_jax.speculation_profile import (DEFAULT_PROFILE, MAX_CHILDREN, RateTable, SpeculationProfile,
                                              allocate_branching, best_shape, expected_tokens)
from longspec_jax.tree import SAMPLING_KINDS

SAMPLED = SAMPLING_KINDS[0]             # the kind auto samples trees with
NODE_BUDGETS = (8, 16, 24, 32, 48, 64)  # verified nodes (root included) auto considers; verification pads to 8
MAX_DEPTH = 10
MIN_SPEEDUP = 1.05                      # below this predicted speedup, plain decoding
FLAT = 0.01                             # shapes predicted within 1% of the best are alike: the smallest wins


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """Roofline constants of one kind of device: effective bandwidth (bytes/s), GEMM and attention throughput
    (FLOP/s), and the fixed cost of a plain step, a verification pass and a draft step (s)."""

    name: str
    bandwidth: float
    gemm_flops: float
    attention_flops: float
    step_overhead: float
    verify_overhead: float
    draft_overhead: float


DEVICE_MODELS = {
    "H200": DeviceModel("H200", bandwidth=4.0e12, gemm_flops=6.0e14, attention_flops=2.5e14, step_overhead=0.8e-3,
                        verify_overhead=0.9e-3, draft_overhead=0.1e-3),
    "H100": DeviceModel("H100", bandwidth=2.8e12, gemm_flops=6.0e14, attention_flops=2.5e14, step_overhead=0.8e-3,
                        verify_overhead=0.9e-3, draft_overhead=0.1e-3),
}
DEFAULT_DEVICE = "H200"


def device_model(device_kind: str | None = None) -> DeviceModel:
    """The model of the first device's kind (e.g. ``NVIDIA H200``); the H200's for kinds without one (the CPU
    included: its choice is the one an H200 would make)."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    return next((m for key, m in DEVICE_MODELS.items() if key in kind), DEVICE_MODELS[DEFAULT_DEVICE])


@dataclasses.dataclass(frozen=True)
class Speculation:
    """What a generate call speculated with. ``tree_shape``: level widths, ``None`` for plain decoding;
    ``draft_sampling``: the kind of sampled tree (``without_replacement`` or ``top_plus_one``), ``None`` for the
    draft's top-k beams; ``branching``: a sampled tree's static topology; ``expected_tokens`` and
    ``predicted_speedup``: what the model predicted (``None`` where nothing was predicted); ``reason``: why."""

    tree_shape: tuple[int, ...] | None
    draft_sampling: str | None
    reason: str
    branching: tuple[tuple[int, ...], ...] | None = None
    expected_tokens: float | None = None
    predicted_speedup: float | None = None

    def describe(self) -> str:
        if self.tree_shape is None:
            return f"plain decoding ({self.reason})"
        kind = f"sampled {self.draft_sampling.replace('_', ' ')}" if self.draft_sampling else "draft's top-k beams"
        return f"tree {','.join(map(str, self.tree_shape))}, {kind} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """What one step of each model reads and computes: parameters read per step, bytes per parameter, KV bytes
    per token (all layers, and the last layer the draft reads), attention FLOPs per query per key."""

    target_params: float
    draft_params: float
    param_bytes: int
    kv_bytes_per_token: float
    last_layer_kv_bytes_per_token: float
    attention_flops_per_key: float
    layers: int

    @classmethod
    def of(cls, config: TargetConfig, param_bytes: int = 2, draft_vocab_size: int | None = None) -> "ModelSizes":
        """Sizes of ``config``'s target and its draft, whose LM head has ``draft_vocab_size`` columns (default:
        the target's vocabulary)."""
        d, H, K, Dh, I = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                          config.intermediate_size)
        attention = d * (H + 2 * K) * Dh + H * Dh * d
        layer = attention + 3 * d * I
        head = config.vocab_size * d
        draft_head = (draft_vocab_size or config.vocab_size) * d
        return cls(target_params=config.num_layers * layer + head, draft_params=layer + attention + draft_head,
                   param_bytes=param_bytes, kv_bytes_per_token=config.num_layers * 2 * K * Dh * param_bytes,
                   last_layer_kv_bytes_per_token=2 * K * Dh * param_bytes, attention_flops_per_key=4 * H * Dh,
                   layers=config.num_layers)


def plain_step_seconds(sizes: ModelSizes, device: DeviceModel, batch: int, context: int) -> float:
    weights = sizes.target_params * sizes.param_bytes / device.bandwidth
    gemm = 2 * sizes.target_params * batch / device.gemm_flops
    return max(weights, gemm) + batch * context * sizes.kv_bytes_per_token / device.bandwidth + device.step_overhead


def verify_seconds(sizes: ModelSizes, device: DeviceModel, batch: int, nodes: int, context: int) -> float:
    rows = batch * -(-nodes // 8) * 8
    weights = sizes.target_params * sizes.param_bytes / device.bandwidth
    gemm = 2 * sizes.target_params * rows / device.gemm_flops
    cache_read = batch * context * sizes.kv_bytes_per_token / device.bandwidth
    attention = rows * context * sizes.attention_flops_per_key * sizes.layers / device.attention_flops
    return max(weights, gemm) + max(cache_read, attention) + device.verify_overhead


def draft_step_seconds(sizes: ModelSizes, device: DeviceModel, batch: int, width: int, context: int) -> float:
    weights = sizes.draft_params * sizes.param_bytes / device.bandwidth
    gemm = 2 * sizes.draft_params * batch * width / device.gemm_flops
    cache_read = batch * context * sizes.last_layer_kv_bytes_per_token / device.bandwidth
    attention = batch * width * context * sizes.attention_flops_per_key / device.attention_flops
    return max(weights, gemm) + max(cache_read, attention) + device.draft_overhead


def round_seconds(sizes: ModelSizes, device: DeviceModel, shape: tuple[int, ...], batch: int, context: int) -> float:
    """A round: the draft's root step over the pending tokens, one draft step per level but the last, and the
    verification of every node."""
    draft = draft_step_seconds(sizes, device, batch, len(shape) + 1, context)
    draft += sum(draft_step_seconds(sizes, device, batch, width, context) for width in shape[:-1])
    return draft + verify_seconds(sizes, device, batch, 1 + sum(shape), context)


def candidate_shapes(table: RateTable, max_children: int) -> list[tuple[int, ...]]:
    """Chains of 1 to MAX_DEPTH tokens and, for every node budget and depth, the model's best tree."""
    shapes = {(1,) * n for n in range(1, MAX_DEPTH + 1)}
    for nodes in NODE_BUDGETS:
        for depth in range(1, min(nodes - 1, MAX_DEPTH) + 1):
            shapes.add(best_shape(table, nodes, depth, max_children))
    return sorted(shapes, key=lambda s: (sum(s), len(s), s))


def sampling_kind(draft_sampling):
    """``generate``'s ``draft_sampling`` normalised: ``None`` (choose), ``False`` (beams) or a sampled-tree kind
    (``True``: without replacement); anything else is a ``ValueError``."""
    if draft_sampling is None or draft_sampling is False:
        return draft_sampling
    if draft_sampling is True:
        return SAMPLED
    if isinstance(draft_sampling, str) and draft_sampling in SAMPLING_KINDS:
        return draft_sampling
    raise ValueError(f"draft_sampling must be None, True, False or one of {', '.join(SAMPLING_KINDS)}; got "
                     f"{draft_sampling!r}")


def _kind_for(sampling, draft_sampling) -> str | None:
    """The tree kind: the given one, else sampled at T > 0 and beams when greedy."""
    draft_sampling = sampling_kind(draft_sampling)
    if draft_sampling is None:
        return None if sampling.greedy else SAMPLED
    return draft_sampling or None


def choose(config: TargetConfig, profile: SpeculationProfile | None, sampling, batch: int, context: int,
           tree_shape=None, draft_sampling=None, device: DeviceModel | None = None,
           param_bytes: int = 2, draft_vocab_size: int | None = None) -> Speculation:
    """The speculation of a call: what it fixed (``tree_shape``; ``draft_sampling``: ``False`` beams, ``True`` or
    a kind sampled trees, ``None`` for the choice), the rest chosen to maximise the predicted tokens per second
    against plain decoding at ``batch`` sequences of ``context`` tokens, for a draft proposing from
    ``draft_vocab_size`` tokens (default: the target's vocabulary)."""
    profile = DEFAULT_PROFILE if profile is None else profile
    device = device_model() if device is None else device
    kind = _kind_for(sampling, draft_sampling)
    table = profile.table(kind or "beams", sampling.temperature)
    max_children = min(MAX_CHILDREN, draft_vocab_size or config.vocab_size)
    sizes = ModelSizes.of(config, param_bytes, draft_vocab_size)
    plain = plain_step_seconds(sizes, device, batch, context)

    def predicted(shape):
        branching = allocate_branching(shape, table, max_children)
        tokens = expected_tokens(branching, table)
        return tokens, tokens * plain / round_seconds(sizes, device, shape, batch, context), branching

    source = f"{device.name} cost model, {profile.source}"
    if tree_shape is not None:
        tokens, speedup, branching = predicted(tuple(tree_shape))
        return Speculation(tuple(tree_shape), kind, f"tree_shape given; {source}",
                           branching if kind else None, tokens, speedup)
    scored = [(predicted(s), s) for s in candidate_shapes(table, max_children)]
    best = max(p[1] for p, _ in scored)
    (tokens, speedup, branching), shape = min(((p, s) for p, s in scored if p[1] >= best * (1 - FLAT)),
                                              key=lambda x: (sum(x[1]), len(x[1]), -x[0][1]))
    where = f"T={sampling.temperature:g}, batch {batch}, context {context}"
    if speedup < MIN_SPEEDUP and draft_sampling is None:
        return Speculation(None, None, f"auto: no tree predicted {MIN_SPEEDUP}x plain at {where}; {source}",
                           expected_tokens=1.0, predicted_speedup=1.0)
    return Speculation(shape, kind, f"auto: {where}; {source}", branching if kind else None, tokens, speedup)
