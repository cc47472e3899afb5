"""Launch-shape variants of the Mosaic GPU cache half, for A/B runs of the whole round in one process
(``python -m tools.profile --mosaic '{"wgs2": {"compute_wgs": 2}}'``)."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import jax

from pallas.mosaic_config import ROWS_PER_WG, MosaicConfig

MIN_ROWS = 2 * ROWS_PER_WG  # calls with more folded rows than this change (verification, prefill chunks); the
# draft's cross-attention (16 queries x the group) keeps its default
FIELDS = tuple(f.name for f in dataclasses.fields(MosaicConfig))


def check_fields(fields: dict) -> None:
    """Raises a ValueError when ``fields`` is not a dict or names a key that is not a :class:`MosaicConfig` field."""
    if not isinstance(fields, dict):
        raise ValueError(f"expected {{field: value}}, got {fields!r}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown MosaicConfig field(s) {', '.join(unknown)}; choose from {', '.join(FIELDS)}")


@contextlib.contextmanager
def mosaic_override(fields: dict):
    """While active, the Mosaic cache half of every call with more than :data:`MIN_ROWS` folded rows runs the
    default launch shape for its sizes with ``compute_wgs`` (when given) chosen before the split count, then the
    other ``fields`` replaced (a ``num_splits`` without ``light_splits`` for every row block). jax's caches are
    cleared on entry and exit: trace the round inside the block."""
    if not fields:
        yield
        return
    check_fields(fields)
    import pallas.mosaic_cache_attention as mca
    rule = mca.default_mosaic_config
    wgs, rest = fields.get("compute_wgs"), {k: v for k, v in fields.items() if k != "compute_wgs"}
    if "num_splits" in rest:
        rest.setdefault("light_splits", None)

    def config(batch, kv_heads, rows, capacity, head_dim, **kw):
        if rows <= MIN_ROWS:
            return rule(batch, kv_heads, rows, capacity, head_dim, **kw)
        return dataclasses.replace(rule(batch, kv_heads, rows, capacity, head_dim, compute_wgs=wgs, **kw), **rest)

    jax.clear_caches()  # mosaic_cache_attention is jitted with config=None static: make it look the rule up again
    try:
        with mock.patch.object(mca, "default_mosaic_config", config):
            yield
    finally:
        jax.clear_caches()
