"""Test-only PyTorch LongSpec draft layer, written from the PyTorch LongSpec code (not from the JAX code).

One decoder layer: windowed causal self-attention (q/k/v with bias, o without), cross-attention into given
target last-layer K/V (the query at position t sees target positions <= t - gap), SwiGLU MLP, three HF-style
RMSNorms, no final norm; logits through a given LM-head weight. RoPE is the target's own (transformers'
rotary embedding for the target config, so rope_theta and linear / llama3 scaling apply), rotate_half layout.

Module names are those of the released state dict (20 keys), so ``load_state_dict(..., strict=True)`` and
``from_pretrained(dir)`` work as they do for ``LlamaGlideDecoderLayer`` / ``Qwen2GlideDecoderLayer``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, LlamaConfig, PreTrainedModel, Qwen2Config


class RMSNorm(nn.Module):
    """HF Llama/Qwen2 RMSNorm: normalise in float32, cast back, then multiply by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x_BxHxTxD, cos_BxTxD, sin_BxTxD):
    return x_BxHxTxD * cos_BxTxD[:, None] + rotate_half(x_BxHxTxD) * sin_BxTxD[:, None]


def masked_attention(q_BxHxTxD, k_BxKxSxD, v_BxKxSxD, mask_TxS):
    """Softmax attention with scale 1/sqrt(D); query head h reads kv head h // (H // K); rows that see no key
    give 0 (as flash-attn does for the first ``s`` positions of noisy training)."""
    H, K = q_BxHxTxD.shape[1], k_BxKxSxD.shape[1]
    k = k_BxKxSxD.repeat_interleave(H // K, dim=1)
    v = v_BxKxSxD.repeat_interleave(H // K, dim=1)
    scores = q_BxHxTxD @ k.transpose(-1, -2) / math.sqrt(q_BxHxTxD.shape[-1])
    scores = scores.masked_fill(~mask_TxS, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q_BxHxTxD.dtype)
    return probs @ v


class GlideAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads  # always hidden // heads for the draft
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def heads(self, x_BxTxF, n):
        B, T, _ = x_BxTxF.shape
        return x_BxTxF.view(B, T, n, self.head_dim).transpose(1, 2)

    def out(self, o_BxHxTxD):
        B, H, T, D = o_BxHxTxD.shape
        return self.o_proj(o_BxHxTxD.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TorchDraftLayer(PreTrainedModel):
    """The draft layer, built from the target's HF config like ``LlamaGlideDecoderLayer``."""

    config_class = LlamaConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        d, H = config.hidden_size, config.num_attention_heads
        K = getattr(config, "num_key_value_heads", None) or H
        eps = config.rms_norm_eps
        mlp_bias = bool(getattr(config, "mlp_bias", False)) and config.model_type == "llama"
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = GlideAttention(d, H, K)
        self.post_self_attention_layernorm = RMSNorm(d, eps)
        self.cross_attn = GlideAttention(d, H, K)
        self.post_cross_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(d, config.intermediate_size, mlp_bias)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, x_BxTxd, cos_BxTxD, sin_BxTxD, positions_T, target_k_BxSxKxD, target_v_BxSxKxD,
                window: int = 512, cross_gap: int = 1):
        """Layer output ``[B, T, d]`` for embeddings at ``positions_T`` (consecutive tokens of one sequence).

        Self-attention: query at t sees keys at positions [t - window, t]. Cross-attention: query at t sees the
        target keys at positions 0 .. t - cross_gap (target K/V slot j holds position j)."""
        pos = positions_T.long()
        S = target_k_BxSxKxD.shape[1]
        sa = self.self_attn
        h = self.input_layernorm(x_BxTxd)
        q = apply_rope(sa.heads(sa.q_proj(h), sa.num_heads), cos_BxTxD, sin_BxTxD)
        k = apply_rope(sa.heads(sa.k_proj(h), sa.num_kv_heads), cos_BxTxD, sin_BxTxD)
        v = sa.heads(sa.v_proj(h), sa.num_kv_heads)
        self_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
        x = x_BxTxd + sa.out(masked_attention(q, k, v, self_mask))

        ca = self.cross_attn
        h = self.post_self_attention_layernorm(x)
        q = apply_rope(ca.heads(ca.q_proj(h), ca.num_heads), cos_BxTxD, sin_BxTxD)
        cross_mask = torch.arange(S)[None, :] <= (pos[:, None] - cross_gap)
        o = masked_attention(q, target_k_BxSxKxD.transpose(1, 2), target_v_BxSxKxD.transpose(1, 2), cross_mask)
        x = x + ca.out(o)  # cross_attn.k_proj / v_proj are never used (nor in the PyTorch LongSpec code)

        return x + self.mlp(self.post_cross_attention_layernorm(x))


class TorchQwen2DraftLayer(TorchDraftLayer):
    config_class = Qwen2Config


def hf_config_object(hf_config: dict):
    """A transformers config object from a config.json dict."""
    cfg = dict(hf_config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def draft_class(hf_config: dict):
    return {"llama": TorchDraftLayer, "qwen2": TorchQwen2DraftLayer}[hf_config["model_type"]]


def rope_cos_sin(hf_config: dict, positions_T, batch: int = 1):
    """The target's RoPE tables (transformers' rotary embedding for this config) ``[B, T, Dh]``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = hf_config_object(hf_config)
    config.head_dim = config.hidden_size // config.num_attention_heads
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    position_ids = torch.as_tensor(positions_T).long()[None].expand(batch, -1)
    return rotary(x, position_ids)


def _tensor(array, dtype=np.float32):
    return torch.from_numpy(np.array(array, dtype))  # a writable copy


def draft_logits(model: TorchDraftLayer, hf_config: dict, tokens_BxT, embed_VxD, lm_head_VxD, target_k, target_v,
                 window: int = 512, cross_gap: int = 1, rope_positions_T=None):
    """Float32 logits ``[B, T, V]`` of whole sequences (positions 0..T-1; no final norm before the LM head).
    ``target_k / target_v [B, S, Hkv, Dh]``: the target's last-layer cache, slot j = position j.
    ``rope_positions_T`` (anchor-offset training): RoPE at these positions instead, while the attention masks
    stay by token index, as flash attention's are in the reference's training code."""
    tokens = _tensor(tokens_BxT, np.int64)
    B, T = tokens.shape
    positions = torch.arange(T)
    rope_positions = positions if rope_positions_T is None else torch.as_tensor(np.asarray(rope_positions_T))
    cos, sin = rope_cos_sin(hf_config, rope_positions, B)
    x = _tensor(embed_VxD)[tokens]
    with torch.no_grad():
        y = model(x, cos, sin, positions, _tensor(target_k), _tensor(target_v), window, cross_gap)
        return (y @ _tensor(lm_head_VxD).T).float()
