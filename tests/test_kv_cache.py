"""The commit of a speculative round: the accepted path's K/V, taken from the verification pass's TreeKV, land
in consecutive slots after the committed prefix, in every layer, exactly where a forward that wrote every
node and then compacted the path would have put them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.testing import tiny_target
from longspec_jax.kv_cache import TreeKV, commit, init_cache
from longspec_jax.target import forward, forward_tree


def test_commit_writes_the_path_rows_and_advances_active_lengths():
    B, S, N = 2, 12, 5
    cache = init_cache(2, B, S, 1, 2, jnp.float32)
    cache = cache.replace(lengths=jnp.asarray([3, 6], jnp.int32))
    new = jnp.arange(B * N * 2, dtype=jnp.float32).reshape(B, N, 1, 2) + 1
    tree_kv = TreeKV(k=(new, new * 10), v=(-new, -new * 10))
    path_BxA = jnp.asarray([[0, 2, 4], [0, 1, 1]])
    out = commit(cache, tree_kv, path_BxA, jnp.asarray([3, 2]), jnp.asarray([True, False]))
    np.testing.assert_array_equal(out.lengths, [6, 6])  # the inactive row keeps its length
    for layer, scale in ((0, 1), (1, 10)):
        np.testing.assert_array_equal(out.k[layer][0, 3:6], new[0, [0, 2, 4]] * scale)
        np.testing.assert_array_equal(out.v[layer][1, 6:9], -new[1, [0, 1, 1]] * scale)
        np.testing.assert_array_equal(out.k[layer][0, :3], 0)  # the committed prefix is untouched


def test_forward_tree_then_commit_equals_forward_then_compaction():
    target = tiny_target(0)
    c = target.config
    B, T, N = 2, 7, 4
    key = jax.random.PRNGKey(3)
    cache = init_cache(c.num_layers, B, 32, c.num_kv_heads, c.head_dim, jnp.float32)
    prompt = jax.random.randint(key, (B, T), 0, c.vocab_size)
    causal_BxTxT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    forward_c = jax.jit(lambda *a: forward(target.params, c, *a))  # eager op-by-op dispatch takes ~15 s here
    _, cache = forward_c(prompt, jnp.broadcast_to(jnp.arange(T), (B, T)), cache, causal_BxTxT)
    cache = cache.replace(lengths=jnp.asarray([T, T - 2], jnp.int32))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, N), 0, c.vocab_size)
    mask = jnp.broadcast_to(jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool), (B, N, N))
    positions = cache.lengths[:, None] + jnp.asarray([0, 1, 1, 2])
    hidden_tree, tree_kv = jax.jit(lambda *a: forward_tree(target.params, c, *a))(tokens, positions, cache, mask)
    hidden_full, written = forward_c(tokens, positions, cache, mask)
    np.testing.assert_array_equal(hidden_tree, hidden_full)
    path_BxA, count_B = jnp.asarray([[0, 2, 3], [0, 1, 1]]), jnp.asarray([3, 2])
    out = commit(cache, tree_kv, path_BxA, count_B, jnp.asarray([True, True]))
    out, written, cache = jax.device_get((out, written, cache))  # index on the host, not op by op on the device
    for b in range(B):
        start = int(cache.lengths[b])
        for layer in range(c.num_layers):
            rows = start + np.asarray(path_BxA[b, :int(count_B[b])])
            np.testing.assert_array_equal(out.k[layer][b, start:start + int(count_B[b])], written.k[layer][b, rows])
            np.testing.assert_array_equal(out.v[layer][b, start:start + int(count_B[b])], written.v[layer][b, rows])
            np.testing.assert_array_equal(out.k[layer][b, :start], cache.k[layer][b, :start])
