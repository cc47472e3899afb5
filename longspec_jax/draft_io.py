"""Draft checkpoints in the two PyTorch LongSpec formats (the released HF format and the training ``.pth``).

* HF release format (``sail/longspec-*``): a directory with ``config.json`` (the *target's* HF config; the draft
  layer is built from it) and ``model.safetensors`` holding exactly the 20 unprefixed keys of the draft layer in
  PyTorch ``[out, in]`` layout, fp32 in the releases. PyTorch loads it with
  ``LlamaGlideDecoderLayer.from_pretrained(dir)`` (``Qwen2GlideDecoderLayer`` for Qwen2 targets).
* Training format: ``torch.save`` of an ``OrderedDict`` with the same 20 keys (16-bit in the training code),
  in a file named ``draft_model_weights.pth``; loaded with ``draft.load_state_dict(torch.load(path))``.

The key/shape mapping is :func:`longspec_jax.weights.draft_tensor_specs`, shared with the target loader's
machinery (``read_tensors`` / ``write_tensors`` / ``check_keys``). torch is imported only for ``.pth`` files.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import reprlib
from collections import OrderedDict
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from longspec_jax.config import RopeConfig, TargetConfig, read_json_object
from longspec_jax.draft import DEFAULT_WINDOW, Draft, DraftConfig
from longspec_jax.draft_vocab import load_draft_vocab, save_draft_vocab
from longspec_jax.errors import ConfigError, WeightsError
from longspec_jax.safetensors_io import INDEX_NAME, SafetensorsDir, SafetensorsFile, save_file
from longspec_jax.speculation_profile import load_profile, save_profile
from longspec_jax.weights import DictSource, draft_tensor_specs, read_tensors, write_tensors

SAFETENSORS_NAME = "model.safetensors"
PTH_NAME = "draft_model_weights.pth"
CONFIG_NAME = "config.json"
FORMATS = ("hf", "pth")
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}

# config.json fields that must equal the target's: (HF name, TargetConfig attribute). The widths fix the draft's
# parameter shapes; the vocabulary is the target's LM head the draft was trained through.
_TARGET_FIELDS = (("hidden_size", "hidden_size"), ("num_attention_heads", "num_heads"),
                  ("num_key_value_heads", "num_kv_heads"), ("head_dim", "head_dim"),
                  ("intermediate_size", "intermediate_size"), ("vocab_size", "vocab_size"))


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_draft(path: str | os.PathLike, target, dtype=None, *, window: int = DEFAULT_WINDOW,
               draft_vocab=None) -> Draft:
    """Loads a LongSpec draft for ``target`` (a :class:`longspec_jax.Target`).

    ``path`` is an HF release directory (``config.json`` + ``model.safetensors``), a directory holding
    ``draft_model_weights.pth``, or a ``.pth`` / ``.safetensors`` file. The draft's architecture comes from the
    target's config (``DraftConfig.from_target``); a ``config.json`` beside the weights must agree with the
    target on every width. ``dtype=None`` uses the target's parameter dtype (the reference runs the draft in
    the target's dtype); pass ``jnp.float32`` to keep released fp32 weights exactly. A directory's
    ``speculation_profile.json`` (``python -m infer.calibrate``) becomes the draft's ``profile``, and its
    ``draft_vocab.npy`` the draft vocabulary it proposes from (:mod:`longspec_jax.draft_vocab`), unless
    ``draft_vocab`` (sorted target token ids) is given instead; ``.with_vocab(target, None)`` drops it.
    """
    path = os.fspath(path)
    target_config = getattr(target, "config", None)
    if not isinstance(target_config, TargetConfig):
        raise TypeError(f"load_draft needs the target model (see load_target), got {type(target).__name__}")
    config = DraftConfig.from_target(target_config, window)
    dtype = target.dtype if dtype is None else dtype
    source = _open_weights(path, target_config)
    variables = read_tensors(source, draft_tensor_specs(config), dtype, where=f"draft {path}",
                             expected_from=expected_from_target(config))
    profile = load_profile(path) if os.path.isdir(path) else None
    if draft_vocab is None and os.path.isdir(path):
        draft_vocab = load_draft_vocab(path, target_config.vocab_size)
    draft = Draft(config=config, variables=variables, target_hf_config=target_hf_config(target), profile=profile)
    return draft if draft_vocab is None else draft.with_vocab(target, draft_vocab)


def expected_from_target(config: DraftConfig) -> str:
    return (f" from the target config (hidden_size={config.hidden_size}, heads={config.num_heads}, "
            f"kv_heads={config.num_kv_heads}, head_dim={config.head_dim}, "
            f"intermediate_size={config.intermediate_size})")


def _open_weights(path: str, target_config: TargetConfig):
    if os.path.isdir(path):
        cfg_path = os.path.join(path, CONFIG_NAME)
        if os.path.isfile(cfg_path):
            check_draft_config(read_json_object(cfg_path), target_config, where=cfg_path)
        names = os.listdir(path)
        if INDEX_NAME in names or any(n.endswith(".safetensors") for n in names):
            return SafetensorsDir(path)
        if PTH_NAME in names:
            return read_pth(os.path.join(path, PTH_NAME))
        raise WeightsError(f"no draft weights in {path}: expected {SAFETENSORS_NAME} (HF release format) or "
                           f"{PTH_NAME} (training format)")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return SafetensorsFile(path)
        return read_pth(path)
    raise WeightsError(f"draft checkpoint not found: {path}")


def check_draft_config(cfg: Mapping[str, Any], target_config: TargetConfig, where: str) -> None:
    """Raises a :class:`WeightsError` naming each width (or the vocabulary size) in which a draft's
    ``config.json`` differs from the target (a draft trained for another target)."""
    problems = []
    for hf_name, attr in _TARGET_FIELDS:
        have = cfg.get(hf_name)
        if hf_name == "num_key_value_heads" and have is None:
            have = cfg.get("num_attention_heads")
        want = getattr(target_config, attr)
        if have is not None and have != want:
            problems.append(f"{hf_name}={reprlib.repr(have)} (target: {want})")
    if problems:
        raise WeightsError(f"{where}: the draft was built for another target: " + ", ".join(problems))


def _import_torch(why: str):
    try:
        import torch
    except ImportError:
        raise WeightsError(f"{why} needs PyTorch, which is not installed (pip install torch)") from None
    return torch


def read_pth(path: str) -> DictSource:
    """A ``.pth`` state dict (``torch.save`` of ``{name: tensor}``) as numpy arrays, bf16 bit-exact."""
    torch = _import_torch(f"reading the PyTorch state dict {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for bad files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise WeightsError(f"{path}: cannot read the .pth state dict ({type(e).__name__}: {first_line})") from None
    if not isinstance(state, Mapping):
        raise WeightsError(f"{path}: expected a state dict ({{name: tensor}}), found a {type(state).__name__}")
    tensors = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise WeightsError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor")
        tensors[str(name)] = _torch_to_numpy(torch, value)
    return DictSource(tensors)


def _torch_to_numpy(torch, tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _numpy_to_torch(torch, array: np.ndarray):
    array = np.ascontiguousarray(array)
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


# ----------------------------------------------------------------------------------------------------------------
# Saving


def export_dtype(dtype) -> np.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or the matching numpy / jax dtype) as a numpy dtype."""
    if isinstance(dtype, str):
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"unsupported export dtype {dtype!r}; choose one of {', '.join(EXPORT_DTYPES)}")
        return EXPORT_DTYPES[dtype]
    np_dtype = np.dtype(dtype)
    if np_dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"unsupported export dtype {np_dtype}; choose one of {', '.join(EXPORT_DTYPES)}")
    return np_dtype


