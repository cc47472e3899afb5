"""Pallas attention kernels (interpret mode on CPU) against the pure-jnp references.

Inputs are drawn fresh per test case (seeded from the case id). Interpret mode starts every output buffer as
NaN and pads every out-of-range block read with NaN, so an element a kernel forgets to write, or a read past
the arrays that is not masked, shows up as NaN: every check below also asserts the outputs are NaN-free and
that the LSE is exactly -inf only where the reference's is.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas import (cache_attention, cache_attention_partials, cache_attention_reference,
                    masked_attention_reference, resolve_backend, tree_attention)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
LSE_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-3}


def _rng(*case):
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """``[N, N]`` bool: node i sees j iff j is i or one of its ancestors (``parents[0] = -1``)."""
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def verification_mask(rng, num_accepted: int, num_nodes: int, num_pad: int) -> np.ndarray:
    """The PyTorch LongSpec target-side layout: accepted tokens (causal), then tree nodes (each sees
    all accepted tokens plus its ancestors and itself, random parents), then padding rows that see nothing."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, num_nodes)])
    total = num_accepted + num_nodes + num_pad
    mask = np.zeros((total, total), bool)
    mask[:num_accepted, :num_accepted] = np.tril(np.ones((num_accepted, num_accepted), bool))
    a, t = num_accepted, num_accepted + num_nodes
    mask[a:t, :a] = True
    mask[a:t, a:t] = ancestor_mask(parents)
    return mask


def _assert_close(o, lse, ref_o, ref_lse, dtype):
    o = np.asarray(o, np.float32)
    lse = np.asarray(lse)
    ref_o = np.asarray(ref_o, np.float32)
    ref_lse = np.asarray(ref_lse)
    assert lse.dtype == np.float32
    assert not np.isnan(o).any(), "NaN in the output (unwritten element or unmasked out-of-range read)"
    assert not np.isnan(lse).any(), "NaN in the LSE"
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.isfinite(lse[~empty]).all()
    assert (o[empty] == 0).all(), "rows with no allowed key must be exactly 0"
    err = np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30)
    assert err < TOL[dtype], f"relative output error {err:.3g}"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])


def test_auto_backend_on_cpu_is_interpret():
    if jax.default_backend() == "cpu":
        assert resolve_backend(None) == "interpret"
    assert resolve_backend("interpret") == "interpret"
    with pytest.raises(ValueError):
        resolve_backend("cuda")


def test_interpret_mode_poisons_unwritten_outputs():
    """The no-NaN checks rely on interpret mode starting outputs as NaN: check that it still does."""
    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 8)] = x_ref[pl.ds(0, 8)]  # writes only half

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(
        jnp.ones((16,), jnp.float32))
    out = np.asarray(out)
    assert (out[:8] == 1).all() and np.isnan(out[8:]).all()


# ------------------------------------------------------------------------------------------------- tree half

TREE_CASES = [
    # B, M, N, H, K, D, dtype, mask kind
    (2, 74, 74, 8, 2, 128, jnp.float32, "verify"),    # target verification: 5 accepted + 64 nodes + 5 pad
    (2, 74, 74, 8, 8, 128, jnp.bfloat16, "verify"),   # MHA (Vicuna-like), bf16
    (1, 16, 69, 8, 1, 64, jnp.bfloat16, "draft"),     # draft level: last 16 of 69 tree keys, GQA 8
    (2, 20, 150, 4, 4, 64, jnp.float32, "random"),    # arbitrary mask, 2 key blocks, empty rows
    (1, 5, 7, 4, 1, 48, jnp.float32, "random"),       # head_dim not a power of two, GQA 4
    (2, 1, 1, 4, 2, 64, jnp.float32, "verify"),       # single token
]


def _tree_inputs(case):
    B, M, N, H, K, D, dtype, kind = case
    rng = _rng("tree", *case[:6], jnp.dtype(dtype).name, kind)
    q, k, v = (_normal(rng, (B, M, H, D), dtype), _normal(rng, (B, N, K, D), dtype),
               _normal(rng, (B, N, K, D), dtype))
    masks = []
    for _ in range(B):
        if kind == "verify":
            pad = min(5, M - 1)
            acc = 5 if M > 10 else 1
            masks.append(verification_mask(rng, acc, M - acc - pad, pad))
        elif kind == "draft":
            masks.append(verification_mask(rng, 1, N - 1, 0)[N - M:])
        else:
            m = rng.random((M, N)) < 0.3
            m[rng.integers(0, M, 2)] = False  # some rows see nothing
            masks.append(m)
    return q, k, v, jnp.asarray(np.stack(masks))


