"""The Mosaic GPU cache half (pallas.mosaic_cache_attention): the kernel itself in jax's Mosaic GPU interpreter on
the CPU (warpgroups, barriers, TMA copies and wgmma simulated; pallas.mosaic_interpret teaches it transposed and
register operands), its lowering for a CUDA GPU, the launch-shape rules, the ``mosaic`` impl, and on the GPU the
compiled kernel against a float32 reference.

Inputs are poisoned with NaN past each sequence's valid length rounded up to 8 (the kernel must never read those
slots; a sequence shorter than one key block may read, and mask, slots up to that block), so any stray read
fails. Lengths that are not multiples of 8 check the masking of the slots read past the end.
"""

from __future__ import annotations

import dataclasses
import zlib
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax import attention
from pallas.folding import fold_group
from pallas.mosaic_cache_attention import (ROWS_PER_WG, MosaicConfig, default_mosaic_config, mosaic_cache_attention,
                                           mosaic_cache_partials, mosaic_runs_here, mosaic_supports)
from pallas.mosaic_config import default_compute_wgs, full_wave_splits, one_wave_splits
from pallas.reference import cache_attention_reference, masked_attention_reference, merge_partials
from pallas.sizes import ceil_div

ON_GPU = jax.default_backend() == "gpu"


def _inputs(B, M, S, H, K, D, lengths, block_kv, dtype=jnp.bfloat16, tag="mosaic"):
    """q, clean K/V (for the reference), the same K/V poisoned with NaN past the valid length rounded up to 8
    (past one key block for sequences shorter than that: the slots the kernel may read and mask), lengths."""
    rng = np.random.default_rng(zlib.crc32(repr((tag, B, M, S, H, K, D, tuple(lengths))).encode()))

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    q, k, v = normal((B, M, H, D)), normal((B, S, K, D)), normal((B, S, K, D))
    lens = jnp.asarray(lengths, jnp.int32)
    readable = jnp.maximum((lens + 7) // 8 * 8, jnp.minimum(block_kv, S))[:, None, None, None]
    poisoned = jnp.arange(S)[None, :, None, None] >= readable
    return q, k, v, jnp.where(poisoned, jnp.nan, k), jnp.where(poisoned, jnp.nan, v), lens


def _f32(x):
    return x.astype(jnp.float32)


def _assert_close(o, lse, ref_o, ref_lse):
    o, ref_o, lse, ref_lse = (np.asarray(x, np.float32) for x in (o, ref_o, lse, ref_lse))
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (o[empty] == 0).all(), "rows with no valid key must be exactly 0"
    err = np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30)
    assert err < 1e-2, f"relative output error {err:.3g}"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-3, atol=2e-3)


