"""Launch shape of the Mosaic GPU cache half (:mod:`pallas.mosaic_cache_attention`): the config it runs with and
the default chosen from the call's sizes, tuned on the H200 by sweeps of the cache half alone and in the round."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from pallas.sizes import NUM_SMS, ceil_div

ROWS_PER_WG = 64  # one wgmma's M: the query rows of a compute warpgroup
SMEM_BYTES = 227 * 1024  # shared memory a Hopper thread block may use
SM_SMEM_BYTES = 228 * 1024  # shared memory of a Hopper SM; the driver reserves 1 KiB of it per resident block
BLOCK_RESERVED_SMEM = 1024


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch shape: ``num_splits`` chunks per sequence, ``block_kv`` keys per TMA tile, ``stages`` K/V slots in
    shared memory, ``compute_wgs`` warpgroups of 64 query rows per thread block."""
    num_splits: int
    block_kv: int = 128
    stages: int = 2
    compute_wgs: int = 2
    accumulate: str = "state"  # P V straight into the output accumulator (pl.run_state); "fresh": into a new
    # accumulator, then rescale-and-add in one FMA (2% slower on the H200; what jax's interpreter can run)
    pingpong: bool = True  # two compute warpgroups take turns on the tensor cores; False: each issues when ready
    # (3% slower on the H200; the schedule three warpgroups always use, testable in the interpreter)
    light_splits: int | None = None  # split count of the last row block when some of its rows are padding (its
    # later splits are empty); None: num_splits. A row block with an idle warpgroup runs faster, so it can take
    # fewer, longer chunks

    def rows_per_block(self) -> int:
        return self.compute_wgs * ROWS_PER_WG

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        tiles = (self.compute_wgs * ROWS_PER_WG + 2 * self.stages * self.block_kv) * head_dim * itemsize
        return tiles + self.compute_wgs * ROWS_PER_WG * 4

    def blocks_per_sm(self, head_dim: int, itemsize: int = 2) -> int:
        """Thread blocks of this shape that one SM holds at once, as its shared memory allows."""
        return max(1, SM_SMEM_BYTES // (self.smem_bytes(head_dim, itemsize) + BLOCK_RESERVED_SMEM))

    def check(self, capacity: int, head_dim: int, itemsize: int) -> None:
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"mosaic cache attention: block_kv={self.block_kv} must be a positive multiple of 64")
        if capacity % self.block_kv:
            raise ValueError(f"mosaic cache attention: capacity {capacity} must be a multiple of "
                             f"block_kv={self.block_kv}")
        if self.light_splits is not None and not 1 <= self.light_splits <= self.num_splits:
            raise ValueError(f"mosaic cache attention: light_splits={self.light_splits} must be in "
                             f"[1, num_splits={self.num_splits}]")
        if self.stages < 1 or self.compute_wgs < 1 or self.num_splits < 1:
            raise ValueError(f"mosaic cache attention: stages, compute_wgs and num_splits must be >= 1 ({self})")
        if self.accumulate not in ("fresh", "state"):
            raise ValueError(f"mosaic cache attention: accumulate={self.accumulate!r}; choose fresh or state")
        if self.smem_bytes(head_dim, itemsize) > SMEM_BYTES:
            raise ValueError(f"mosaic cache attention: {self} needs {self.smem_bytes(head_dim, itemsize)} bytes of "
                             f"shared memory for head_dim {head_dim}; at most {SMEM_BYTES}")


# Thread blocks per SM that the split count aims at, from an H200 sweep (74 queries; the
# best of 5 to 10 split counts at each of four shapes): about 4.9 waves for head_dim 64, 1.8 for head_dim 128.
# More splits fill the SMs better but write and merge more partial outputs.
WAVES = {64: 4.9, 128: 1.8}
# Fewest cache slots per split: shorter chunks spend more of their time filling the pipeline and writing partials
# than extra waves win back (H200, the draft's cross-attention, 64 rows at 16k, B=1: 24 splits
# of 683 keys 38.4 us, the waves' 36 splits of 455 keys 46.0 us).
MIN_SPLIT_KEYS = 640


def full_wave_splits(blocks: int, most: int, slots: int = NUM_SMS) -> int:
    """The split count in ``1..most`` that wastes least of the last wave when ``blocks`` x splits thread blocks run
    ``slots`` at a time (SMs x blocks per SM): the fewest waves per split, ``ceil(blocks * s / slots) / s`` (the
    time per unit of work), and of equals the fewest splits."""
    return min(range(1, max(most, 1) + 1), key=lambda s: Fraction(ceil_div(blocks * s, slots), s))  # first: fewest


