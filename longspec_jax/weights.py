"""Name mapping between PyTorch state dicts (HF / LongSpec naming) and our parameter pytrees.

One declarative table per model (a list of :class:`TensorSpec`) drives both directions, with the same key and
shape checks for targets and drafts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Protocol

import jax.numpy as jnp
import numpy as np

from longspec_jax.config import TargetConfig
from longspec_jax.errors import WeightsError

if TYPE_CHECKING:
    from longspec_jax.draft import DraftConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor ``name`` of PyTorch ``shape``, stored at ``path`` in the pytree (transposed for
    ``nn.Linear`` weights, which PyTorch keeps as ``[out, in]`` and we keep as ``[in, out]``)."""

    name: str
    path: tuple
    shape: tuple[int, ...]
    transpose: bool = False


class TensorSource(Protocol):
    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray: ...


class DictSource:
    """A :class:`TensorSource` over an in-memory ``{name: array}`` dict (e.g. a loaded ``.pth`` state dict)."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self._tensors = tensors

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def get(self, name: str) -> np.ndarray:
        return self._tensors[name]


def _set_path(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def check_keys(source: TensorSource, specs: list[TensorSpec], where: str, ignore: Iterable[str] = (),
               expected_from: str = "") -> None:
    """Raises a :class:`WeightsError` naming every missing, unexpected or mis-shaped tensor."""
    have = set(source.keys())
    want = {s.name for s in specs}
    ignore = tuple(ignore)
    problems = []
    missing = sorted(want - have)
    if missing:
        problems.append("missing tensor(s): " + ", ".join(missing))
    extra = sorted(n for n in have - want if not any(pattern in n for pattern in ignore))
    if extra:
        problems.append("unexpected tensor(s): " + ", ".join(extra[:20]) + (" ..." if len(extra) > 20 else ""))
    for spec in specs:
        if spec.name in have and tuple(source.shape(spec.name)) != tuple(spec.shape):
            problems.append(f"tensor {spec.name} has shape {tuple(source.shape(spec.name))}, expected "
                            f"{tuple(spec.shape)}{expected_from}")
    if problems:
        raise WeightsError(f"{where}: " + "; ".join(problems))


def read_tensors(source: TensorSource, specs: list[TensorSpec], dtype, where: str,
                 ignore: Iterable[str] = (), expected_from: str = "") -> dict:
    """Checks the source against ``specs`` and builds the pytree (device arrays of ``dtype``)."""
    check_keys(source, specs, where, ignore, expected_from)
    tree: dict = {}
    for spec in specs:
        array = jnp.asarray(source.get(spec.name)).astype(dtype)
        _set_path(tree, spec.path, array.T if spec.transpose else array)
    return tree


def write_tensors(tree: dict, specs: list[TensorSpec], dtype) -> dict[str, np.ndarray]:
    """The inverse of :func:`read_tensors`: ``{name: numpy array of dtype}`` in PyTorch layout."""
    out = {}
    for spec in specs:
        array = np.asarray(_get_path(tree, spec.path)).astype(dtype)
        out[spec.name] = np.ascontiguousarray(array.T if spec.transpose else array)
        if out[spec.name].shape != tuple(spec.shape):
            raise WeightsError(f"parameter {'/'.join(map(str, spec.path))} has shape {out[spec.name].shape} "
                               f"in PyTorch layout, expected {tuple(spec.shape)}")
    return out


def linear_specs(prefix: str, path: tuple, in_features: int, out_features: int, bias: bool) -> list[TensorSpec]:
    """Specs of one ``nn.Linear``: ``{prefix}.weight`` (and ``.bias``) at ``path + ('kernel'|'bias',)``."""
    specs = [TensorSpec(f"{prefix}.weight", path + ("kernel",), (out_features, in_features), transpose=True)]
    if bias:
        specs.append(TensorSpec(f"{prefix}.bias", path + ("bias",), (out_features,)))
    return specs


def target_tensor_specs(config: TargetConfig) -> list[TensorSpec]:
    """HF Llama/Qwen2 checkpoint layout, mapped to an unfused pytree (see :func:`fuse_target_params`)."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    H, K = config.num_heads, config.num_kv_heads
    specs = [TensorSpec("model.embed_tokens.weight", ("embed",), (config.vocab_size, d)),
             TensorSpec("model.norm.weight", ("final_norm",), (d,))]
    if not config.tie_word_embeddings:
        specs += linear_specs("lm_head", ("lm_head",), d, config.vocab_size, False)
    for i in range(config.num_layers):
        p, path = f"model.layers.{i}", ("layers", i)
        specs += [TensorSpec(f"{p}.input_layernorm.weight", path + ("attn_norm",), (d,)),
                  TensorSpec(f"{p}.post_attention_layernorm.weight", path + ("mlp_norm",), (d,))]
        specs += linear_specs(f"{p}.self_attn.q_proj", path + ("q",), d, H * hd, config.qkv_bias)
        specs += linear_specs(f"{p}.self_attn.k_proj", path + ("k",), d, K * hd, config.qkv_bias)
        specs += linear_specs(f"{p}.self_attn.v_proj", path + ("v",), d, K * hd, config.qkv_bias)
        specs += linear_specs(f"{p}.self_attn.o_proj", path + ("o",), H * hd, d, config.o_bias)
        for proj, (fan_in, fan_out) in (("gate", (d, inter)), ("up", (d, inter)), ("down", (inter, d))):
            specs += linear_specs(f"{p}.mlp.{proj}_proj", path + (proj,), fan_in, fan_out, config.mlp_bias)
    return specs


