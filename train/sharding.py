"""The device mesh of a training run and how its arrays are laid out on it.

Mesh axes ``("data", "fsdp")``. Batches are split over both axes (every device computes on its own rows);
parameters of the draft and of the frozen target, and the optimizer state, are sharded over ``fsdp`` along
their largest dimension that divides (replicated when none does); XLA gathers them where they are used.
Multi-host runs call ``jax.distributed.initialize`` first (:func:`init_distributed`).
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from longspec_jax.errors import ConfigError
from train.config import MeshSection
from train.step import train_step

AXES = ("data", "fsdp")
BATCH_AXES = AXES  # the row axis of a batch is split over both mesh axes

_COORDINATOR_VARS = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def init_distributed() -> None:
    """``jax.distributed.initialize()`` when launched as one of several processes (a coordinator address, a
    SLURM job or an MPI launch in the environment); nothing for a single process."""
    if any(v in os.environ for v in _COORDINATOR_VARS) and jax.process_count() == 1:
        jax.distributed.initialize()


def make_mesh(section: MeshSection, devices=None) -> Mesh:
    """A ``data x fsdp`` mesh over ``devices`` (default: all); ``data = 0`` takes what ``fsdp`` leaves."""
    devices = list(jax.devices() if devices is None else devices)
    fsdp = section.fsdp
    data = section.data or len(devices) // fsdp
    if data * fsdp != len(devices):
        raise ConfigError(f"mesh.data x mesh.fsdp = {data} x {fsdp} does not match the {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp), AXES)


def batch_sharding(mesh: Mesh, ndim: int, row_axis: int = 0) -> NamedSharding:
    """Rows (axis ``row_axis``) split over every device; other axes whole."""
    spec = [None] * ndim
    spec[row_axis] = BATCH_AXES
    return NamedSharding(mesh, P(*spec))


def param_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """``fsdp`` on the largest dimension it divides (the first of equals), else replicated."""
    if fsdp > 1:
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % fsdp == 0 and shape[axis] >= fsdp:
                spec = [None] * len(shape)
                spec[axis] = "fsdp"
                return P(*spec)
    return P()


def tree_shardings(mesh: Mesh, tree):
    """A NamedSharding per array leaf of ``tree`` (arrays or ShapeDtypeStructs) by :func:`param_spec`."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda a: NamedSharding(mesh, param_spec(tuple(a.shape), fsdp)), tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_batch(mesh: Mesh, rows: dict, row_axis: int = 0) -> dict:
    """Places a host batch (numpy, the same global batch on every process) on the mesh, each process
    contributing its slice of the rows."""
    out = {}
    for name, array in rows.items():
        sharding = batch_sharding(mesh, array.ndim, row_axis)
        out[name] = jax.make_array_from_callback(array.shape, sharding, lambda index, a=array: a[index])
    return out


def jit_train_step(settings, optimizer, schedule, mesh: Mesh, state_sharding, target_sharding):
    """:func:`train.step.train_step` compiled for ``mesh``: explicit shardings of the state (donated), the
    target's parameters and the batch (``[micro_batches, rows, ...]``, rows over every device); metrics
    replicated."""
    batch = {"tokens": batch_sharding(mesh, 3, 1), "targets": batch_sharding(mesh, 3, 1),
             "lengths": batch_sharding(mesh, 2, 1)}
    return jax.jit(functools.partial(train_step, settings, optimizer, schedule), donate_argnums=(0,),
                   in_shardings=(state_sharding, target_sharding, batch),
                   out_shardings=(state_sharding, replicated(mesh)))