def draft_state_dict(draft: Draft, dtype=np.float32) -> dict[str, np.ndarray]:
    """The draft's 20 tensors ``{name: numpy array}`` in PyTorch layout and reference key order."""
    return write_tensors(draft.variables, draft_tensor_specs(draft.config), export_dtype(dtype))


def save_draft(draft: Draft, path: str | os.PathLike, format: str = "hf", dtype=np.float32, *,
               target=None) -> str:
    """Exports ``draft`` so that PyTorch LongSpec loads it; returns the path of the weights file.

    ``format="hf"``: ``path/model.safetensors`` (20 keys) + ``path/config.json`` (the target's HF config, with
    ``rope_theta`` / ``rope_scaling`` as transformers 4.x reads them and ``torch_dtype`` set to ``dtype``).
    ``format="pth"``: ``path/draft_model_weights.pth`` (``torch.save`` of an OrderedDict), plus the same
    ``config.json`` when the target config is known; a ``path`` ending in ``.pth`` names the file itself.
    The target config comes from ``target`` (a Target, TargetConfig or HF config dict) or else from the draft
    (set by :func:`load_draft` and by training checkpoints). ``dtype`` defaults to float32, like the releases.
    The draft's speculation profile and draft vocabulary, where it has them, go beside the weights (PyTorch
    LongSpec ignores both).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown draft format {format!r}; choose one of {', '.join(FORMATS)}")
    path = os.fspath(path)
    np_dtype = export_dtype(dtype)
    hf_config = target_hf_config(target) if target is not None else draft.target_hf_config
    if hf_config is not None:
        config_json = pytorch_config_dict(hf_config, np_dtype)
        _check_draft_matches(draft.config, TargetConfig.from_hf_dict(config_json))
    elif format == "hf":
        raise ValueError("save_draft(format='hf') writes the target's config.json, but this draft carries no target "
                         "config: load it with load_draft(path, target), or pass target=...")
    tensors = draft_state_dict(draft, np_dtype)

    if format == "pth" and path.endswith(".pth"):
        directory, weights_path = os.path.dirname(path) or ".", path
    else:
        directory = path
        weights_path = os.path.join(path, SAFETENSORS_NAME if format == "hf" else PTH_NAME)
    os.makedirs(directory, exist_ok=True)
    if format == "hf":
        save_file(tensors, weights_path, metadata={"format": "pt"})
    else:
        torch = _import_torch("saving a .pth draft")
        torch.save(OrderedDict((name, _numpy_to_torch(torch, a)) for name, a in tensors.items()), weights_path)
    if hf_config is not None and not (format == "pth" and path.endswith(".pth")):
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config_json, f, indent=2, sort_keys=True)
            f.write("\n")
    if draft.profile is not None:
        save_profile(draft.profile, directory)
    if draft.vocab is not None:
        save_draft_vocab(np.asarray(draft.vocab.ids), directory)
    return weights_path


def _check_draft_matches(config: DraftConfig, target_config: TargetConfig) -> None:
    expected = DraftConfig.from_target(target_config, config.window)
    fields = ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "mlp_bias")
    bad = [f"{f}: draft {getattr(config, f)}, target {getattr(expected, f)}" for f in fields
           if getattr(config, f) != getattr(expected, f)]
    if bad:
        raise WeightsError("the draft does not fit the target config it would be exported with: " + "; ".join(bad))


# ----------------------------------------------------------------------------------------------------------------
# Configs


def target_hf_config(target) -> dict:
    """The target's HF ``config.json`` dict: the file it was loaded from when known, else rebuilt from its
    :class:`TargetConfig`. Accepts a Target, a TargetConfig or an HF config dict."""
    if isinstance(target, Mapping):
        return copy.deepcopy(dict(target))
    if isinstance(target, TargetConfig):
        return hf_config_from_target_config(target)
    raw = getattr(target, "hf_config", None)
    if raw is not None:
        return copy.deepcopy(raw)
    config = getattr(target, "config", None)
    if not isinstance(config, TargetConfig):
        raise TypeError(f"expected a Target, TargetConfig or HF config dict, got {type(target).__name__}")
    return hf_config_from_target_config(config)


def _rope_scaling(rope: RopeConfig) -> dict | None:
    if rope.rope_type == "default":
        return None
    if rope.rope_type == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings}


def hf_config_from_target_config(config: TargetConfig) -> dict:
    """A Llama / Qwen2 ``config.json`` dict describing ``config`` (transformers 4.x layout, which 5.x reads too)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[config.model_type]
    eos = list(config.eos_token_ids)
    cfg = {
        "architectures": [arch],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope.theta,
        "rope_scaling": _rope_scaling(config.rope),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "pad_token_id": config.pad_token_id,
    }
    if config.model_type == "llama":
        cfg.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    else:
        cfg.update(use_sliding_window=False)
    return cfg


