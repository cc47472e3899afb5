"""Cache half of hybrid tree attention on Hopper: a warp-specialised Mosaic GPU flash kernel (wgmma + TMA).

With a GQA group folded into the query rows, verification has hundreds of rows per kv head (74 tree queries x 4
= 296), so its cache half is bound by matrix work, not by reading the cache. This kernel runs that work on the
tensor cores. Its input is the folded queries ``q_BxRxKxD`` (row ``m * G + g`` is query ``m`` of head
``k * G + g``, :func:`pallas.folding.fold_group`), with the row count padded to whole row blocks. The valid prefix
``[0, lengths[b])`` of each sequence is cut at run time into ``num_splits`` chunks of whole key blocks (the last row
block, where some of its rows are padding, into ``light_splits``: its later splits come out empty). Each thread
block (row block, split, kv head x batch) then runs:

* one memory warpgroup that streams the chunk's K and V tiles into ``stages`` shared-memory slots by TMA;
* ``compute_wgs`` warpgroups of 64 query rows each: ``S = Q K^T`` and ``O += P V`` with wgmma, the online
  softmax in float32 registers in between. Two compute warpgroups take turns on the tensor cores (one runs its
  softmax while the other multiplies), as in FlashAttention-3, unless ``pingpong=False``.

A compute warpgroup whose 64 rows are all padding (past the ``valid_rows`` the caller names: 296 folded rows fill
six warpgroups' 384, the sixth none) only keeps pace with the barrier protocol: it takes its turns and frees each
K/V slot once its tile has come, so its partner runs alone, and its rows of the output stay unwritten.

It writes each split's normalised output ``[splits, B, R, K, D]`` (q's dtype) and float32 natural-log LSE
``[splits, B, K, R]``. An empty split gets output 0 and LSE ``-inf``. :func:`mosaic_cache_attention` folds the
queries, runs the kernel and merges the splits (and the tree half, when given) in float32.

Few keys past the valid length are read: the last block of a chunk is shifted back to end at the chunk's end
rounded up to a multiple of 8 (TMA alignment), and its keys that the previous block already covered, or past the
end, are masked. So slots past ``round_up(lengths, 8)`` may hold anything, while the up to 7 slots before that
(and, for a sequence shorter than one key block, the slots up to ``block_kv``) are read and masked and must hold
finite values: a masked key weighs exactly 0, but 0 x NaN is NaN. Every cache this library builds holds zeros or
K/V there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas.folding import fold_group, merge_folded_splits
from pallas.mosaic_config import ROWS_PER_WG, MosaicConfig, default_mosaic_config
from pallas.reference import check_cache_operands, default_scale
from pallas.sizes import ceil_div

__all__ = ["MosaicConfig", "ROWS_PER_WG", "mosaic_cache_attention", "mosaic_cache_partials", "default_mosaic_config",
           "mosaic_supports", "check_mosaic_operands", "mosaic_runs_here", "MOSAIC_DTYPES"]

MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def mosaic_supports(q_dtype, cache_dtype, head_dim: int) -> bool:
    """Whether the kernel takes these operands: half precision of one dtype, head_dim a multiple of 64 up to 256."""
    return (jnp.dtype(q_dtype) == jnp.dtype(cache_dtype)
            and any(jnp.dtype(q_dtype) == jnp.dtype(d) for d in MOSAIC_DTYPES)
            and head_dim % 64 == 0 and head_dim <= 256)


def mosaic_runs_here() -> bool:
    """Whether JAX's default device is a Hopper GPU (compute capability 9.x), the only one wgmma runs on."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def check_mosaic_operands(who: str, q_dtype, cache_dtype, head_dim: int) -> None:
    """Raises a ValueError naming ``who`` when :func:`mosaic_supports` refuses these operands."""
    if not mosaic_supports(q_dtype, cache_dtype, head_dim):
        raise ValueError(f"{who} needs float16/bfloat16 queries and cache of one dtype and a head_dim that is a "
                         f"multiple of 64 up to 256; got q {jnp.dtype(q_dtype)}, cache {jnp.dtype(cache_dtype)}, "
                         f"head_dim {head_dim}")


