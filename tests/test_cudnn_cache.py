"""The split-K cache half over a flash kernel (longspec_jax.cudnn_cache) and the attention impl choice.

On the CPU the per-chunk kernel is the pure-jnp stand-in, so everything around the kernel (folding the GQA group
into the queries, cutting the cache into chunks with their own lengths, dropping empty chunks, the float32
merge, unfolding) is checked here; the cuDNN kernel itself is checked by the GPU test at the end.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax import attention
from longspec_jax.cudnn_cache import (MIN_CHUNK, cudnn_chunk_attention, cudnn_supports, default_num_splits,
                                      cudnn_cache_attention, reference_chunk_attention)
from pallas import cache_attention_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
LSE_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-3}


def _inputs(B, M, S, H, K, D, dtype, lengths, seed_tag="flash"):
    rng = np.random.default_rng(zlib.crc32(repr((seed_tag, B, M, S, H, K, D, jnp.dtype(dtype).name,
                                                 tuple(lengths))).encode()))

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    return normal((B, M, H, D)), normal((B, S, K, D)), normal((B, S, K, D)), jnp.asarray(lengths, jnp.int32)


def _assert_close(o, lse, ref_o, ref_lse, dtype):
    o, ref_o = np.asarray(o, np.float32), np.asarray(ref_o, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert lse.dtype == np.float32 and not np.isnan(o).any() and not np.isnan(lse).any()
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (o[empty] == 0).all(), "rows with no valid key must be exactly 0"
    err = np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30)
    assert err < TOL[dtype], f"relative output error {err:.3g}"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])


CASES = [
    # B, M, S, H, K, D, dtype, lengths, num_splits
    (3, 1, 256, 4, 4, 128, jnp.float32, [0, 256, 77], 4),      # decode, MHA (GQA 1), empty + full rows
    (2, 74, 256, 8, 2, 128, jnp.float32, [256, 131], 8),       # tree queries, GQA 4
    (2, 9, 512, 8, 1, 64, jnp.bfloat16, [500, 512], 16),       # GQA 8, bf16
    (2, 5, 192, 8, 8, 64, jnp.bfloat16, [1, 190], 3),          # GQA 1, bf16, non-power-of-two splits
    (1, 3, 128, 8, 2, 64, jnp.float32, [40], 32),              # most chunks empty (length 0 chunks dropped)
    (2, 6, 128, 14, 2, 64, jnp.float32, [128, 0], 1),          # GQA 7, one chunk, a whole empty sequence
    (2, 4, 1024, 8, 2, 128, jnp.bfloat16, [1024, 700], None),  # default split count
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}M{c[1]}S{c[2]}H{c[3]}K{c[4]}D{c[5]}-"
                         f"{jnp.dtype(c[6]).name}-splits{c[8]}")
def test_cudnn_cache_matches_reference(case):
    B, M, S, H, K, D, dtype, lengths, splits = case
    q, k, v, lens = _inputs(*case[:8])
    o, lse = cudnn_cache_attention(q, k, v, lens, num_splits=splits, chunk_attention=reference_chunk_attention)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (B, M, H)
    ref_o, ref_lse = cache_attention_reference(q, k, v, lens)
    _assert_close(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_extra_partial_merged_with_the_chunks_is_hybrid_attention(dtype):
    """The tree half passed as ``extra`` goes into the chunks' one float32 merge: cache half + tree half."""
    B, M, S, H, K, D = 2, 6, 256, 8, 2, 64
    q, k, v, lens = _inputs(B, M, S, H, K, D, dtype, [200, 0])
    k_new, v_new = k[:, -M:], v[:, -M:]
    mask = jnp.asarray(np.tril(np.ones((M, M), bool)))[None].repeat(B, 0)
    tree = attention.masked_attention_reference(q, k_new, v_new, mask)
    o, lse = cudnn_cache_attention(q, k, v, lens, num_splits=4, chunk_attention=reference_chunk_attention,
                                   extra=tree)
    assert o.dtype == q.dtype and lse.shape == (B, M, H)
    ref_o, ref_lse = attention.naive_tree_attention(q, k, v, lens, k_new, v_new, mask)
    _assert_close(o, lse, ref_o, ref_lse, dtype)


