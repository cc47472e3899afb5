"""jax's Mosaic GPU interpreter (CPU runs of Mosaic GPU kernels), taught to read transposed wgmma operands.

jax 0.10-0.11's interpreter simulates warpgroups, barriers, TMA copies and wgmma, but its wgmma reads an operand
only from shared memory through plain indexers. An operand passed as ``plgpu.transpose_ref(ref, perm)`` (the K
tile of ``Q K^T``) fails inside it with ``'TransposeTransform' object has no attribute 'indices'``, and a left
operand in registers (the P of ``P V``) is taken for an allocation key. :func:`interpret_params` wraps that one
callback so that trailing transposes are applied to an operand after it is read and a register operand is used as
it is, and returns the parameters that select the interpreter. Nothing else of the interpreter changes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

__all__ = ["interpret_params"]


def _split_transpose(transforms):
    """``(transforms without a trailing transpose, its permutation or None)``."""
    from jax._src.state.types import TransposeTransform

    if transforms and isinstance(transforms[-1], TransposeTransform):
        return tuple(transforms[:-1]), tuple(transforms[-1].permutation)
    return transforms, None


def _wgmma_with_transposes(original, **kw):
    a_transforms, a_perm = _split_transpose(kw["a_transforms"])
    b_transforms, b_perm = _split_transpose(kw["b_transforms"])
    a_in_registers = np.ndim(kw["a_allocation_key_as_array"]) == 2  # a value, not a shared-memory allocation key
    if a_perm is None and b_perm is None and not a_in_registers:
        return original(**kw)
    from jax._src.pallas.mosaic.interpret import utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

    device_id, thread_id = int(kw["device_id"]), int(kw["thread_id"])
    memory = cb._get_shared_memory()
    thread = memory.get_global_thread_id(device_id, thread_id)
    info = utils.GPULoggingInfo(device_id=device_id, grid_point_coords=tuple(int(x) for x in kw["grid_point_coords"]),
                                thread_id=thread_id, source_info=kw.get("source_info"))

    def read(key, transforms):
        transforms = jax.tree.map(int, cb._remove_noop_transforms(transforms))
        value, _, _ = memory.get_buffer_content(cb.HostAllocationKey.from_array(key), utils.to_range(transforms),
                                                thread, logging_info=info)
        return value, utils.to_range(transforms)

    a = np.asarray(kw["a_allocation_key_as_array"]) if a_in_registers else read(kw["a_allocation_key_as_array"],
                                                                                  a_transforms)[0]
    b, _ = read(kw["b_allocation_key_as_array"], b_transforms)
    a = a if a_perm is None else np.transpose(a, a_perm)
    b = b if b_perm is None else np.transpose(b, b_perm)
    acc, acc_range = read(kw["acc_allocation_key_as_array"], kw["acc_transforms"])
    memory.store_buffer_content(cb.HostAllocationKey.from_array(kw["acc_allocation_key_as_array"]), acc_range,
                                acc + np.matmul(a, b, dtype=kw["acc_dtype"]), thread, logging_info=info)
    return kw["token"]


@functools.cache
def _install() -> None:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.wgmma = functools.partial(_wgmma_with_transposes, gpu_callbacks.wgmma)


def interpret_params():
    """``interpret=`` value for ``plgpu.kernel`` that runs it in the (patched) Mosaic GPU interpreter."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    _install()
    return InterpretGPUParams()
