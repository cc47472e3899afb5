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
    if ties:  # few distinct values: many equal entries inside and across segments
        x = np.round(x * 2).astype(np.float32)
        x[..., -5:] = -np.inf
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))


def test_staged_path_is_taken_for_long_rows():
    """Rows above DIRECT_MAX go through segments (one top-k per SEGMENT values): the jaxpr holds more than one
    top_k, so the equality test above exercises the staged path."""
    x = jnp.zeros((2, DIRECT_MAX + SEGMENT), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda a: top_k(a, 8))(x))
    assert jaxpr.count("top_k") >= 2
    assert str(jax.make_jaxpr(lambda a: top_k(a, 8))(x[:, :DIRECT_MAX])).count("top_k") == 1