def draft_tensor_specs(config: "DraftConfig") -> list[TensorSpec]:
    """LongSpec draft checkpoint layout (20 unprefixed keys), mapped to the Flax variables of
    :class:`longspec_jax.draft.DraftLayer` (``{"params": {"self_attn": {"q_proj": {"kernel", "bias"}}, ...}}``).

    q/k/v projections of both attention blocks carry biases, o_proj none; MLP biases only when
    ``config.mlp_bias`` (never for released drafts).
    """
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    H, K = config.num_heads, config.num_kv_heads
    root = ("params",)
    specs = []
    for norm, block in (("input_layernorm", "self_attn"), ("post_self_attention_layernorm", "cross_attn")):
        specs.append(TensorSpec(f"{norm}.weight", root + (norm, "weight"), (d,)))
        for proj, fan_out, bias in (("q_proj", H * hd, True), ("k_proj", K * hd, True), ("v_proj", K * hd, True),
                                    ("o_proj", d, False)):
            fan_in = H * hd if proj == "o_proj" else d
            specs += linear_specs(f"{block}.{proj}", root + (block, proj), fan_in, fan_out, bias)
    specs.append(TensorSpec("post_cross_attention_layernorm.weight",
                            root + ("post_cross_attention_layernorm", "weight"), (d,)))
    for proj, (fan_in, fan_out) in (("gate_proj", (d, inter)), ("up_proj", (d, inter)), ("down_proj", (inter, d))):
        specs += linear_specs(f"mlp.{proj}", root + ("mlp", proj), fan_in, fan_out, config.mlp_bias)
    return specs


# The leaves of a fused target pytree, each the concatenation (along output columns) of these unfused leaves.
TOP_LEAVES = {"embed": (("embed",),), "final_norm": (("final_norm",),), "lm_head": (("lm_head", "kernel"),)}
LAYER_LEAVES = {"attn_norm": (("attn_norm",),), "mlp_norm": (("mlp_norm",),),
                "wqkv": (("q", "kernel"), ("k", "kernel"), ("v", "kernel")),
                "bqkv": (("q", "bias"), ("k", "bias"), ("v", "bias")),
                "wo": (("o", "kernel"),), "bo": (("o", "bias"),),
                "w_gate_up": (("gate", "kernel"), ("up", "kernel")), "b_gate_up": (("gate", "bias"), ("up", "bias")),
                "w_down": (("down", "kernel"),), "b_down": (("down", "bias"),)}


def fused_leaves(config: TargetConfig) -> dict[tuple, tuple[TensorSpec, ...]]:
    """``{fused path: specs of its unfused parts, in column order}`` for every leaf of a fused target pytree
    (biases and the LM head where the config has them)."""
    by_path = {spec.path: spec for spec in target_tensor_specs(config)}
    out = {(name,): tuple(by_path[p] for p in parts) for name, parts in TOP_LEAVES.items()
           if all(p in by_path for p in parts)}
    for i in range(config.num_layers):
        for name, parts in LAYER_LEAVES.items():
            paths = tuple(("layers", i) + p for p in parts)
            if all(p in by_path for p in paths):
                out[("layers", i, name)] = tuple(by_path[p] for p in paths)
    return out


def set_fused(params: dict, path: tuple, value) -> None:
    """Stores ``value`` at a fused ``path`` (``("embed",)`` or ``("layers", i, name)``)."""
    if path[0] == "layers":
        params.setdefault("layers", [])
        params["layers"].extend({} for _ in range(path[1] + 1 - len(params["layers"])))
        params["layers"][path[1]][path[2]] = value
    else:
        params[path[0]] = value


def fuse_target_params(unfused: dict, config: TargetConfig) -> dict:
    """Fuses q/k/v and gate/up kernels (and biases) into the layout :mod:`longspec_jax.target` uses."""
    params: dict = {}
    for path, parts in fused_leaves(config).items():
        arrays = [_get_path(unfused, spec.path) for spec in parts]
        set_fused(params, path, arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-1))
    return params