def default_compute_wgs(rows: int, head_dim: int) -> int:
    """Compute warpgroups per thread block: one for at most 64 rows, two up to 128 and at head_dim above 64 (three:
    twice as slow at 128 on the H200); above 128 rows at head_dim 64 three (1.8% less busy
    verification in the round, 16% faster prefill chunks alone)."""
    if rows <= ROWS_PER_WG:
        return 1
    if head_dim > 64 or rows <= 2 * ROWS_PER_WG:
        return 2
    return 3


def one_wave_splits(full_blocks: int, light_blocks: int, slots: int, most: int) -> tuple[int, int] | None:
    """``(splits, light_splits)`` that put every thread block in one wave of ``slots``: ``full_blocks`` thread
    blocks a split of full row blocks, ``light_blocks`` of light ones (a warpgroup idle), the light chunks at most
    half again as long as the full ones (``light_splits >= 2/3 splits``); the most splits, then the most light
    splits. None where not even two splits fit."""
    for splits in range(most, 1, -1):
        for light in range(splits, ceil_div(2 * splits, 3) - 1, -1):
            if full_blocks * splits + light_blocks * light <= slots:
                return splits, light
    return None


def default_mosaic_config(batch: int, kv_heads: int, rows: int, capacity: int, head_dim: int, *,
                          num_sms: int = NUM_SMS, compute_wgs: int | None = None,
                          one_wave: bool = True) -> MosaicConfig:
    """Compute warpgroups by :func:`default_compute_wgs` (or ``compute_wgs``); 128-key tiles (64 for head_dim >
    128), two stages (three for head_dim 64). Split count: the one whose thread blocks of (up to) two warpgroups
    come closest to ``WAVES`` waves of the SMs, with at least ``MIN_SPLIT_KEYS`` of the ``capacity`` slots per
    split; with more than one compute warpgroup, then the :func:`full_wave_splits` count of at most half again as
    many (the best of an H200 sweep at six shapes; verification at 16k, 11 splits instead
    of 12 filled three whole waves, 11% less time alone, 2.9% less in the round).

    one_wave: where the last row block has an idle warpgroup (72 queries x group 4 = 288 rows in blocks of 128 or
    192), take :func:`one_wave_splits` instead when it cuts no more chunks than the rule above: every thread block
    in one wave, the light row block in fewer, longer chunks (H200, the cache half alone:
    -8% at the padded pair's 16k verification, -2.4% at 32k, Llama-3-8B's -10% at 16k and -4% at 32k; the padded
    round at 16k 1.4-2.2% less busy, at 32k unchanged)."""
    block_kv = 128 if head_dim <= 128 else 64
    stages = 3 if head_dim <= 64 else 2
    split_wgs = 1 if rows <= ROWS_PER_WG else 2  # warpgroups per thread block, as the waves rule counts them
    blocks = batch * kv_heads * ceil_div(rows, split_wgs * ROWS_PER_WG)
    waves = WAVES[64] if head_dim <= 64 else WAVES[128]
    most = capacity // MIN_SPLIT_KEYS
    splits = max(min(round(waves * num_sms / blocks), most), 1)
    compute_wgs = default_compute_wgs(rows, head_dim) if compute_wgs is None else compute_wgs
    cfg = MosaicConfig(num_splits=splits, block_kv=block_kv, stages=stages, compute_wgs=compute_wgs)
    if compute_wgs == 1:  # several blocks per SM and short chunks: the waves rule measured best on the H200
        return cfg
    row_blocks = ceil_div(rows, compute_wgs * ROWS_PER_WG)
    slots = num_sms * cfg.blocks_per_sm(head_dim)
    cfg = dataclasses.replace(cfg, num_splits=full_wave_splits(batch * kv_heads * row_blocks,
                                                               min(ceil_div(3 * splits, 2), most), slots))
    last_block_rows = rows - (row_blocks - 1) * compute_wgs * ROWS_PER_WG
    if not one_wave or last_block_rows > (compute_wgs - 1) * ROWS_PER_WG:  # no warpgroup idle
        return cfg
    fit = one_wave_splits(batch * kv_heads * (row_blocks - 1), batch * kv_heads, slots, cfg.num_splits)
    if fit is None:
        return cfg
    splits, light = fit
    return dataclasses.replace(cfg, num_splits=splits, light_splits=light if light < splits else None)
