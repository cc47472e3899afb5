"""The staged top-k equals jax.lax.top_k exactly: values, indices and their order, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.top_k import DIRECT_MAX, SEGMENT, top_k


@pytest.mark.parametrize("shape,k", [((3, 16384), 16), ((2, 4, 5000), 4), ((1, 128256), 16), ((7, 2049), 1),
                                     ((2, 3000), 64)])
@pytest.mark.parametrize("ties", [False, True])
def test_equals_lax_top_k(shape, k, ties):
    rng = np.random.default_rng(sum(shape) + k)
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:  # few distinct values: many equal entries inside and across segments (no -0.0: see top_k)
        x = np.round(x * 2).astype(np.float32) + np.float32(0.0)
        x[..., -5:] = -np.inf
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))


def test_staged_path_is_taken_for_long_rows():
    """Rows above DIRECT_MAX go through segments: two sorts, the first over rows of SEGMENT values, so the
    equality test above exercises the staged path; shorter rows take one sort, and no path uses XLA's top-k."""
    x = jnp.zeros((2, DIRECT_MAX + SEGMENT), jnp.float32)
    staged = jax.make_jaxpr(lambda a: top_k(a, 8))(x)
    sorts = [e for e in staged.eqns if e.primitive.name == "sort"]
    assert len(sorts) == 2 and sorts[0].invars[0].aval.shape[-1] == SEGMENT
    direct = jax.make_jaxpr(lambda a: top_k(a, 8))(x[:, :DIRECT_MAX])
    assert [e.primitive.name for e in direct.eqns].count("sort") == 1
    assert "top_k" not in str(staged) + str(direct)


def test_negative_zero_compares_equal_to_zero():
    x = jnp.asarray([[0.0, -0.0, 1.0, -0.0, 0.0]], jnp.float32)
    values, indices = top_k(x, 4)
    np.testing.assert_array_equal(indices, [[2, 0, 1, 3]])
    np.testing.assert_array_equal(values, [[1.0, 0.0, 0.0, 0.0]])


def test_k_longer_than_the_row_is_an_error():
    with pytest.raises(ValueError, match="k = 6 exceeds the row length 5"):
        top_k(jnp.zeros((1, 5)), 6)
