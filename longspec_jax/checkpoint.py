"""Loading targets from HF checkpoint directories."""

from __future__ import annotations

import os

import jax.numpy as jnp

from longspec_jax.config import TargetConfig, read_json_object
from longspec_jax.errors import ConfigError, WeightsError
from longspec_jax.safetensors_io import SafetensorsDir
from longspec_jax.target import Target
from longspec_jax.weights import fuse_target_params, read_tensors, target_tensor_specs

# Tensors some HF checkpoints carry that the model does not use.
_IGNORED_TARGET_TENSORS = ("rotary_emb.inv_freq",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_target(path: str | os.PathLike, dtype=jnp.bfloat16, *, load_tokenizer: bool = True) -> Target:
    """Loads a Llama or Qwen2 HF directory (``config.json`` + ``*.safetensors``) as a :class:`Target`."""
    path = os.fspath(path)
    config = TargetConfig.from_dir(path)
    source = SafetensorsDir(path)
    _check_layer_count(source, config, os.path.join(path, "config.json"))
    ignore = _IGNORED_TARGET_TENSORS + (("lm_head.weight",) if config.tie_word_embeddings else ())
    unfused = read_tensors(source, target_tensor_specs(config), dtype, where=path, ignore=ignore,
                           expected_from=" from config.json")
    tokenizer = _load_tokenizer(path) if load_tokenizer else None
    hf_config = read_json_object(os.path.join(path, "config.json"))
    return Target(config=config, params=fuse_target_params(unfused, config), tokenizer=tokenizer,
                  hf_config=hf_config)


def _check_layer_count(source: SafetensorsDir, config: TargetConfig, where: str) -> None:
    """num_hidden_layers against the layers the weights hold, before one tensor spec per layer is built (a
    config claiming a billion layers fails here, not after building a billion specs)."""
    layers = {name.split(".")[2] for name in source.keys() if name.startswith("model.layers.")}
    if config.num_layers != len(layers):
        raise WeightsError(f"{where}: num_hidden_layers is {config.num_layers}, but the weights hold "
                           f"{len(layers)} layers")


def _load_tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types; report them as one clear error
        raise ConfigError(f"cannot load the tokenizer in {path}: {e}") from None
