"""Loading targets from HF checkpoint directories."""

from __future__ import annotations

import os

import jax.numpy as jnp
from jax.sharding import Mesh

from longspec_jax.config import TargetConfig, read_json_object
from longspec_jax.errors import ConfigError, WeightsError
from longspec_jax.safetensors_io import SafetensorsDir
from longspec_jax.sharded_io import load_sharded_params
from longspec_jax.target import Target
from longspec_jax.tensor_parallel import check_mesh
from longspec_jax.weights import fuse_target_params, read_tensors, target_tensor_specs

# Tensors some HF checkpoints carry that the model does not use.
_IGNORED_TARGET_TENSORS = ("rotary_emb.inv_freq",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_target(path: str | os.PathLike, dtype=jnp.bfloat16, *, load_tokenizer: bool = True,
                mesh: Mesh | None = None) -> Target:
    """Loads a Llama or Qwen2 HF directory (``config.json`` + ``*.safetensors``) as a :class:`Target`.

    ``mesh``: a ``("data", "model")`` device mesh (:func:`longspec_jax.mesh.make_mesh`) to shard the parameters
    over (tensor parallel, :mod:`longspec_jax.tensor_parallel`); each device's blocks are read straight from the
    files. ``generate`` then runs sharded over it.
    """
    path = os.fspath(path)
    config = TargetConfig.from_dir(path)
    if mesh is not None:
        check_mesh(config, mesh)
    source = SafetensorsDir(path)
    _check_layer_count(source, config, os.path.join(path, "config.json"))
    ignore = _IGNORED_TARGET_TENSORS + (("lm_head.weight",) if config.tie_word_embeddings else ())
    if mesh is None:
        unfused = read_tensors(source, target_tensor_specs(config), dtype, where=path, ignore=ignore,
                               expected_from=" from config.json")
        params = fuse_target_params(unfused, config)
    else:
        params = load_sharded_params(source, config, dtype, mesh, where=path, ignore=ignore,
                                     expected_from=" from config.json")
    tokenizer = _load_tokenizer(path) if load_tokenizer else None
    hf_config = read_json_object(os.path.join(path, "config.json"))
    return Target(config=config, params=params, tokenizer=tokenizer, hf_config=hf_config, mesh=mesh)


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