def _check_partials(B, M, S, H, K, D, lengths, cfg, interpret):
    """The kernel's raw partials: every split normalised on its own, an empty split exactly (0, -inf), and their
    merge equal to attention over the valid prefix."""
    q, k, v, k_bad, v_bad, lens = _inputs(B, M, S, H, K, D, lengths, cfg.block_kv)
    q_rows = fold_group(q, K, row_multiple=cfg.rows_per_block())
    R = M * (H // K)
    o, lse = mosaic_cache_partials(q_rows, k_bad, v_bad, lens, cfg=cfg, scale=0.3, valid_rows=R,
                                   interpret=interpret)
    assert o.shape == (cfg.num_splits, B, q_rows.shape[1], K, D)
    assert lse.shape == (cfg.num_splits, B, K, q_rows.shape[1])
    o, lse = o[:, :, :R], jnp.swapaxes(lse, 2, 3)[:, :, :R]
    empty = np.isneginf(np.asarray(lse))
    assert (np.asarray(o, np.float32)[empty] == 0).all()
    if cfg.light_splits is not None and R % cfg.rows_per_block():  # the light block's later splits are empty
        light_rows = slice(R // cfg.rows_per_block() * cfg.rows_per_block(), R)
        assert np.isneginf(np.asarray(lse)[cfg.light_splits:, :, light_rows]).all()
    merged_o, merged_lse = merge_partials(o, lse)
    ref_o, ref_lse = cache_attention_reference(_f32(fold_group(q, K)), _f32(k), _f32(v), lens, 0.3)  # head k: row
    _assert_close(merged_o, merged_lse, ref_o, ref_lse)


# Interpreter cases: B, M, S, H, K, D, lengths, config. Lengths cover an empty sequence, one shorter than a key
# block, a last block that is shifted back over its predecessor, a full cache, and splits with no keys.
CASES = {
    "wg1-splits3": (2, 5, 512, 4, 1, 64, [300, 41], MosaicConfig(num_splits=3, block_kv=64, stages=2, compute_wgs=1)),
    "pingpong-stages3-d128": (2, 3, 256, 1, 1, 128, [0, 200],
                              MosaicConfig(num_splits=3, block_kv=64, stages=3, compute_wgs=2)),
    "wg1-splits3-gqa4": (2, 5, 512, 8, 2, 64, [300, 41], MosaicConfig(num_splits=3, block_kv=64, stages=2,
                                                                       compute_wgs=1)),
    "pingpong-stages3-d128-mha4": (2, 3, 256, 4, 4, 128, [0, 200],
                                   MosaicConfig(num_splits=3, block_kv=64, stages=3, compute_wgs=2)),
    "rowblocks3-full": (1, 37, 256, 8, 2, 64, [256], MosaicConfig(num_splits=4, block_kv=128, stages=2,
                                                                   compute_wgs=1)),
    "stages1": (1, 40, 384, 6, 2, 64, [383], MosaicConfig(num_splits=2, block_kv=64, stages=1, compute_wgs=1)),
    # 48 rows in a block of two warpgroups: the second is all padding and only keeps pace (turns, slot refills)
    "pingpong-idle-wg-refills": (1, 12, 1024, 4, 1, 64, [1000], MosaicConfig(num_splits=2, block_kv=64, stages=2,
                                                                              compute_wgs=2)),
    "free-idle-wg-refills": (1, 12, 1024, 4, 1, 64, [1000], MosaicConfig(num_splits=2, block_kv=64, stages=2,
                                                                          compute_wgs=2, pingpong=False)),
    # the last row block (16 of 64 rows / 48 of 128 computing) cut into fewer splits than the others
    "light-splits-wg1": (2, 20, 512, 4, 1, 64, [500, 37], MosaicConfig(num_splits=3, block_kv=64, stages=2,
                                                                          compute_wgs=1, light_splits=1)),
    "light-splits-pingpong": (1, 12, 1024, 4, 1, 64, [1000], MosaicConfig(num_splits=3, block_kv=64, stages=2,
                                                                            compute_wgs=2, light_splits=1)),
}
# Three compute warpgroups run on the GPU only: the interpreter runs a block's warpgroups as concurrent XLA
# executions, and on a 2-core machine a fourth one never starts while the others wait at a barrier.
# The default suite keeps the cheapest case (one warpgroup, three splits); the interpreter takes 10 s to a minute
# for each of the others (ping-pong and idle-warpgroup schedules among them), which run with -m slow.
DEFAULT_SUITE = ("wg1-splits3",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT_SUITE else pytest.mark.slow)
                                  for n in CASES])
def test_kernel_in_the_interpreter_matches_reference(name):
    B, M, S, H, K, D, lengths, cfg = CASES[name]
    _check_partials(B, M, S, H, K, D, lengths, cfg, interpret=True)


def test_hybrid_mosaic_impl_equals_naive_in_the_interpreter():
    """impl="mosaic" off a GPU: the Mosaic cache half in the interpreter, merged with the tree half in one float32
    merge, is hybrid tree attention."""
    B, M, S, H, K, D = 2, 16, 128, 4, 1, 64
    q, k, v, k_bad, v_bad, lens = _inputs(B, M, S, H, K, D, [70, 128], 128, tag="hybrid")
    rng = np.random.default_rng(1)
    k_new, v_new = (jnp.asarray(rng.standard_normal((B, M, K, D), np.float32), jnp.bfloat16) for _ in range(2))
    mask = jnp.asarray(np.tril(np.ones((M, M), bool)) | (rng.random((B, M, M)) < 0.3))
    o, lse = attention.hybrid_tree_attention(q, k_bad, v_bad, lens, k_new, v_new, mask, impl="mosaic")
    ref_o, ref_lse = attention.hybrid_tree_attention(_f32(q), _f32(k), _f32(v), lens, _f32(k_new), _f32(v_new),
                                                     mask, impl="naive")
    assert o.dtype == jnp.bfloat16
    _assert_close(o, lse, ref_o, ref_lse)