@pytest.mark.parametrize("case", TREE_CASES, ids=lambda c: f"B{c[0]}M{c[1]}N{c[2]}H{c[3]}K{c[4]}D{c[5]}"
                         f"-{jnp.dtype(c[6]).name}-{c[7]}")
def test_tree_attention_matches_reference(case):
    q, k, v, mask = _tree_inputs(case)
    o, lse = tree_attention(q, k, v, mask)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3]
    ref_o, ref_lse = masked_attention_reference(q, k, v, mask)
    _assert_close(o, lse, ref_o, ref_lse, case[6])
    if case[7] == "verify" and case[1] > 1:
        assert np.isneginf(np.asarray(lse)[:, -1]).all()  # the padding rows


def test_tree_attention_small_tiles_and_scale():
    """Several row blocks and key blocks (explicit 16-wide tiles) and a non-default scale."""
    case = (2, 40, 50, 4, 2, 64, jnp.float32, "random")
    q, k, v, mask = _tree_inputs(case)
    o, lse = tree_attention(q, k, v, mask, scale=0.3, block_m=16, block_n=16)
    ref_o, ref_lse = masked_attention_reference(q, k, v, mask, scale=0.3)
    _assert_close(o, lse, ref_o, ref_lse, jnp.float32)


# ------------------------------------------------------------------------------------------------ cache half

CACHE_CASES = [
    # B, M, S, H, K, D, dtype, lengths, kwargs
    (3, 1, 256, 4, 4, 128, jnp.float32, [0, 256, 77], dict(num_splits=4)),           # plain decode, MHA
    (2, 1, 512, 8, 2, 64, jnp.bfloat16, [512, 300], {}),                              # decode, GQA 4, auto config
    (2, 74, 256, 8, 2, 128, jnp.float32, [256, 131], dict(num_splits=3, block_r=64)),  # tree: 5 row blocks
    (2, 74, 192, 8, 8, 128, jnp.bfloat16, [1, 190], dict(num_splits=2)),              # tree, MHA
    (2, 9, 512, 8, 1, 64, jnp.bfloat16, [500, 512], dict(num_splits=8, block_k=32)),   # GQA 8
    (2, 3, 300, 4, 2, 80, jnp.float32, [300, 299], dict(num_splits=2, block_k=64)),    # odd S and head_dim
    (1, 2, 256, 4, 1, 64, jnp.float32, [40], dict(num_splits=16, block_k=16)),         # mostly-empty splits
    (1, 64, 128, 8, 2, 64, jnp.bfloat16, [128], dict(block_r=64, num_splits=2)),       # chunked prefill
    (2, 5, 128, 14, 2, 64, jnp.float32, [128, 60], dict(num_splits=3, block_r=16)),     # GQA 7 (Qwen2-7B-like)
    (2, 6, 192, 8, 2, 64, jnp.float32, [192, 33], dict(num_splits=5, combine="xla")),   # jnp merge of the splits
]


def _cache_inputs(case, poison_tail=False):
    B, M, S, H, K, D, dtype, lengths, _ = case
    rng = _rng("cache", *case[:6], jnp.dtype(dtype).name, tuple(lengths))
    q = _normal(rng, (B, M, H, D), dtype)
    k, v = _normal(rng, (B, S, K, D), dtype), _normal(rng, (B, S, K, D), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    if poison_tail:  # slots at or beyond the valid length hold NaN: they must never be read
        tail = (jnp.arange(S)[None, :] >= lengths[:, None])[:, :, None, None]
        k, v = jnp.where(tail, jnp.nan, k).astype(dtype), jnp.where(tail, jnp.nan, v).astype(dtype)
    return q, k, v, lengths


@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: f"B{c[0]}M{c[1]}S{c[2]}H{c[3]}K{c[4]}D{c[5]}"
                         f"-{jnp.dtype(c[6]).name}-{'-'.join(f'{k}{v}' for k, v in c[8].items())}")
def test_cache_attention_matches_reference(case):
    q, k, v, lengths = _cache_inputs(case)
    o, lse = cache_attention(q, k, v, lengths, **case[8])
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3]
    ref_o, ref_lse = cache_attention_reference(q, k, v, lengths)
    _assert_close(o, lse, ref_o, ref_lse, case[6])


