"""Floors of a speculative round's phases: no phase can run faster than the larger of the bytes it must read over
the copy bandwidth and its FLOPs over the tensor cores' peak (by the counts below).

A target pass (a plain step: 1 row per sequence; verification: the tree's nodes) reads every layer weight and the
LM head once, and each sequence's K/V cache; a draft pass (step 0: the root; a tree level: the nodes of the level
it grows from) reads the draft's layer, the shared LM head and the target's last-layer K/V cache, which its
cross-attention reads. FLOPs: 2 per weight per row, and 4 x rows x query heads x cached keys x head_dim per
attention layer. Norm weights count as GEMM weights, embedding rows and the draft's ring are left out: each is
under 0.1% of a phase's bytes at the shapes measured.
"""

from __future__ import annotations

import dataclasses

import jax

from infer.bench.harness import nbytes

PEAK_FLOPS = 790e12  # bf16 dense matrix rate measured on the H200; the FLOP ceiling of every roofline


@dataclasses.dataclass(frozen=True)
class Floor:
    bytes: float
    flops: float

    def seconds(self, copy_bw: float, peak_flops: float = PEAK_FLOPS) -> float:
        return max(self.bytes / copy_bw, self.flops / peak_flops)

    def bound(self, copy_bw: float, peak_flops: float = PEAK_FLOPS) -> str:
        """What sets the floor: ``"bytes"`` or ``"FLOPs"``."""
        return "FLOPs" if self.flops / peak_flops > self.bytes / copy_bw else "bytes"

    def __add__(self, other: Floor) -> Floor:
        return Floor(self.bytes + other.bytes, self.flops + other.flops)


def lm_head(tparams) -> jax.Array:
    return tparams["lm_head"] if "lm_head" in tparams else tparams["embed"]  # tied: the embedding


def kv_bytes(config, itemsize: int, batch: int, keys: int, layers: int) -> int:
    return batch * keys * layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def target_pass(tparams, config, batch: int, rows: int, keys: int) -> Floor:
    """One target pass of ``rows`` new tokens per sequence over ``keys`` cached ones, for ``batch`` sequences."""
    head = lm_head(tparams)
    return _pass(nbytes(tparams["layers"]) + nbytes(head), head.dtype.itemsize, config, batch, rows, keys,
                 config.num_layers)


def draft_pass(draft_variables, tparams, config, batch: int, rows: int, keys: int) -> Floor:
    """One draft pass of ``rows`` queries per sequence, its cross-attention over ``keys`` cached target tokens.
    The draft's cross-attention key/value projections, kept only for checkpoints, are not read."""
    params = draft_variables["params"]
    unused = nbytes({k: v for k, v in params["cross_attn"].items() if k in ("k_proj", "v_proj")})
    head = lm_head(tparams)
    return _pass(nbytes(params) - unused + nbytes(head), head.dtype.itemsize, config, batch, rows, keys, 1)


def _pass(weight_bytes: int, itemsize: int, config, batch: int, rows: int, keys: int, layers: int) -> Floor:
    """Weights read once, ``layers`` layers of each sequence's K/V cache; 2 FLOPs per weight and row, and the
    attention of ``rows`` queries over ``keys`` keys in ``layers`` layers."""
    gemm = 2 * (weight_bytes // itemsize) * batch * rows
    attention = 4 * batch * rows * config.num_heads * keys * config.head_dim * layers
    return Floor(weight_bytes + kv_bytes(config, itemsize, batch, keys, layers), gemm + attention)


def round_floors(tparams, draft_variables, config, tree_shape: tuple[int, ...], batch: int, keys: int) -> dict:
    """Floors of the phases ``tools.spec_phases.phase_times`` times, by its names, and of the whole round
    (draft step 0, the tree levels that run the draft, verification)."""
    floors = {"plain_step": target_pass(tparams, config, batch, 1, keys),
              "draft_step0": draft_pass(draft_variables, tparams, config, batch, 1, keys),
              "verify": target_pass(tparams, config, batch, 1 + sum(tree_shape), keys)}  # the root and the tree
    for k in range(1, len(tree_shape)):  # level k + 1 grows from level k's nodes
        floors[f"tree_level{k + 1}"] = draft_pass(draft_variables, tparams, config, batch, tree_shape[k - 1], keys)
    floors["full_round"] = sum((f for name, f in floors.items() if name != "plain_step"), Floor(0, 0))
    return floors