def test_interpreter_default_runs_at_most_two_compute_warpgroups(monkeypatch):
    """Three compute warpgroups (the GPU default above 128 rows at head_dim 64) would stall the interpreter."""
    import pallas.mosaic_cache_attention as mca
    seen = []

    def record(*args, cfg, **kw):
        seen.append(cfg)
        raise RuntimeError("recorded")
    monkeypatch.setattr(mca, "mosaic_cache_partials", record)
    q, k, v, _, _, lens = _inputs(1, 37, 256, 16, 4, 64, [200], 128, tag="wgs")  # 148 rows
    assert default_mosaic_config(1, 4, 148, 256, 64).compute_wgs == 3
    with pytest.raises(RuntimeError, match="recorded"):
        mosaic_cache_attention(q, k, v, lens, interpret=True)
    assert seen[0].compute_wgs == 2


def test_mosaic_impl_keeps_few_rows_on_the_pallas_half_and_names_what_it_cannot_run(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "pallas_cache_attention", lambda *a, **kw: calls.append("pallas") or
                        cache_attention_reference(*a[:4], kw.get("scale")))
    q, k, v, _, _, lens = _inputs(1, 1, 128, 8, 2, 64, [100], 64, tag="decode")
    attention.cache_attention(q, k, v, lens, impl="mosaic")  # 4 rows: the Pallas split-K half
    assert calls == ["pallas"]
    with pytest.raises(ValueError, match="impl='mosaic' needs float16/bfloat16"):
        attention.cache_attention(_f32(q), _f32(k), _f32(v), lens, impl="mosaic")


def test_kernel_lowers_for_a_gpu_in_every_variant():
    """Cross-platform lowering (no GPU needed) builds the Mosaic GPU module: layouts, barriers, TMA descriptors
    and wgmma shapes are checked at this step for each accumulation, warpgroup count and head_dim."""
    for cfg, K, D in ((MosaicConfig(num_splits=8, stages=3), 18, 64),
                      (MosaicConfig(num_splits=8, stages=3, accumulate="fresh"), 18, 64),
                      (MosaicConfig(num_splits=16, compute_wgs=1), 8, 128),
                      (MosaicConfig(num_splits=4, block_kv=64, stages=4, compute_wgs=3), 8, 128),
                      (MosaicConfig(num_splits=11, compute_wgs=2, light_splits=6), 8, 128)):
        R = 3 * cfg.rows_per_block()
        q = jax.ShapeDtypeStruct((1, R, K, D), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 8192, K, D), jnp.bfloat16)
        valid = R - 96 if cfg.light_splits else R  # the last row block light: 32 of its 128 rows computing
        fn = jax.jit(lambda q, k, v, n, _c=cfg, _v=valid: mosaic_cache_partials(q, k, v, n, cfg=_c, scale=D ** -0.5,
                                                                                valid_rows=_v))
        text = fn.trace(q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, cfg


def _subjaxprs(eqn):
    for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in _subjaxprs(eqn):
            yield from _primitives(sub)


def _warpgroup_branches(jaxpr):
    """The outermost ``pl.when`` branches of a kernel's jaxpr that issue wgmma or change the register count: the
    code of one kind of warpgroup each."""
    for eqn in jaxpr.eqns:
        subs = list(_subjaxprs(eqn))
        if eqn.primitive.name == "cond":
            for branch in subs:
                names = set(_primitives(branch))
                if names & {"wgmma_ref", "set_max_registers_p"}:
                    yield branch, names
                    continue
                yield from _warpgroup_branches(branch)
        else:
            for sub in subs:
                yield from _warpgroup_branches(sub)


@pytest.mark.parametrize("rows, K, D, wgs", [(288, 18, 64, 3), (288, 8, 128, 2), (64, 18, 64, 1)])
def test_each_warpgroup_sets_its_registers_at_the_head_of_its_branch(rows, K, D, wgs):
    """``set_max_registers`` must dominate the code it budgets: ptxas compiles a branch that begins with it to the
    new count, and code after one in a branch of its own to the launch's 65536 / threads (Llama-3-8B's verify config
    then spilled on the H200). So each compute warpgroup's branch (its wgmma) and the memory
    warpgroup's branch begin with it."""
    cfg = default_mosaic_config(1, K, rows, 16384, D, compute_wgs=wgs)
    q = jax.ShapeDtypeStruct((1, ceil_div(rows, cfg.rows_per_block()) * cfg.rows_per_block(), K, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 16384, K, D), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda q, k, v, n: mosaic_cache_partials(q, k, v, n, cfg=cfg, scale=D ** -0.5))(
        q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32)).jaxpr
    heads = [(branch.eqns[0].primitive.name, branch.eqns[0].params.get("action"), "wgmma_ref" in names)
             for branch, names in _warpgroup_branches(jaxpr)]
    assert ("set_max_registers_p", "increase", True) in heads, heads  # the computing warpgroups
    assert ("set_max_registers_p", "decrease", False) in heads, heads  # the memory warpgroup
    assert all(name == "set_max_registers_p" for name, _, _ in heads), heads