def test_cudnn_cache_never_reads_beyond_length():
    """NaN in every slot at or beyond the valid length (a chunk past it included) must not reach the output."""
    B, M, S, H, K, D = 3, 4, 256, 8, 2, 64
    q, k, v, lens = _inputs(B, M, S, H, K, D, jnp.float32, [0, 100, 255])
    clean = jnp.arange(S)[None, :, None, None] < lens[:, None, None, None]
    o, lse = cudnn_cache_attention(q, jnp.where(clean, k, jnp.nan), jnp.where(clean, v, jnp.nan), lens,
                                   num_splits=8, chunk_attention=_nan_safe_reference)
    ref_o, ref_lse = cache_attention_reference(q, jnp.where(clean, k, 0), jnp.where(clean, v, 0), lens)
    _assert_close(o, lse, ref_o, ref_lse, jnp.float32)


def _nan_safe_reference(q, k, v, lengths, scale):
    """The jnp stand-in reading only the valid keys, as a flash kernel does (a dense einsum would multiply NaN
    slots by zero weights and give NaN)."""
    valid = jnp.arange(k.shape[1])[None, :, None, None] < lengths[:, None, None, None]
    return reference_chunk_attention(q, jnp.where(valid, k, 0), jnp.where(valid, v, 0), lengths, scale)


def test_cudnn_cache_scale_and_explicit_kernel_contract():
    q, k, v, lens = _inputs(2, 3, 256, 4, 2, 32, jnp.float32, [256, 9])
    o, lse = cudnn_cache_attention(q, k, v, lens, scale=0.3, num_splits=2, chunk_attention=reference_chunk_attention)
    ref_o, ref_lse = cache_attention_reference(q, k, v, lens, 0.3)
    _assert_close(o, lse, ref_o, ref_lse, jnp.float32)


def test_cudnn_cache_rejects_bad_shapes():
    q, k, v, lens = _inputs(2, 3, 256, 4, 2, 32, jnp.float32, [256, 9])
    with pytest.raises(ValueError, match="must be >= 1 and divide the capacity 256"):
        cudnn_cache_attention(q, k, v, lens, num_splits=3, chunk_attention=reference_chunk_attention)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        cudnn_cache_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), lens,
                              chunk_attention=reference_chunk_attention)
    with pytest.raises(ValueError, match="lengths shape"):
        cudnn_cache_attention(q, k, v, lens[:1], chunk_attention=reference_chunk_attention)


