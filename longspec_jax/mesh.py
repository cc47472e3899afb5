"""The tensor-parallel mesh: its axis names, the mesh of the current trace, and custom kernels run per shard.

Sharded decoding runs under ``jax.set_mesh(mesh)`` with axes ``("data", "model")``: batch rows over ``data``;
attention heads and KV heads, MLP columns and the vocabulary over ``model`` (:mod:`longspec_jax.tensor_parallel`
lays out the parameters). XLA's SPMD partitioner splits everything except the custom attention kernels
(Pallas, Mosaic GPU, cuDNN), which :func:`per_shard` runs under ``shard_map`` on each device's rows and heads.
Under no mesh (or one without a ``model`` axis) every function here is the identity, so single-device programs
are unchanged.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
HEADS = P(DATA, None, MODEL, None)  # [B, tokens, heads, D]: rows over data, heads over model
HEAD_LSE = P(DATA, None, MODEL)     # [B, tokens, heads]
ROWS = P(DATA)                      # [B, ...] without a head axis


def make_mesh(model: int | None = None, data: int = 1, devices=None) -> Mesh:
    """A ``("data", "model")`` mesh over ``devices`` (default: all); ``model=None`` takes what ``data`` leaves."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or len(devices) % data:
        raise ValueError(f"mesh data axis {data} does not divide the {len(devices)} devices")
    model = len(devices) // data if model is None else model
    if model < 1 or model * data != len(devices):
        raise ValueError(f"mesh data x model = {data} x {model} does not match the {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(data, model), AXES)


def check_axes(mesh: Mesh) -> None:
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"a tensor-parallel mesh needs the axes {AXES} (longspec_jax.mesh.make_mesh), got "
                         f"{tuple(mesh.axis_names)}")


def active_mesh():
    """The mesh of the current trace (``jax.set_mesh``) when it has a ``model`` axis, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or MODEL not in mesh.axis_names else mesh


def per_shard(fn, in_specs: tuple, out_specs):
    """``fn`` run under ``shard_map`` on each device's block (``in_specs`` / ``out_specs``: PartitionSpecs such as
    :data:`HEADS`) when the current trace has a mesh; ``fn`` itself otherwise. For functions that work on any
    subset of rows and heads (attention: query head h reads KV head h // G, and each shard holds whole groups)."""
    if active_mesh() is None:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """``x`` laid out by ``spec`` on the current trace's mesh; ``x`` itself without one."""
    return x if active_mesh() is None else jax.lax.with_sharding_constraint(x, spec)