def test_mosaic_runs_on_hopper_gpus_only(monkeypatch):
    assert not mosaic_runs_here()  # this suite's CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for capability, hopper in (("9.0", True), ("8.0", False), ("10.0", False)):
        monkeypatch.setattr(jax, "devices", lambda c=capability: [SimpleNamespace(compute_capability=c)])
        assert mosaic_runs_here() is hopper, capability


def test_full_wave_splits():
    # one thread block per SM: the split count that leaves least of its last wave empty, the fewest of equals
    assert full_wave_splits(36, 18, 132) == 11  # 396 blocks = 3 whole waves (12 splits: 3.27 waves)
    assert full_wave_splits(24, 15, 132) == 11  # 264 blocks = 2 whole waves (10 splits: 1.82 waves)
    assert full_wave_splits(32, 11, 132) == 4  # 128 blocks: one wave; 8 fill two equally, so the fewer
    assert full_wave_splits(144, 5, 132) == 5  # bigger than the SMs: the most waves, the smallest tail
    assert full_wave_splits(18, 25, 264) == 14  # two blocks per SM: 252 of 264 slots
    assert full_wave_splits(5, 0, 132) == 1


def test_one_wave_rule_gives_the_light_row_block_fewer_longer_chunks():
    # every thread block in one wave, the most splits, light chunks at most half again as long
    assert one_wave_splits(18, 18, 132, 11) == (4, 3)  # padded pair: 18 x (4 + 3) = 126 blocks; (4, 4): 144
    assert one_wave_splits(16, 8, 132, 11) == (6, 4)  # Llama-3-8B: 16 x 6 + 8 x 4 = 128; (6, 3) would be 2x long
    assert one_wave_splits(16, 4, 132, 13) == (7, 5)  # Qwen2-7B: 5 row blocks of two warpgroups
    assert one_wave_splits(18, 18, 132, 3) == (3, 3)  # capped by the rule's own count
    assert one_wave_splits(36, 36, 132, 9) is None  # batch 2: not even two splits fit in one wave
    # verification of 72 queries x group 4 (288 rows: the last row block with an idle warpgroup) at the measured
    # shapes; the rule before it gave 11 splits everywhere
    for batch, kv_heads, capacity, head_dim, splits, light in ((1, 18, 16640, 64, 4, 3), (1, 18, 33024, 64, 4, 3),
                                                                (1, 8, 33024, 128, 6, 4)):
        cfg = default_mosaic_config(batch, kv_heads, 288, capacity, head_dim)
        assert (cfg.num_splits, cfg.light_splits) == (splits, light)
        assert default_mosaic_config(batch, kv_heads, 288, capacity, head_dim, one_wave=False).num_splits == 11
    # no idle warpgroup (74 queries of MHA: 74 of 128 rows), too many blocks for a wave (batch 4, prefill chunks),
    # one warpgroup (the draft's cross-attention): the rule before it
    for args in ((1, 32, 74, 16640, 128), (4, 18, 288, 16640, 64), (1, 18, 2048, 16640, 64), (1, 18, 64, 16640, 64)):
        assert default_mosaic_config(*args) == default_mosaic_config(*args, one_wave=False), args


