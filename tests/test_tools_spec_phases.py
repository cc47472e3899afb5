"""infer.bench.spec_phases: the last-layer commit scheme and the tree it verifies, timed against the all-layer
commit (the phase timings themselves run in the benchmark's smoke test)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from infer.bench.spec_phases import last_layer_commit, recompute_settings
from infer.bench.tiny import TINY, random_draft, tiny_target
from infer.generate import plan_speculative
from longspec_jax.kv_cache import TreeKV, commit, init_cache
from longspec_jax.sampling import SamplingConfig


def test_last_layer_commit_writes_only_the_last_layer():
    cache = init_cache(3, 2, 16, 1, 2, jnp.float32)
    values = jnp.arange(2 * 16 * 2, dtype=jnp.float32).reshape(2, 16, 1, 2)
    cache = cache.replace(k=(values,) * 3, v=(values + 1,) * 3, lengths=jnp.asarray([4, 6], jnp.int32))
    new = -jnp.arange(2 * 6 * 2, dtype=jnp.float32).reshape(2, 6, 1, 2) - 1
    tree_kv = TreeKV(k=(new,) * 3, v=(new - 100,) * 3)
    path_BxA, count_B, active_B = jnp.asarray([[0, 2, 5], [0, 1, 1]]), jnp.asarray([3, 2]), jnp.asarray([True, False])
    ours = last_layer_commit(cache, tree_kv, path_BxA, count_B, active_B)
    full = commit(cache, tree_kv, path_BxA, count_B, active_B)
    np.testing.assert_array_equal(ours.lengths, full.lengths)
    np.testing.assert_array_equal(ours.lengths, [7, 6])
    for layer in range(2):
        np.testing.assert_array_equal(ours.k[layer], values)  # untouched: recomputed next round
    np.testing.assert_array_equal(ours.k[-1], full.k[-1])
    np.testing.assert_array_equal(ours.k[-1][0, 4:7], new[0, [0, 2, 5]])
    np.testing.assert_array_equal(ours.v[-1], full.v[-1])


def test_recompute_settings_add_the_accepted_tokens_to_the_last_level():
    target = tiny_target(0)
    settings = plan_speculative(target, random_draft(1), 40, 12, SamplingConfig(), (4, 16, 16), 512, "xla")
    alt, tree = recompute_settings(settings, 2)
    assert alt.tree.shape == (4, 16, 16 + 4) and alt.base == settings.base
    N = 1 + 4 + 16 + 20
    assert tree.tokens.shape == (2, N) and tree.mask.shape == (2, N, N)
    assert tree.draft_logp.shape == (2, N, TINY.vocab_size)
    assert bool(jnp.all(tree.mask[0] == jnp.tril(jnp.ones((N, N), bool))))
