"""Model FLOPs of one training token, for model-FLOPs utilisation (MFU): what the step must compute, counted
from the shapes (a multiply-add is 2 FLOPs), not what the hardware happens to execute."""

from __future__ import annotations

from longspec_jax.config import TargetConfig
from longspec_jax.draft import DraftConfig

# Dense bf16 peak per device (datasheet), by substrings of jax's device_kind.
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def device_peak_flops(device_kind: str) -> float | None:
    for name, peak in PEAK_BF16_FLOPS.items():
        if name in device_kind:
            return peak
    return None


def mean_keys(seq_len: int, window: int | None = None) -> float:
    """Mean number of keys a causal query sees over a sequence (``t + 1``, capped at ``window + 1``)."""
    cap = seq_len if window is None else window + 1
    return sum(min(t + 1, cap) for t in range(seq_len)) / seq_len


def train_flops_per_token(target: TargetConfig, draft: DraftConfig, seq_len: int, *, kl: bool = False,
                          head_columns: int | None = None) -> dict:
    """FLOPs per token of one training step, by part: the frozen target's forward (without the last layer's
    attention and MLP unless the KL term needs its output), the draft's forward and backward (3x its forward),
    and the LM head (forward, plus the backward into the draft's output; the head itself is frozen): the draft's
    ``head_columns`` of it (a loss over a draft vocabulary; ``None``: all), the target's every column."""
    d, I, V = target.hidden_size, target.intermediate_size, target.vocab_size
    H, K, hd = target.num_heads, target.num_kv_heads, target.head_dim
    qkv, o, mlp = 2 * d * (H + 2 * K) * hd, 2 * H * hd * d, 2 * 3 * d * I
    attn_per_key = 4 * H * hd  # q.k and p.v
    full_layers = target.num_layers if kl else target.num_layers - 1
    target_flops = (target.num_layers * qkv + full_layers * (o + mlp + attn_per_key * mean_keys(seq_len)))
    dd, dH, dK, dhd = draft.hidden_size, draft.num_heads, draft.num_kv_heads, draft.head_dim
    dI = draft.intermediate_size
    draft_linear = 2 * dd * (dH + 2 * dK) * dhd + 2 * dH * dhd * dd + 2 * 2 * dd * dH * dhd + 2 * 3 * dd * dI
    draft_attn = 4 * dH * dhd * (mean_keys(seq_len, draft.window) + mean_keys(seq_len))
    draft_flops = 3 * (draft_linear + draft_attn)
    head_flops = 4 * d * (head_columns or V) + (2 * d * V if kl else 0)
    return {"target": target_flops, "draft": draft_flops, "lm_head": head_flops,
            "total": target_flops + draft_flops + head_flops}
