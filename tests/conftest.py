"""Shared test helpers: tiny seeded Hugging Face models saved as safetensors, tiny random targets, prompts.

Everything here runs on the CPU. Tiny models use a large ``initializer_range`` and perturbed norms and biases,
so that logits are well separated and greedy argmax is never decided by float32 noise.
"""

from __future__ import annotations

import os
from pathlib import Path

# Tests run on the CPU (CI has no accelerator); keep float32 matmuls exact there.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

REPO_ROOT = Path(__file__).resolve().parents[1]

# Small HF configs: vocab 256, hidden 64, 2 layers. Keys are test ids.
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512)
HF_CONFIGS = {
    # GQA, untied, llama3 scaling: with original_max_position_embeddings=64, every pair with a wavelength above
    # 16 tokens is scaled, which changes the rotation angles at positions 0..63.
    "llama-gqa-llama3": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=64)),
    "llama-mha-tied-linear": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True,
                                  rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    "llama-gqa-bias-hd32": dict(model_type="llama", num_key_value_heads=1, head_dim=32, attention_bias=True,
                                mlp_bias=True, tie_word_embeddings=False,
                                rope_parameters=dict(rope_type="default", rope_theta=2000.0)),
    "qwen2-gqa-tied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True,
                           rope_parameters=dict(rope_type="default", rope_theta=1234.5)),
    "qwen2-mha-untied": dict(model_type="qwen2", num_key_value_heads=4, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="default", rope_theta=30000.0)),
}


def build_hf_model(name: str, seed: int = 0, initializer_range: float = 0.15, **overrides):
    """A float32 eval-mode ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` from ``HF_CONFIGS[name]``, seeded.

    Norm weights become ``1 + 0.1 * noise`` and biases ``0.1 * noise`` so that neither is a no-op in the parity
    tests. EOS is disabled in its generation config (tests compare fixed-length greedy outputs).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = {**BASE, **HF_CONFIGS[name], **overrides}
    model_type = spec.pop("model_type")
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[model_type]
    config = config_cls(initializer_range=initializer_range, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None, **spec)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif pname.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model, path, **kwargs) -> Path:
    path = Path(path)
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """``hf_model_dir(name) -> (torch model, saved dir)``, built once per test run."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(name)
            cache[name] = (model, save_hf_model(model, tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def hf_logits(model, tokens) -> np.ndarray:
    """Float32 logits ``[T, V]`` of one unpadded prompt."""
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].float().numpy()


def hf_greedy(model, prompt, max_new_tokens: int) -> np.ndarray:
    """HF greedy continuation (no EOS stopping), ``[max_new_tokens]``."""
    import torch
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, ids.shape[1]:].numpy()


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def tiny_target(vocab_size: int = 512, seed: int = 0, std: float = 0.2, **overrides):
    """A float32 :class:`longspec_jax.Target` with random weights built in JAX (no torch, no files)."""
    import jax.numpy as jnp

    from longspec_jax.config import TargetConfig
    from longspec_jax.target import Target, init_target_params

    fields = dict(model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
    config = TargetConfig(**{**fields, **overrides})
    params = init_target_params(config, jax.random.PRNGKey(seed), dtype=jnp.float32, std=std)
    return Target(config=config, params=params)