def test_cache_attention_never_reads_beyond_length():
    """NaN in every cache slot at or beyond the valid length must not reach the output."""
    case = (3, 4, 256, 8, 2, 64, jnp.float32, [0, 100, 255], dict(num_splits=3, block_k=32))
    q, k, v, lengths = _cache_inputs(case, poison_tail=True)
    o, lse = cache_attention(q, k, v, lengths, **case[8])
    clean = jnp.arange(256)[None, :, None, None] < lengths[:, None, None, None]
    ref_o, ref_lse = cache_attention_reference(q, jnp.where(clean, k, 0), jnp.where(clean, v, 0), lengths)
    _assert_close(o, lse, ref_o, ref_lse, jnp.float32)


def test_cache_attention_partials_fully_written():
    """Every real row of the raw per-split buffers (empty splits included) is written, in the final order."""
    case = (2, 3, 128, 8, 2, 64, jnp.float32, [0, 70], dict(num_splits=4, block_k=16))
    q, k, v, lengths = _cache_inputs(case)
    o_part, lse_part = cache_attention_partials(q, k, v, lengths, **case[8])
    B, M, H, D = q.shape
    assert o_part.shape[:2] == (4, B) and o_part.shape[3] == D and lse_part.shape == o_part.shape[:3]
    o_real, lse_real = np.asarray(o_part)[:, :, :M * H], np.asarray(lse_part)[:, :, :M * H]
    assert not np.isnan(o_real).any() and not np.isnan(lse_real).any()
    assert np.isneginf(lse_real[:, 0]).all() and (o_real[:, 0] == 0).all()  # length 0: every split empty
    assert np.isfinite(lse_real[:, 1]).any(axis=0).all()  # length 70: some split of every row saw keys


def test_cache_attention_mixed_cache_dtype():
    """A float32 cache with bf16 queries is cast tile by tile inside the kernel."""
    case = (1, 2, 128, 4, 2, 64, jnp.float32, [100], dict(num_splits=2))
    q, k, v, lengths = _cache_inputs(case)
    q = q.astype(jnp.bfloat16)
    o, lse = cache_attention(q, k, v, lengths, num_splits=2)
    ref_o, ref_lse = cache_attention_reference(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), lengths)
    _assert_close(o, lse, ref_o, ref_lse, jnp.bfloat16)


# ------------------------------------------------------------------------------------------------ hybrid

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hybrid_pallas_matches_naive(dtype):
    from longspec_jax.attention import hybrid_tree_attention
    B, M, S, H, K, D = 2, 24, 256, 8, 2, 64
    rng = _rng("hybrid", jnp.dtype(dtype).name)
    q = _normal(rng, (B, M, H, D), dtype)
    k_cache, v_cache = _normal(rng, (B, S, K, D), dtype), _normal(rng, (B, S, K, D), dtype)
    k_new, v_new = _normal(rng, (B, M, K, D), dtype), _normal(rng, (B, M, K, D), dtype)
    mask = jnp.asarray(np.stack([verification_mask(rng, 3, M - 5, 2) for _ in range(B)]))
    lengths = jnp.asarray([0, 200], jnp.int32)
    args = (q, k_cache, v_cache, lengths, k_new, v_new, mask)
    o, lse = hybrid_tree_attention(*args, impl="pallas")
    ref_o, ref_lse = hybrid_tree_attention(*args, impl="naive")
    _assert_close(o, lse, ref_o, ref_lse, dtype)


# ------------------------------------------------------------------------------- Triton lowering (no GPU needed)

def _triton_lowering_text(fn, *avals) -> str:
    try:
        lowered = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
    except Exception as e:  # pragma: no cover - depends on the jaxlib build
        if "triton" in str(e).lower() and "not" in str(e).lower() and "available" in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower Triton: {e}")
        raise
    return lowered.as_text()


LOWER_CASES = [
    # B, M, H, K, D, S, dtype
    (1, 74, 32, 8, 128, 4096, jnp.bfloat16),   # Llama-3-8B verification
    (4, 74, 32, 32, 128, 4096, jnp.bfloat16),  # Vicuna-7B verification
    (1, 1, 32, 8, 128, 8192, jnp.bfloat16),    # decode
    (1, 512, 32, 8, 128, 8192, jnp.bfloat16),  # chunked prefill
    (2, 16, 28, 4, 64, 1024, jnp.float32),     # GQA 7, head_dim 64, float32
    (1, 8, 8, 2, 80, 1024, jnp.bfloat16),      # head_dim 80
]


@pytest.mark.parametrize("case", LOWER_CASES, ids=lambda c: f"B{c[0]}M{c[1]}H{c[2]}K{c[3]}D{c[4]}-"
                         f"{jnp.dtype(c[6]).name}")