def pytorch_config_dict(hf_config: Mapping[str, Any], dtype=np.float32) -> dict:
    """The ``config.json`` written beside exported draft weights: the target's HF config, plus ``rope_theta``
    and ``rope_scaling`` where only the transformers-5 ``rope_parameters`` describe RoPE (the PyTorch LongSpec
    code pins transformers 4.46 and reads ``config.rope_theta``), and ``torch_dtype`` = the weights' dtype."""
    cfg = copy.deepcopy(dict(hf_config))
    target_config = TargetConfig.from_hf_dict(cfg)  # validates model_type and the required fields
    cfg.setdefault("rope_theta", target_config.rope.theta)
    if cfg.get("rope_scaling") is None:
        cfg["rope_scaling"] = _rope_scaling(target_config.rope)
    dtype_name = {v: k for k, v in EXPORT_DTYPES.items()}[export_dtype(dtype)]
    cfg["torch_dtype"] = dtype_name
    if "dtype" in cfg:
        cfg["dtype"] = dtype_name
    if not cfg.get("architectures"):
        cfg["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg["model_type"]]]
    return cfg


def draft_config_to_dict(config: DraftConfig) -> dict:
    return dataclasses.asdict(config)


def draft_config_from_dict(data: Mapping[str, Any]) -> DraftConfig:
    data = dict(data)
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown DraftConfig field(s): {', '.join(unknown)}")
    if isinstance(data.get("rope"), Mapping):
        data["rope"] = RopeConfig(**data["rope"])
    try:
        return DraftConfig(**data)
    except TypeError as e:
        raise ConfigError(f"malformed DraftConfig: {e}") from None
