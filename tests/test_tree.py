"""Tree shapes, beam-search expansion and the acceptance walk, against brute force on small cases."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.tree import TreeSpec, accept, add_level_to_mask, expand_level


def test_tree_spec_layout():
    spec = TreeSpec.parse((4, 16, 16, 16, 16), vocab_size=100)
    assert spec.num_nodes == 69 and spec.depth == 5 and spec.max_accept == 6
    assert spec.offsets == (1, 5, 21, 37, 53, 69)
    assert spec.level(2) == slice(5, 21)
    np.testing.assert_array_equal(np.bincount(spec.node_depths), [1, 4, 16, 16, 16, 16])


@pytest.mark.parametrize("bad", [(), (0, 2), (2, -1), (1.5,), "abc", (True, 2), 7, (65, 1), (2, 200)])
def test_tree_spec_rejects_malformed_shapes(bad):
    with pytest.raises(ValueError, match="tree_shape"):
        TreeSpec.parse(bad, vocab_size=64)


def test_expand_level_is_the_global_top_k():
    rng = np.random.default_rng(0)
    B, P, V, W = 3, 5, 11, 7
    scores = rng.standard_normal((B, P)).astype(np.float32)
    logp = rng.standard_normal((B, P, V)).astype(np.float32)
    parents, tokens, best = expand_level(jnp.asarray(scores), jnp.asarray(logp), W)
    for b in range(B):
        total = (scores[b][:, None] + logp[b]).reshape(-1)
        order = np.argsort(-total, kind="stable")[:W]
        np.testing.assert_array_equal(parents[b], order // V)
        np.testing.assert_array_equal(tokens[b], order % V)
        np.testing.assert_allclose(best[b], total[order], rtol=1e-6)


def _build(parents_list):
    """Mask of a tree given as parent indices (root: -1), via add_level_to_mask one node at a time."""
    N = len(parents_list)
    mask = jnp.eye(N, dtype=bool)[None]
    for i, p in enumerate(parents_list[1:], start=1):
        mask = add_level_to_mask(mask, jnp.asarray([[p]]), i)
    return mask


def test_ancestor_mask():
    parents = [-1, 0, 0, 1, 1, 2, 3]
    mask = np.asarray(_build(parents))[0]
    for i in range(len(parents)):
        ancestors, j = {i}, parents[i]
        while j >= 0:
            ancestors.add(j)
            j = parents[j]
        assert set(np.nonzero(mask[i])[0]) == ancestors


def test_accept_walks_the_matching_children():
    # root 0 -> {1: tok 5, 2: tok 6}; 1 -> {3: tok 7, 4: tok 8}; 2 -> {5: tok 7}; 3 -> {6: tok 9}
    spec = TreeSpec((2, 3, 1))
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tokens = jnp.asarray([[0, 5, 6, 7, 8, 7, 9]])
    mask = _build(parents)
    par = jnp.asarray([[max(p, 0) for p in parents]])
    cases = {  # target choice after each node -> (path, emitted tokens)
        (5, 7, 1, 9, 2, 3, 4): ([0, 1, 3, 6], [5, 7, 9, 4]),  # full depth, bonus = choice after node 6
        (6, 2, 7, 2, 2, 1, 2): ([0, 2, 5], [6, 7, 1]),
        (5, 8, 3, 3, 3, 3, 3): ([0, 1, 4], [5, 8, 3]),
        (4, 1, 1, 1, 1, 1, 1): ([0], [4]),                    # nothing accepted: bonus only
    }
    for choices, (path, emitted) in cases.items():
        acc = accept(tokens, par, mask, jnp.asarray([choices]), spec)
        n = int(acc.count_B[0])
        assert n == len(path)
        np.testing.assert_array_equal(np.asarray(acc.path_BxA)[0, :n], path)
        np.testing.assert_array_equal(np.asarray(acc.tokens_BxA)[0, :n], emitted)


def test_accept_matches_a_sequential_walk_on_random_trees():
    rng = np.random.default_rng(1)
    spec = TreeSpec((3, 4, 4))
    N, V = spec.num_nodes, 6  # at most 4 children per node, so siblings can always get distinct tokens
    for _ in range(50):
        parents = [-1] + [0] * 3
        for k in range(2, spec.depth + 1):
            prev = spec.level(k - 1)
            parents += list(rng.integers(prev.start, prev.stop, spec.shape[k - 1]))
        tokens = np.zeros(N, np.int64)
        for p in set(parents[1:]):
            kids = [i for i in range(1, N) if parents[i] == p]
            tokens[kids] = rng.permutation(V)[:len(kids)]  # distinct among siblings
        choices = rng.integers(0, V, N)
        node, walk = 0, [0]
        while True:
            kids = [i for i in range(1, N) if parents[i] == node and tokens[i] == choices[node]]
            if not kids:
                break
            node = kids[0]
            walk.append(node)
        acc = accept(jnp.asarray([tokens]), jnp.asarray([[max(p, 0) for p in parents]]), _build(parents),
                     jnp.asarray([choices]), spec)
        assert int(acc.count_B[0]) == len(walk)
        np.testing.assert_array_equal(np.asarray(acc.path_BxA)[0, :len(walk)], walk)
        np.testing.assert_array_equal(np.asarray(acc.tokens_BxA)[0, :len(walk)], choices[walk])