def test_kernels_lower_to_triton_ir(case):
    """The Pallas -> Triton IR lowering (what runs on the GPU) succeeds at production shapes on this CPU."""
    B, M, H, K, D, S, dtype = case
    sds = jax.ShapeDtypeStruct
    q, cache = sds((B, M, H, D), dtype), sds((B, S, K, D), dtype)
    new, mask, lengths = sds((B, M, K, D), dtype), sds((B, M, M), jnp.bool_), sds((B,), jnp.int32)
    text = _triton_lowering_text(lambda *a: cache_attention(*a, backend="triton"), q, cache, cache, lengths)
    assert "xla.gpu.triton" in text and 'name = "cache_attention"' in text
    assert 'name = "cache_attention_combine"' in text
    text = _triton_lowering_text(lambda *a: tree_attention(*a, backend="triton"), q, new, new, mask)
    assert "xla.gpu.triton" in text and 'name = "tree_attention"' in text


# ------------------------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32)])
@pytest.mark.parametrize("M", [1, 74])
def test_kernels_on_gpu(M, heads, dtype):
    H, K = heads
    B, S, D = 2, 4096, 128
    rng = _rng("gpu", M, H, K, jnp.dtype(dtype).name)
    q = _normal(rng, (B, M, H, D), dtype)
    k, v = _normal(rng, (B, S, K, D), dtype), _normal(rng, (B, S, K, D), dtype)
    lengths = jnp.asarray([S, 1234], jnp.int32)
    o, lse = cache_attention(q, k, v, lengths, backend="triton")
    ref_o, ref_lse = cache_attention_reference(q, k, v, lengths)
    _assert_close(o, lse, ref_o, ref_lse, dtype)
    if M > 1:
        mask = jnp.asarray(np.stack([verification_mask(rng, 5, M - 10, 5) for _ in range(B)]))
        k_new, v_new = k[:, :M], v[:, :M]
        o, lse = tree_attention(q, k_new, v_new, mask, backend="triton")
        ref_o, ref_lse = masked_attention_reference(q, k_new, v_new, mask)
        _assert_close(o, lse, ref_o, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [
    # kind, B, M, S (keys), H, K, D; bf16
    ("tree", 1, 16, 69, 32, 8, 128),       # a draft level: 16 queries over 69 tree keys
    ("tree", 2, 74, 74, 28, 4, 64),        # GQA 7, head_dim 64
    ("cache", 1, 512, 8192, 32, 8, 128),   # chunked prefill
    ("cache", 2, 74, 4000, 28, 4, 64),     # capacity not a multiple of the key tile, GQA 7, head_dim 64
    ("hybrid", 2, 74, 16384, 32, 8, 128),  # both Pallas halves, merged, against one naive softmax
], ids=lambda c: "-".join(map(str, c)))
def test_kernels_on_gpu_more_shapes(case):
    """The shapes the attention benchmark used to check on the GPU beyond ``test_kernels_on_gpu``."""
    kind, B, M, S, H, K, D = case
    dtype = jnp.bfloat16
    rng = _rng("gpu-more", *case)
    q = _normal(rng, (B, M, H, D), dtype)
    k, v = _normal(rng, (B, S, K, D), dtype), _normal(rng, (B, S, K, D), dtype)
    if kind == "tree":
        masks = [verification_mask(rng, 1, S - 1, 0)[S - M:] if S != M else verification_mask(rng, 5, M - 10, 5)
                 for _ in range(B)]
        mask = jnp.asarray(np.stack(masks))
        o, lse = tree_attention(q, k, v, mask, backend="triton")
        ref_o, ref_lse = masked_attention_reference(q, k, v, mask)
    elif kind == "cache":
        lengths = jnp.asarray([S] + [S // 3 - 7] * (B - 1), jnp.int32)
        o, lse = cache_attention(q, k, v, lengths, backend="triton")
        ref_o, ref_lse = cache_attention_reference(q, k, v, lengths)
    else:
        from longspec_jax.attention import hybrid_tree_attention
        mask = jnp.asarray(np.stack([verification_mask(rng, 5, M - 10, 5) for _ in range(B)]))
        k_new, v_new = _normal(rng, (B, M, K, D), dtype), _normal(rng, (B, M, K, D), dtype)
        args = (q, k, v, jnp.asarray([S, S // 3 - 7], jnp.int32), k_new, v_new, mask)
        o, lse = hybrid_tree_attention(*args, impl="pallas")
        ref_o, ref_lse = hybrid_tree_attention(*args, impl="naive")
    _assert_close(o, lse, ref_o, ref_lse, dtype)
