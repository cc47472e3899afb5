"""Integer size arithmetic shared by the kernels, the library and the host side, and the GPU's SM count."""

from __future__ import annotations

NUM_SMS = 132  # streaming multiprocessors of an H100 / H200: the default of the launch-size heuristics


def ceil_div(a, b):
    """``ceil(a / b)`` for ``a >= 0``, ``b > 0`` (Python ints, or traced ints inside jit and kernels)."""
    return (a + b - 1) // b


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return ceil_div(n, multiple) * multiple


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= max(n, minimum)``."""
    return 1 << (max(int(n), minimum) - 1).bit_length()
