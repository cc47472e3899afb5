"""The skinny Pallas matmul (``pallas.skinny_matmul``): equal to a float32 matmul in the interpreter (ragged rows,
leading dims, float32 and bf16), clear errors for shapes it does not take, its Triton lowering at the padded pair's
shapes, and (GPU) the compiled kernel at those shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas.skinny_matmul import SkinnyConfig, skinny_matmul, skinny_supported


def _operands(lead, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, dtype)
    return x, w


def _check(x, w, y):
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert y.shape == ref.shape and y.dtype == x.dtype
    tol = 1e-5 if x.dtype == jnp.float32 else 2 ** -7  # bf16: one rounding of a value of size ~1
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("lead,k,n,dtype,cfg", [
    ((69,), 256, 96, jnp.bfloat16, SkinnyConfig(32, 64, 4, 2)),       # a verify pass's rows, several K steps
    ((1, 16), 128, 64, jnp.float32, SkinnyConfig(16, 128, 4, 3)),     # a draft level's, one K step
    ((2, 3), 64, 32, jnp.float32, SkinnyConfig(32, 16, 4, 2)),        # leading dims, 6 rows
    ((128,), 128, 128, jnp.bfloat16, SkinnyConfig(128, 32, 8, 2)),    # the most rows, one column block
    ((1,), 64, 48, jnp.float32, SkinnyConfig(16, 64, 4, 2)),          # one row
], ids=["69rows", "16rows-f32", "lead-dims", "128rows", "1row"])
def test_equals_a_float32_matmul_in_the_interpreter(lead, k, n, dtype, cfg):
    x, w = _operands(lead, k, n, dtype, seed=k + n)
    _check(x, w, skinny_matmul(x, w, config=cfg))


def test_default_config_and_mixed_weight_dtype():
    """The weight is cast to x's dtype; the default config takes a 4608 x 6912-like shape ratio."""
    x, w = _operands((5,), 256, 64, jnp.bfloat16)
    _check(x, w, skinny_matmul(x, w.astype(jnp.float32)))


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((129, 128), (128, 64), "1..128 rows"),
    ((8, 100), (100, 64), "multiples of 128, 32"),
    ((8, 128), (128, 40), "multiples of 128, 32"),
    ((8, 128), (64, 64), "do not chain"),
])
def test_shapes_it_does_not_take_are_named(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        skinny_matmul(jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, jnp.float32))


def test_config_validation_and_support_check():
    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        SkinnyConfig(block_n=24)
    assert skinny_supported(69, 4608, 6912) and skinny_supported(1, 14336, 4608)
    assert not skinny_supported(0, 128, 32) and not skinny_supported(200, 128, 32)
    assert not skinny_supported(16, 4608, 6912, SkinnyConfig(block_n=128, block_k=4096))


@pytest.mark.parametrize("rows,k,n", [(69, 4608, 6912), (16, 14336, 4608), (1, 4608, 16384)])
def test_lowers_to_triton_ir_at_the_padded_pair_shapes(rows, k, n):
    sds = jax.ShapeDtypeStruct
    lowered = jax.jit(lambda x, w: skinny_matmul(x, w, backend="triton")).trace(
        sds((1, rows, k), jnp.bfloat16), sds((k, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "xla.gpu.triton" in text and 'name = "skinny_matmul"' in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,k,n", [(69, 4608, 6912), (69, 14336, 4608), (16, 4608, 14336), (1, 4608, 4608)])
@pytest.mark.parametrize("cfg", [SkinnyConfig(), SkinnyConfig(64, 64, 4, 5), SkinnyConfig(16, 256, 4, 3)],
                         ids=lambda c: f"{c.block_n}x{c.block_k}x{c.num_warps}x{c.num_stages}")
def test_compiled_kernel_on_gpu(rows, k, n, cfg):
    x, w = _operands((1, rows), k, n, jnp.bfloat16, seed=rows)
    _check(x, w, skinny_matmul(x, w, config=cfg))