def _layout_cast(x, layout, interpret: bool):
    """Register layout hint for Mosaic GPU (the interpreter has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _column_iota(shape, interpret: bool):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, 1)
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, cfg: MosaicConfig, kv_heads: int,
            capacity: int, head_dim: int, valid_rows: int, row_blocks: int, scale2: float, interpret: bool):
    (q_smem, k_smem, v_smem, lse_smem), (q_ready, k_ready, v_ready), (k_free, v_free), turn = scoped
    C, bk, stages = cfg.compute_wgs, cfg.block_kv, cfg.stages
    row_block, split, head_batch = lax.axis_index("rows"), lax.axis_index("split"), lax.axis_index("head_batch")
    kv_head = lax.rem(head_batch, kv_heads)
    batch = lax.div(head_batch, kv_heads)
    wg = lax.axis_index("wg")

    # This block's chunk of the valid prefix: num_splits chunks of whole key blocks.
    length = jnp.clip(len_ref[batch], 0, capacity)
    splits = cfg.num_splits
    if cfg.light_splits is not None and valid_rows < row_blocks * cfg.rows_per_block():  # the last block is light
        splits = jnp.where(row_block == row_blocks - 1, cfg.light_splits, splits)
    chunk = pl.cdiv(pl.cdiv(length, splits), bk) * bk  # splits past a light block's count start past the end
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    steps = pl.cdiv(jnp.maximum(end - start, 0), bk)
    # The last block is shifted back to end at `end` rounded up to 8 keys: TMA into the (8, 64)-tiled shared
    # memory needs a start that Mosaic GPU can prove divisible by 8 (start and bk are).
    last_key0 = ((jnp.maximum(end - bk, 0) + 7) // 8) * 8

    def key0(i):  # first key of block i
        return jnp.minimum(start + i * bk, last_key0)

    pingpong = C == 2 and cfg.pingpong

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    row0 = (row_block * C + wg) * ROWS_PER_WG

    def raise_registers():  # 65536 per SM: the memory warpgroup keeps 40 per thread, the compute ones share the
        # rest. Called first in each compute warpgroup's branch, so that it dominates the code that uses them:
        # ptxas can then allocate that code the raised count instead of the launch's 65536 / threads.
        plgpu.set_max_registers(min(232, (65536 // 128 - 40) // C // 8 * 8), action="increase")

    @pl.when((wg < C) & (row0 >= valid_rows))
    def _idle():  # rows all padding: compute nothing, but take the turns and free each K/V tile once it has come
        # (freeing a slot before its tile has come could count towards the slot's next use)
        raise_registers()
        if pingpong:
            pl.when(wg == 1)(take_turn)

        def step(i, _):
            slot, refilled = lax.rem(i, stages), i + stages < steps
            for ready, free in ((k_ready, k_free), (v_ready, v_free)):
                plgpu.barrier_wait(ready.at[slot])
                if pingpong:
                    take_turn()
                pl.when(refilled)(functools.partial(plgpu.barrier_arrive, free.at[slot]))

        lax.fori_loop(0, steps, step, None)
        if pingpong:
            pl.when(wg == 0)(take_turn)

    @pl.when((wg < C) & (row0 < valid_rows))
    def _compute():  # named scopes: the phases that the Mosaic GPU on-device profiler times when it is on
        raise_registers()
        q_tile = q_smem.at[wg]
        with jax.named_scope("load_q"):
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, ROWS_PER_WG), kv_head], q_tile, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
        rows_layout = plgpu.Layout.WGMMA.reduce(1)
        m = _layout_cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), rows_layout, interpret)
        l = _layout_cast(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32), rows_layout, interpret)
        acc = _layout_cast(jnp.full((ROWS_PER_WG, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        if pingpong:
            pl.when(wg == 1)(take_turn)

        def step(i, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(i, stages)

            def qk(s_ref):
                plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                if pingpong:
                    take_turn()
                return s_ref[...]

            with jax.named_scope("scores"):
                s = pl.run_scoped(qk, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
            refilled = i + stages < steps  # the memory warpgroup waits for this slot only if it loads it again
            pl.when(refilled)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
            with jax.named_scope("softmax"):
                if masked:  # the last block: keys before start + i * bk were seen by block i - 1, keys >= end not ours
                    key = key0(i) + _column_iota((ROWS_PER_WG, bk), interpret)
                    s = jnp.where((key >= start + i * bk) & (key < end), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * scale2)  # base-2 units, scaled
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p_half = p.astype(q_tile.dtype)
                alpha_acc = lax.broadcast_in_dim(alpha, acc.shape, [0])
                if cfg.accumulate == "state":
                    acc = acc * alpha_acc

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_half, v_smem.at[slot])

                @pl.when(i + 1 < steps)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(i + 1, stages)])

                if cfg.accumulate == "fresh":
                    return acc_ref[...]

            with jax.named_scope("pv"):  # (with the wait for the next block's K)
                if pingpong:
                    plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                if pingpong:
                    plgpu.barrier_wait(turn)
                if cfg.accumulate == "state":  # P V accumulates into acc's registers
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:  # P V into a fresh accumulator, rescale and add in one FMA (jax's interpreter lacks run_state)
                    acc = acc * alpha_acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            pl.when(refilled)(lambda: plgpu.barrier_arrive(v_free.at[slot]))
            return acc, m_new, l

        carry = lax.fori_loop(0, jnp.maximum(steps - 1, 0), functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(jnp.maximum(steps - 1, 0), steps, functools.partial(step, masked=True), carry)
        if pingpong:
            pl.when(wg == 0)(take_turn)

        with jax.named_scope("write_out"):
            l_safe = jnp.maximum(l, 1.0)  # l >= 1 whenever a key was seen (its max term is 2^0); else acc 0, m -inf
            q_tile[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(q_tile.dtype)
            lse_smem.at[wg][...] = m * LN2 + jnp.log(l_safe)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[split, batch, pl.ds(row0, ROWS_PER_WG), kv_head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[split, batch, kv_head, pl.ds(row0, ROWS_PER_WG)])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == C)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(i, slot, wait_free: bool):
            keys = (batch, pl.ds(key0(i), bk), kv_head)
            for src, dst, ready, free in ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)):
                if wait_free:  # K of the next block may load while V of this one is still being read
                    plgpu.barrier_wait(free.at[slot])
                plgpu.copy_gmem_to_smem(src.at[keys], dst.at[slot], ready.at[slot])

        for i in range(stages):
            pl.when(i < steps)(functools.partial(load, i, i, False))

        def refill(j, _):
            load(j + stages, lax.rem(j, stages), True)

        lax.fori_loop(0, jnp.maximum(steps - stages, 0), refill, None)


def _lower(lengths_B, q_BxRxKxD, k_BxSxKxD, v_BxSxKxD, *, cfg: MosaicConfig, scale: float, valid_rows: int,
           interpret: bool, profile_dir: str | None):
    B, R, K, D = q_BxRxKxD.shape
    S = k_BxSxKxD.shape[1]
    dtype = q_BxRxKxD.dtype
    C = cfg.compute_wgs
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        scratch = (plgpu.SMEM((C, ROWS_PER_WG, D), dtype, transforms=tiles),
                   plgpu.SMEM((cfg.stages, cfg.block_kv, D), dtype, transforms=tiles),
                   plgpu.SMEM((cfg.stages, cfg.block_kv, D), dtype, transforms=tiles),
                   plgpu.SMEM((C, ROWS_PER_WG), jnp.float32))
        ready = (plgpu.Barrier(num_barriers=C), plgpu.Barrier(num_barriers=cfg.stages),
                 plgpu.Barrier(num_barriers=cfg.stages))
        free = (plgpu.Barrier(num_arrivals=C, num_barriers=cfg.stages),) * 2
        body = functools.partial(_kernel, cfg=cfg, kv_heads=K, capacity=S, head_dim=D, valid_rows=valid_rows,
                                 row_blocks=R // cfg.rows_per_block(), scale2=scale * LOG2E, interpret=interpret)
        pl.run_scoped(lambda *s: body(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, s), scratch, ready, free,
                      plgpu.Barrier(num_arrivals=C), collective_axes="wg")

    if interpret:
        from pallas.mosaic_interpret import interpret_params
        options = dict(interpret=interpret_params())
    else:
        # the on-device profiler keeps each warpgroup's stamps in shared memory: room for the named scopes of the
        # longest chunk (three a key block, four around the loop, and slack)
        ranges = 3 * (ceil_div(ceil_div(S, cfg.light_splits or cfg.num_splits), cfg.block_kv) + 1) + 8
        profile = dict(profile_space=ranges, profile_dir=profile_dir) if profile_dir else {}
        options = dict(compiler_params=plgpu.CompilerParams(approx_math=True, **profile))
    out_type = (jax.ShapeDtypeStruct((cfg.num_splits, B, R, K, D), dtype),
                jax.ShapeDtypeStruct((cfg.num_splits, B, K, R), jnp.float32))
    return plgpu.kernel(entry, out_type=out_type, grid=(R // cfg.rows_per_block(), cfg.num_splits, K * B),
                        grid_names=("rows", "split", "head_batch"), num_threads=C + 1, thread_name="wg",
                        **options)(lengths_B, q_BxRxKxD, k_BxSxKxD, v_BxSxKxD)


@functools.partial(jax.jit, static_argnames=("cfg", "scale", "valid_rows", "interpret", "profile_dir"))
def mosaic_cache_partials(q_BxRxKxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, cfg: MosaicConfig,
                          scale: float, valid_rows: int | None = None, interpret: bool = False,
                          profile_dir: str | None = None):
    """Per-split attention of the folded rows over the valid cache prefix (module docstring).

    q_BxRxKxD: folded queries (``fold_group``), R a multiple of ``cfg.rows_per_block()``. Returns
    ``(o [splits, B, R, K, D] in q.dtype, lse [splits, B, K, R] float32)``, each split normalised on its own.
    valid_rows: the rows that are not padding (default R); a warpgroup whose 64 rows all lie past them computes
    nothing, and its rows of the output are left unwritten. ``interpret=True`` runs the kernel in jax's Mosaic GPU
    interpreter (any device; slow, for tests; always with ``accumulate="fresh"``). profile_dir: run Mosaic GPU's
    on-device profiler, which writes a Chrome trace of each call's named scopes per warpgroup there (compiled
    kernel only; :mod:`tools.mosaic_phases` reads it).
    """
    B, R, K, D = q_BxRxKxD.shape
    if k_cache_BxSxKxD.shape[0] != B or k_cache_BxSxKxD.shape[2:] != (K, D) or (
            v_cache_BxSxKxD.shape != k_cache_BxSxKxD.shape):
        raise ValueError(f"mosaic cache attention: q {q_BxRxKxD.shape}, k {k_cache_BxSxKxD.shape}, "
                         f"v {v_cache_BxSxKxD.shape} do not match ([B, R, K, D] and [B, S, K, D])")
    check_mosaic_operands("mosaic cache attention", q_BxRxKxD.dtype, k_cache_BxSxKxD.dtype, D)
    if R % cfg.rows_per_block():
        raise ValueError(f"mosaic cache attention: {R} rows are not a multiple of the {cfg.rows_per_block()} "
                         "rows of a thread block (fold_group pads them)")
    cfg.check(k_cache_BxSxKxD.shape[1], D, jnp.dtype(q_BxRxKxD.dtype).itemsize)
    valid_rows = R if valid_rows is None else valid_rows
    if not 0 < valid_rows <= R:
        raise ValueError(f"mosaic cache attention: valid_rows={valid_rows} must be in [1, {R}]")
    if interpret and profile_dir:
        raise ValueError("mosaic cache attention: profile_dir needs the compiled kernel, not the interpreter")
    if interpret:  # jax's Mosaic GPU interpreter has no pl.run_state
        cfg = dataclasses.replace(cfg, accumulate="fresh")
    return _lower(lengths_B.astype(jnp.int32), q_BxRxKxD, k_cache_BxSxKxD, v_cache_BxSxKxD, cfg=cfg,
                  scale=float(scale), valid_rows=valid_rows, interpret=interpret, profile_dir=profile_dir)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def mosaic_cache_attention(q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, *, scale=None,
                           config: MosaicConfig | None = None, extra=None, interpret: bool = False):
    """Every query attends to cache slots ``[0, lengths[b])`` (the contract of
    :func:`pallas.reference.cache_attention_reference`). Returns ``(o_BxMxHxD in q.dtype, lse_BxMxH float32)``.

    config: launch shape (default :func:`default_mosaic_config`, at most two compute warpgroups in the
    interpreter). extra: ``(o_BxMxHxD, lse_BxMxH)`` of another,
    disjoint key set (the tree half), merged with the splits in the same float32 merge.
    """
    check_cache_operands("mosaic_cache_attention", q_BxMxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B)
    B, M, H, D = q_BxMxHxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    cfg = default_mosaic_config(B, K, M * (H // K), S, D) if config is None else config
    if interpret and config is None and cfg.compute_wgs > 2:  # the interpreter runs a block's warpgroups as
        cfg = dataclasses.replace(cfg, compute_wgs=2)         # concurrent executions: on 2 cores 3 + 1 stall
    q_BxRxKxD = fold_group(q_BxMxHxD, K, row_multiple=cfg.rows_per_block())
    o_PxBxRxKxD, lse_PxBxKxR = mosaic_cache_partials(
        q_BxRxKxD, k_cache_BxSxKxD, v_cache_BxSxKxD, lengths_B, cfg=cfg,
        scale=default_scale(D) if scale is None else float(scale), valid_rows=M * (H // K), interpret=interpret)
    return merge_folded_splits(o_PxBxRxKxD, jnp.swapaxes(lse_PxBxKxR, 2, 3), M, H, extra=extra,
                               dtype=q_BxMxHxD.dtype)
