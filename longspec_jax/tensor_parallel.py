"""Tensor-parallel layout of a target and its draft over a ``("data", "model")`` mesh (:mod:`longspec_jax.mesh`).

Over ``model``: attention heads and KV heads (q/k/v columns, o rows), MLP columns (gate/up) and rows (down), and
the vocabulary of the embedding and LM head (replicated when the vocabulary does not divide); norms replicated.
XLA inserts the all-reduces after the o and down projections.

The fused kernels cannot be cut as they are: ``wqkv`` is ``[q | k | v]`` along its columns, so a plain column
split would give device 0 all of q and none of k. On a mesh they are grouped per shard instead, ``[d, G, F/G]``
(G = the model axis size; biases ``[G, F/G]``): group g holds the g-th slice of every part, ``[q_g | k_g | v_g]``
(its query heads and the KV heads they read), so each device's block is a whole fused kernel of its own heads.
:func:`longspec_jax.target.fused_linear` computes with either layout; without a mesh nothing changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from longspec_jax.config import TargetConfig
from longspec_jax.mesh import MODEL, check_axes
from longspec_jax.target import Target
from longspec_jax.weights import LAYER_LEAVES

COLUMNS = P(None, MODEL)             # [in, out] kernels split along out
ROWS_OF_KERNEL = P(MODEL, None)      # [in, out] kernels split along in (their outputs are partial sums)
GROUPED = P(None, MODEL, None)       # grouped fused kernels [d, G, F/G]
GROUPED_BIAS = P(MODEL, None)        # grouped fused biases [G, F/G]
LAYER_SPECS = {"attn_norm": P(), "mlp_norm": P(), "wqkv": GROUPED, "bqkv": GROUPED_BIAS, "wo": ROWS_OF_KERNEL,
               "bo": P(), "w_gate_up": GROUPED, "b_gate_up": GROUPED_BIAS, "w_down": ROWS_OF_KERNEL, "b_down": P()}
FUSED = tuple(name for name, parts in LAYER_LEAVES.items() if len(parts) > 1)


def model_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL]


def check_mesh(config: TargetConfig, mesh: Mesh) -> None:
    """A clear ``ValueError`` unless ``mesh`` has the axes ``("data", "model")`` and the model axis divides the
    KV heads (so the query heads too) and the MLP width."""
    check_axes(mesh)
    tp = model_size(mesh)
    if config.num_kv_heads % tp:
        raise ValueError(f"tensor parallelism over {tp} devices (the mesh's model axis) needs a KV-head count "
                         f"divisible by {tp}; this model has {config.num_kv_heads} KV heads")
    if config.intermediate_size % tp:
        raise ValueError(f"tensor parallelism over {tp} devices needs an MLP width divisible by {tp}; this model's "
                         f"intermediate_size is {config.intermediate_size}")


def part_widths(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Column widths of the parts of each fused leaf (``wqkv``: q, k, v; ``w_gate_up``: gate, up)."""
    hd, I = config.head_dim, config.intermediate_size
    qkv = (config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd)
    return {"wqkv": qkv, "bqkv": qkv, "w_gate_up": (I, I), "b_gate_up": (I, I)}


def group_columns(fused_xF, widths: tuple[int, ...], groups: int):
    """``[..., sum(widths)] -> [..., G, sum(widths) / G]``: group g = the g-th slice of every part, in order."""
    lead = fused_xF.shape[:-1]
    parts, start = [], 0
    for w in widths:
        parts.append(fused_xF[..., start:start + w].reshape(*lead, groups, w // groups))
        start += w
    return jnp.concatenate(parts, axis=-1)


def group_params(params: dict, config: TargetConfig, groups: int) -> dict:
    """The fused target pytree with its fused leaves grouped for ``groups`` shards (jittable)."""
    widths = part_widths(config)
    layers = [{name: group_columns(value, widths[name], groups) if name in FUSED else value
               for name, value in layer.items()} for layer in params["layers"]]
    return {**params, "layers": layers}


def target_specs(params: dict, config: TargetConfig, mesh: Mesh) -> dict:
    """A PartitionSpec per leaf of a grouped target pytree (arrays or shape structs)."""
    vocab = config.vocab_size % model_size(mesh) == 0
    specs = {name: P() for name in params if name != "layers"}
    if vocab:
        specs["embed"] = ROWS_OF_KERNEL
        if "lm_head" in params:
            specs["lm_head"] = COLUMNS
    specs["layers"] = [{name: LAYER_SPECS[name] for name in layer} for layer in params["layers"]]
    return specs


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def target_shardings(params: dict, config: TargetConfig, mesh: Mesh) -> dict:
    """NamedShardings of a grouped target pytree on ``mesh``."""
    return named(mesh, target_specs(params, config, mesh))


def shard_target(target: Target, mesh: Mesh) -> Target:
    """An in-memory target (e.g. random weights for tests and benchmarks) grouped and placed on ``mesh``; loading
    from files with ``load_target(path, mesh=mesh)`` does this without a host copy."""
    if target.mesh is not None:
        raise ValueError("this target is already sharded over a mesh; build or load it again to shard it anew")
    check_mesh(target.config, mesh)
    params = group_params(target.params, target.config, model_size(mesh))
    params = jax.device_put(params, target_shardings(params, target.config, mesh))
    return dataclasses.replace(target, params=params, mesh=mesh)


# Draft projections by Flax module name: split along their output columns, or along their input rows.
_DRAFT_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_DRAFT_ROWS = ("o_proj", "down_proj")


def _draft_spec(path, leaf, tp: int) -> P:
    names = [getattr(key, "key", None) for key in path]
    module, kind = names[-2], names[-1]
    if module in _DRAFT_COLUMNS and leaf.shape[-1] % tp == 0:
        return COLUMNS if kind == "kernel" else P(MODEL)
    if module in _DRAFT_ROWS and kind == "kernel" and leaf.shape[0] % tp == 0:
        return ROWS_OF_KERNEL
    return P()


def shard_draft(draft, mesh: Mesh):
    """A :class:`longspec_jax.draft.Draft` placed on ``mesh`` the way its target is: heads and MLP columns over
    ``model`` (its attention then reads the target's sharded cache on each device), a draft vocabulary's LM-head
    columns over ``model`` as the target's vocabulary (where they divide), hook data and vocabulary ids
    replicated."""
    tp = model_size(mesh)
    specs = jax.tree_util.tree_map_with_path(lambda path, leaf: _draft_spec(path, leaf, tp), draft.variables)
    vocab = draft.vocab
    if vocab is not None:
        vocab = vocab.replace(ids=jax.device_put(vocab.ids, NamedSharding(mesh, P())),
                              head=jax.device_put(vocab.head, NamedSharding(mesh, COLUMNS if vocab.size % tp == 0
                                                                            else P())))
    return dataclasses.replace(draft, variables=jax.device_put(draft.variables, named(mesh, specs)),
                               hook_data=jax.device_put(draft.hook_data, NamedSharding(mesh, P())), vocab=vocab)