def test_config_rules_and_errors():
    # the H200 sweeps' best split counts: padded 8B heads at 16k and 32k (36 thread blocks of
    # three warpgroups per split), at batch 4 (144), Llama-3-8B (24 of two), Vicuna's MHA (32 of two)
    assert default_mosaic_config(1, 18, 276, 16640, 64, one_wave=False) == MosaicConfig(
        num_splits=11, block_kv=128, stages=3, compute_wgs=3)
    assert default_mosaic_config(1, 18, 128, 16384, 64).compute_wgs == 2  # three would idle one of 192 rows
    assert [default_compute_wgs(r, 64) for r in (64, 128, 148, 276)] == [1, 2, 3, 3]
    assert default_mosaic_config(1, 18, 276, 16640, 64, compute_wgs=2).compute_wgs == 2
    assert default_mosaic_config(1, 8, 296, 16384, 128).compute_wgs == 2  # three: twice as slow at head_dim 128
    assert default_mosaic_config(1, 18, 276, 33024, 64, one_wave=False).num_splits == 11
    assert default_mosaic_config(4, 18, 276, 16640, 64).num_splits == 5
    assert default_mosaic_config(1, 8, 296, 32768, 128, one_wave=False).num_splits == 11
    assert default_mosaic_config(1, 32, 69, 16640, 128).num_splits == 4
    # two warpgroups at head_dim 64 (a 27-node tree): two thread blocks share an SM, so 14 splits fill one wave
    assert default_mosaic_config(1, 18, 108, 16640, 64).blocks_per_sm(64) == 2
    assert default_mosaic_config(1, 18, 108, 16640, 64).num_splits == 14
    assert default_mosaic_config(1, 18, 276, 16640, 64).blocks_per_sm(64) == 1
    assert default_mosaic_config(4, 8, 48, 4096, 128).compute_wgs == 1  # at most one warpgroup's rows
    # the draft's cross-attention (16 queries x 4): the waves' 36 splits of 455 keys at 16k, capped at 640 keys each
    assert default_mosaic_config(1, 18, 64, 16384, 64) == MosaicConfig(num_splits=25, block_kv=128, stages=3,
                                                                        compute_wgs=1)
    assert default_mosaic_config(1, 18, 64, 32768, 64).num_splits == 36
    assert default_mosaic_config(4, 18, 64, 16384, 64).num_splits == 9
    assert default_mosaic_config(1, 2, 296, 2048, 64).num_splits == 3  # short caches: few long chunks
    assert default_mosaic_config(1, 2, 296, 512, 64).num_splits == 1
    assert MosaicConfig(num_splits=1, compute_wgs=3).rows_per_block() == 3 * ROWS_PER_WG
    assert mosaic_supports(jnp.bfloat16, jnp.bfloat16, 128) and not mosaic_supports(jnp.bfloat16, jnp.bfloat16, 96)
    assert not mosaic_supports(jnp.float32, jnp.float32, 64) and not mosaic_supports(jnp.float16, jnp.bfloat16, 64)
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    kv, kv512 = jnp.zeros((1, 256, 2, 64), jnp.bfloat16), jnp.zeros((1, 512, 2, 64), jnp.bfloat16)
    n = jnp.array([10])
    for cfg, cache, msg in ((MosaicConfig(num_splits=1, block_kv=96), kv, "multiple of 64"),
                            (MosaicConfig(num_splits=1, block_kv=512), kv, "capacity 256 must be a multiple"),
                            (MosaicConfig(num_splits=1, accumulate="x"), kv, "accumulate='x'"),
                            (MosaicConfig(num_splits=0), kv, ">= 1"),
                            (MosaicConfig(num_splits=2, light_splits=3), kv, r"light_splits=3 must be in \[1, num"),
                            (MosaicConfig(num_splits=1, compute_wgs=1, stages=8, block_kv=256), kv512,
                             "shared memory")):
        with pytest.raises(ValueError, match=msg):
            mosaic_cache_partials(q, cache, cache, n, cfg=cfg, scale=0.1)
    with pytest.raises(ValueError, match="not a multiple of the 256 rows"):
        mosaic_cache_partials(q, kv, kv, n, cfg=MosaicConfig(num_splits=1, compute_wgs=4), scale=0.1)
    with pytest.raises(ValueError, match="head_dim that is a multiple of 64"):
        mosaic_cache_partials(q[..., :32], kv[..., :32], kv[..., :32], n, cfg=MosaicConfig(num_splits=1), scale=0.1)
    for rows in (0, 129):
        with pytest.raises(ValueError, match=rf"valid_rows={rows} must be in \[1, 128\]"):
            mosaic_cache_partials(q, kv, kv, n, cfg=MosaicConfig(num_splits=1), scale=0.1, valid_rows=rows)


# ------------------------------------------------------------------------------------------------ GPU only