@pytest.mark.parametrize("batch,kv_heads,rows,capacity,expected", [
    (1, 8, 296, 32768, 16),   # Llama-3-8B heads, 74 queries: 384 blocks = 2.9 waves (4: too few, 8: 1.45 waves)
    (1, 8, 4, 32768, 16),     # Llama-3-8B decode: 128 blocks
    (1, 32, 74, 32768, 4),    # Vicuna-7B, 74 queries: 128 blocks
    (1, 32, 1, 65536, 4),     # Vicuna-7B decode
    (4, 8, 296, 32768, 4),    # batch 4
    (1, 8, 296, 40960, 5),    # capacity 80 x 512: 5 chunks give 120 blocks, one full wave
    (1, 8, 4, 1000, 1),       # too short to split into chunks of MIN_CHUNK keys
    (1, 1, 1, 2048, 4),       # never fills the GPU: the most chunks allowed
])
def test_default_num_splits(batch, kv_heads, rows, capacity, expected):
    n = default_num_splits(batch, kv_heads, rows, capacity)
    assert n == expected
    assert capacity % n == 0 and (n == 1 or capacity // n >= MIN_CHUNK)


def test_cudnn_supports():
    assert cudnn_supports(jnp.bfloat16, jnp.bfloat16, 128)
    assert cudnn_supports(jnp.float16, jnp.float16, 64)
    assert not cudnn_supports(jnp.float32, jnp.float32, 128)
    assert not cudnn_supports(jnp.bfloat16, jnp.float32, 128)
    assert not cudnn_supports(jnp.bfloat16, jnp.bfloat16, 60)


def test_gpu_impl_picks_cache_half_by_rows_dtype_and_gpu(monkeypatch):
    rows = attention.TENSOR_CORE_MIN_ROWS
    pick = functools.partial(attention.gpu_cache_half, num_heads=32, kv_heads=8, head_dim=128)
    bf16 = dict(q_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "cpu")
    assert pick(rows, **bf16) == "pallas"  # CPU: no cuDNN, no Mosaic GPU
    assert attention.resolve_impl("auto") == "xla"
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    for hopper, big in ((True, "mosaic"), (False, "cudnn")):
        monkeypatch.setattr(attention, "mosaic_runs_here", lambda: hopper)
        assert pick(rows // 4, **bf16) == big
        assert pick(rows // 4 - 1, **bf16) == "pallas"
        assert pick(1, **bf16) == "pallas"  # decode
        assert pick(512, q_dtype=jnp.float32, cache_dtype=jnp.float32) == "pallas"  # neither takes float32
    monkeypatch.setattr(attention, "mosaic_runs_here", lambda: True)
    assert pick(64, q_dtype=jnp.float16, cache_dtype=jnp.float16, head_dim=96) == "cudnn"  # Mosaic: D % 64 only
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        attention.resolve_impl("flash")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_impl_off_a_gpu_runs_the_pallas_halves(dtype):
    """impl="gpu" sends nothing to cuDNN off a GPU (nor float32 anywhere): here both Pallas kernels run in
    interpret mode, also for bf16 with 80 query rows."""
    B, M, S, H, K, D = 2, 20, 128, 8, 2, 64
    q, k, v, lens = _inputs(B, M, S, H, K, D, dtype, [128, 50])
    k_new, v_new = k[:, :M], v[:, :M]
    mask = jnp.asarray(np.tril(np.ones((M, M), bool)))[None].repeat(B, 0)
    o, lse = attention.hybrid_tree_attention(q, k, v, lens, k_new, v_new, mask, impl="gpu")
    ref_o, ref_lse = attention.hybrid_tree_attention(q, k, v, lens, k_new, v_new, mask, impl="naive")
    _assert_close(o, lse, ref_o, ref_lse, dtype)


def test_cudnn_impl_rejects_what_cudnn_cannot_run_by_name(monkeypatch):
    q, k, v, lens = _inputs(1, 2, 128, 4, 2, 64, jnp.float32, [128])
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "cpu")
    with pytest.raises(ValueError, match="impl='cudnn' needs a CUDA GPU"):
        attention.cache_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), lens,
                                  impl="cudnn")
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="impl='cudnn' needs float16/bfloat16"):
        attention.cache_attention(q, k, v, lens, impl="cudnn")


# ------------------------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (cuDNN)")
@pytest.mark.parametrize("M,heads,splits,lengths", [
    (1, (32, 8), None, [4096, 1234]), (74, (32, 8), None, [4096, 1234]), (74, (32, 32), 4, [4096, 1]),
    (512, (32, 8), 2, [4096, 3000]), (9, (28, 4), 8, [0, 1234])])
def test_cudnn_cache_half_on_gpu(M, heads, splits, lengths):
    H, K = heads
    B, S, D, dtype = 2, 4096, 128, jnp.bfloat16
    q, k, v, lens = _inputs(B, M, S, H, K, D, dtype, lengths, seed_tag="gpu")
    o, lse = cudnn_cache_attention(q, k, v, lens, num_splits=splits, chunk_attention=cudnn_chunk_attention)
    with jax.default_matmul_precision("highest"):
        ref_o, ref_lse = cache_attention_reference(q, k, v, lens)
    _assert_close(o, lse, ref_o, ref_lse, dtype)
    if M > 1:  # the whole hybrid: cuDNN cache half + Pallas tree half, merged
        mask = jnp.asarray(np.tril(np.ones((M, M), bool)))[None].repeat(B, 0)
        args = (q, k, v, jnp.maximum(lens - M, 0), k[:, :M], v[:, :M], mask)
        o, lse = attention.hybrid_tree_attention(*args, impl="cudnn")
        with jax.default_matmul_precision("highest"):
            ref_o, ref_lse = attention.hybrid_tree_attention(*args, impl="naive")
        _assert_close(o, lse, ref_o, ref_lse, dtype)
