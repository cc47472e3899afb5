"""Target model configuration, read from a Hugging Face ``config.json`` (Llama and Qwen2)."""

from __future__ import annotations

import dataclasses
import json
import os
import reprlib
import sys
from typing import Any

from longspec_jax.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_scaling`` / ``rope_parameters``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Architecture of a Llama or Qwen2 causal LM. Hashable, so it can be a static jit argument."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "TargetConfig":
        """Builds a config from the dict of an HF ``config.json`` (transformers 4.x or 5.x layout)."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config is a JSON {type(cfg).__name__}, not an object")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {reprlib.repr(model_type)}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if cfg.get(k) is None]
        if missing:
            raise ConfigError(f"missing required field(s): {', '.join(missing)}")
        if model_type == "qwen2" and _bool_field(cfg, "use_sliding_window", False):
            raise ConfigError("Qwen2 with use_sliding_window=true is not supported")
        num_heads = _int_field(cfg, "num_attention_heads")
        hidden = _int_field(cfg, "hidden_size")
        head_dim = _int_field(cfg, "head_dim", default=None)
        if head_dim is None:
            if hidden % num_heads:
                raise ConfigError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({num_heads}) "
                                  f"when head_dim is not given")
            head_dim = hidden // num_heads
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = _bool_field(cfg, "attention_bias", False)
            mlp_bias = _bool_field(cfg, "mlp_bias", False)
        pad = cfg.get("pad_token_id")
        return cls(
            model_type=model_type,
            vocab_size=_int_field(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int_field(cfg, "intermediate_size"),
            num_layers=_int_field(cfg, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_int_field(cfg, "num_key_value_heads", default=num_heads),
            head_dim=head_dim,
            rms_norm_eps=_float_field(cfg, "rms_norm_eps", 1e-6),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=_int_field(cfg, "max_position_embeddings", default=4096),
            tie_word_embeddings=_bool_field(cfg, "tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            pad_token_id=pad if is_int(pad) else None,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "TargetConfig":
        """Reads ``config.json`` (and ``generation_config.json`` for EOS ids when present) from an HF dir."""
        path = os.fspath(path)
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConfigError(f"model directory not found: {path}")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"missing config.json in {path}")
        cfg = read_json_object(cfg_path)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            gen = read_json_object(gen_path)
            if gen.get("eos_token_id") is not None:
                try:
                    _as_id_tuple(gen["eos_token_id"])
                except ConfigError as e:
                    raise ConfigError(f"{gen_path}: {e}") from None
                cfg = {**cfg, "eos_token_id": gen["eos_token_id"]}
        try:
            return cls.from_hf_dict(cfg)
        except ConfigError as e:
            raise ConfigError(f"{cfg_path}: {e}") from None


def read_json_object(path: str, error: type[ValueError] = ConfigError) -> dict:
    """The JSON object in the file ``path``; anything else (unreadable, not JSON, not an object) raises
    ``error`` naming the file."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except OSError as e:
        raise error(f"cannot read {path}: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, found a {type(value).__name__}")
    return value


def is_int(value) -> bool:
    """A JSON integer: an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(cfg: dict, key: str, default: Any = _REQUIRED, *, section: str = "") -> Any:
    """``cfg[key]`` as a positive int (``default`` when absent or null); names the field when it is not one."""
    value = cfg.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if not is_int(value) or value <= 0:
        raise ConfigError(f"config field {section}{key} must be a positive integer, got {reprlib.repr(value)}")
    return value


def _float_field(cfg: dict, key: str, default: float, *, section: str = "") -> float:
    """``cfg[key]`` as a positive finite float (``default`` when absent or null)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= sys.float_info.max:
        raise ConfigError(f"config field {section}{key} must be a positive number, got {reprlib.repr(value)}")
    return float(value)


def _bool_field(cfg: dict, key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config field {key} must be true or false, got {reprlib.repr(value)}")
    return value


def _as_id_tuple(value) -> tuple[int, ...]:
    ids = () if value is None else (value,) if is_int(value) else value
    if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
        raise ConfigError(f"config field eos_token_id must be a token id or a list of them, got "
                          f"{reprlib.repr(value)}")
    return tuple(ids)


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Reads rotary parameters from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x)."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(f"config field {key} must be an object, got {reprlib.repr(cfg[key])}")
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    section = "rope_parameters." if cfg.get("rope_parameters") else "rope_scaling."
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {reprlib.repr(rope_type)}; supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    defaults = RopeConfig()
    rope = RopeConfig(
        theta=(_float_field(params, "rope_theta", defaults.theta, section=section) if "rope_theta" in params
               else _float_field(cfg, "rope_theta", defaults.theta)),
        rope_type=rope_type,
        factor=_float_field(params, "factor", defaults.factor, section=section),
        low_freq_factor=_float_field(params, "low_freq_factor", defaults.low_freq_factor, section=section),
        high_freq_factor=_float_field(params, "high_freq_factor", defaults.high_freq_factor, section=section),
        original_max_position_embeddings=_int_field(params, "original_max_position_embeddings",
                                                    defaults.original_max_position_embeddings, section=section),
    )
    if rope.rope_type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ConfigError(f"llama3 rope scaling needs {section}high_freq_factor ({rope.high_freq_factor}) > "
                          f"low_freq_factor ({rope.low_freq_factor})")
    return rope