GPU_CASES = {  # the verification pass's shapes at 4k, every variant the benchmark sweeps, ragged lengths
    "padded-default": (2, 74, 4096, 72, 18, 64, [4096, 1234], None),
    "padded-fresh": (1, 74, 4096, 72, 18, 64, [3000], "fresh"),
    "llama-default": (2, 74, 4096, 32, 8, 128, [4096, 100], None),
    "llama-wg1-bk64": (1, 74, 4096, 32, 8, 128, [2049], dict(compute_wgs=1, block_kv=64, stages=4)),
    "llama-wg3": (1, 74, 4096, 32, 8, 128, [4000], dict(compute_wgs=3)),
    "padded-wg2": (1, 74, 4096, 72, 18, 64, [4000], dict(compute_wgs=2)),
    "padded-free": (1, 74, 4096, 72, 18, 64, [4000], dict(compute_wgs=2, pingpong=False)),
    "padded-cross": (2, 16, 4096, 72, 18, 64, [4096, 777], None),  # the draft's cross-attention: one warpgroup
    "padded-27nodes": (1, 27, 4096, 72, 18, 64, [4096], None),  # 108 rows: two warpgroups, two blocks per SM
    "mha-empty": (2, 9, 4096, 32, 32, 128, [0, 63], None),
    "gqa7-prefill": (1, 512, 4096, 28, 4, 128, [3500], None),
    "padded-light": (2, 74, 4096, 72, 18, 64, [4096, 1234], dict(light_splits=3)),  # light row block: explicit counts
    "llama-light": (2, 74, 4096, 32, 8, 128, [4096, 100], dict(light_splits=2)),
    "padded-one-wave": (1, 72, 6144, 72, 18, 64, [6000], None),  # the default: 4 splits, 3 for the light block
}


@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU)")
def test_compiled_kernel_on_gpu_matches_float32_reference(name):
    B, M, S, H, K, D, lengths, change = GPU_CASES[name]
    cfg = default_mosaic_config(B, K, M * (H // K), S, D)
    if change == "fresh":
        cfg = dataclasses.replace(cfg, accumulate="fresh")
    elif change:
        cfg = dataclasses.replace(cfg, **change)
    _check_partials(B, M, S, H, K, D, lengths, cfg, interpret=False)
    q, k, v, k_bad, v_bad, lens = _inputs(B, M, S, H, K, D, lengths, cfg.block_kv)
    extra = masked_attention_reference(q, k[:, :M], v[:, :M], jnp.ones((B, M, M), bool))
    o, lse = mosaic_cache_attention(q, k_bad, v_bad, lens, config=cfg, extra=extra)
    with jax.default_matmul_precision("highest"):
        ref = cache_attention_reference(_f32(q), _f32(k), _f32(v), lens)
        ref_o, ref_lse = attention.merge_attention(ref[0], ref[1], _f32(extra[0]), extra[1])
    _assert_close(o, lse, ref_o, ref_lse)


SPILL_SCRIPT = """
import jax, jax.numpy as jnp
from pallas.mosaic_cache_attention import default_mosaic_config, mosaic_cache_partials
from pallas.sizes import ceil_div
for M, S, H, K, D in ((72, 16384, 72, 18, 64), (72, 32768, 32, 8, 128)):  # verification: padded 8B, Llama-3-8B
    cfg = default_mosaic_config(1, K, M * (H // K), S, D)
    q = jax.ShapeDtypeStruct((1, ceil_div(M * (H // K), cfg.rows_per_block()) * cfg.rows_per_block(), K, D),
                             jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, S, K, D), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((1,), jnp.int32)
    partials = lambda q, k, v, n: mosaic_cache_partials(q, k, v, n, cfg=cfg, scale=D ** -0.5)
    jax.jit(partials).lower(q, kv, kv, n).compile()
    print("compiled", cfg, flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU)")
def test_default_configs_compile_without_register_spills():
    """ptxas's report (MOSAIC_GPU_DUMP_PTXAS) for the verification pass's default configs: no spills. The compute
    warpgroups raise their register count at the head of their branch; raised in a branch of its own, it did not
    reach the code, which ptxas then fit into the launch's 65536 / threads (Llama-3-8B's config spilled 12 bytes
    on the H200)."""
    import os
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SPILL_SCRIPT], env=dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1"),
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and text.count("compiled MosaicConfig") == 2, text[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores", text)
    assert len(spills) >= 2, text[-3000:]  # ptxas reported on both kernels
    assert set(spills) == {"0"}, text[-3000:]
