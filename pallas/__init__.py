"""Pallas GPU kernels for hybrid tree attention, each with a pure-jnp reference (``pallas.reference``).

``tree_attention``: the speculative half (new queries x new keys under a boolean mask).
``cache_attention``: the cache half (split-K flash-decoding over the valid cache prefix).
``mosaic_cache_attention``: the cache half for many query rows on Hopper (Mosaic GPU: wgmma + TMA).
Both return ``(o in q.dtype, lse float32)``; ``backend=None`` picks Triton on GPU and interpret mode elsewhere.
"""

from pallas.backend import BACKENDS, resolve_backend
from pallas.cache_attention import cache_attention, cache_attention_partials
from pallas.reference import cache_attention_reference, default_scale, masked_attention_reference
from pallas.tree_attention import tree_attention

__all__ = ["BACKENDS", "resolve_backend", "tree_attention", "cache_attention", "cache_attention_partials",
           "masked_attention_reference", "cache_attention_reference", "default_scale"]
