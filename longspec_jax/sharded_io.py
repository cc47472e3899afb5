"""Loading a target checkpoint straight onto a tensor-parallel mesh.

Each distinct block of every parameter (what one device, or the devices that replicate it, hold) is read from
the memory-mapped safetensors tensors (a grouped fused kernel's block: the g-th slice of each of its parts),
transposed, cast, copied to its devices, and released before the next block is read. The host never holds the
model, nor a whole tensor that is sharded: its peak is about one block (a replicated tensor: one tensor).
``jax.make_array_from_callback`` would hold every device's block of a parameter at once.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from longspec_jax.config import TargetConfig
from longspec_jax.tensor_parallel import model_size, target_shardings
from longspec_jax.weights import TensorSource, TensorSpec, check_keys, fused_leaves, set_fused, target_tensor_specs


def _shape(parts: tuple[TensorSpec, ...], groups: int) -> tuple[int, ...]:
    """Shape of a fused leaf: one part as in the pytree; several grouped, ``[d, G, F/G]`` or ``[G, F/G]``."""
    first = parts[0]
    if len(parts) == 1:
        return first.shape[::-1] if first.transpose else first.shape
    width = sum(spec.shape[0] for spec in parts) // groups
    return (first.shape[1], groups, width) if first.transpose else (groups, width)


def _read_block(source: TensorSource, spec: TensorSpec, index: tuple, dtype) -> np.ndarray:
    """``index`` (slices of the pytree layout) of one tensor, read from the source's layout."""
    if spec.transpose:
        return np.asarray(source.get(spec.name)[index[::-1]]).T.astype(dtype)
    return np.asarray(source.get(spec.name)[index]).astype(dtype)


def _read_grouped(source: TensorSource, parts: tuple[TensorSpec, ...], groups: int, index: tuple,
                  dtype) -> np.ndarray:
    """``index`` of a grouped fused leaf: for each group asked for, the g-th slices of its parts (rows of PyTorch
    ``[out, in]`` kernels or of biases) side by side, written straight into the one block allocated."""
    chosen = range(groups)[index[-2]]
    width = sum(spec.shape[0] for spec in parts) // groups
    block = None
    for i, g in enumerate(chosen):
        start = 0
        for spec in parts:
            rows = spec.shape[0] // groups
            part = source.get(spec.name)[g * rows:(g + 1) * rows]
            part = (part.T if spec.transpose else part)[index[:-2]]
            if block is None:
                block = np.empty(part.shape[:-1] + (len(chosen), width), dtype)
            block[..., i, start:start + rows] = part
            start += rows
    return block[..., index[-1]]


def load_sharded_params(source: TensorSource, config: TargetConfig, dtype, mesh: Mesh, where: str,
                        ignore=(), expected_from: str = "") -> dict:
    """The grouped target pytree (:mod:`longspec_jax.tensor_parallel`) of ``dtype`` on ``mesh``, each device's
    blocks read from ``source`` (checked against the config first, as :func:`longspec_jax.weights.read_tensors`
    does)."""
    check_keys(source, target_tensor_specs(config), where, ignore, expected_from)
    groups, dtype = model_size(mesh), np.dtype(dtype)
    leaves = fused_leaves(config)
    structure: dict = {}
    for path, parts in leaves.items():
        set_fused(structure, path, jax.ShapeDtypeStruct(_shape(parts, groups), dtype))
    shardings = target_shardings(structure, config, mesh)
    params: dict = {}
    for path, parts in leaves.items():
        sharding = shardings[path[0]] if len(path) == 1 else shardings["layers"][path[1]][path[2]]
        if len(parts) == 1:
            read = lambda index, spec=parts[0]: _read_block(source, spec, index, dtype)
        else:
            read = lambda index, parts=parts: _read_grouped(source, parts, groups, index, dtype)
        set_fused(params, path, _place(_shape(parts, groups), sharding, read))
    return params


def _place(shape: tuple[int, ...], sharding, read) -> jax.Array:
    """The array of ``shape`` laid out by ``sharding``: each distinct block ``read(index)`` once, copied to the
    devices that hold it, and released before the next block is read."""
    blocks: dict[tuple, tuple[tuple, list]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        blocks.setdefault(key, (index, []))[1].append(device)
    shards = []
    for index, devices in blocks.values():
        block = read(index)
        placed = [jax.device_put(block, device) for device in devices]
        jax.block_until_ready(placed)
        shards += placed
        del block
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)
