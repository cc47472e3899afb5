"""Draft parity: our Flax ``DraftLayer``, driven with the attention functions of the draft's runtime, vs a
test-only PyTorch draft layer written from the PyTorch LongSpec code (tests/torch_reference_draft.py).

Random weights (biases and norm weights too), float32, GQA and MHA, default / linear / llama3 RoPE, sequences
longer than a small window so that the window matters, and cross-attention gaps 1 (inference) and 3 (noisy
training). The last test runs the real ``draft_prefill`` + ``draft_root`` (ring cache that wraps around) +
``build_tree`` and compares the draft's distribution after the root and after every tree node it ran on with
the torch layer run over the whole sequence up to that node.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from longspec_jax.attention import cache_attention, windowed_ring_attention
from longspec_jax.config import RopeConfig, TargetConfig
from longspec_jax.draft import Draft, DraftConfig, DraftLayer, draft_prefill, draft_root, init_draft
from longspec_jax.draft_io import draft_state_dict, hf_config_from_target_config
from longspec_jax.kv_cache import RingCache, init_cache
from longspec_jax.target import Target, forward, init_target_params
from longspec_jax.tree import TreeSpec, build_tree
from tests.torch_reference_draft import draft_class, draft_logits, hf_config_object

TOL = 1e-4
WINDOW = 8

# Target configs the draft is built from (hidden 64). Keys are test ids.
TARGETS = {
    "llama-gqa": dict(model_type="llama", num_heads=4, num_kv_heads=2),
    "llama-mha-linear": dict(model_type="llama", num_heads=4, num_kv_heads=4,
                             rope=RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)),
    "llama-gqa-llama3": dict(model_type="llama", num_heads=8, num_kv_heads=2,
                             rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2-mqa": dict(model_type="qwen2", num_heads=4, num_kv_heads=1, rope=RopeConfig(theta=1234.5)),
}


def target_config(name: str, vocab_size: int = 128) -> TargetConfig:
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_layers=2,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, **TARGETS[name])
    fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    return TargetConfig(**fields)


def randomize(draft: Draft, seed: int, std: float = 0.1) -> Draft:
    """Every parameter random: kernels N(0, std), biases N(0, 0.1), norm weights 1 + N(0, 0.1)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(draft.variables)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        value = 1.0 + 0.1 * noise if "weight" in name else 0.1 * noise if "bias" in name else std * noise
        out.append(jnp.asarray(value).astype(leaf.dtype))
    return Draft(config=draft.config, variables=jax.tree_util.tree_unflatten(treedef, out),
                 target_hf_config=draft.target_hf_config)


@functools.lru_cache(maxsize=None)
def _initial_draft(config: DraftConfig, dtype) -> Draft:
    return init_draft(config, jax.random.PRNGKey(0), dtype)


def random_draft(config: TargetConfig, seed: int = 0, window: int = WINDOW, dtype=jnp.float32) -> Draft:
    """A draft for ``config`` with every parameter random (Flax init gives the structure)."""
    return randomize(_initial_draft(DraftConfig.from_target(config, window), dtype), seed)


def torch_draft(draft: Draft, hf_config: dict):
    """The torch reference layer holding ``draft``'s weights (strict load of the 20 exported tensors)."""
    model = draft_class(hf_config)(hf_config_object(hf_config)).float().eval()
    state = {k: torch.from_numpy(v) for k, v in draft_state_dict(draft, np.float32).items()}
    model.load_state_dict(state, strict=True)
    return model


def jax_full_logits(draft: Draft, tokens_BxT, embed_VxD, lm_head_DxV, target_k, target_v, cross_gap: int = 1,
                    impl: str = "xla") -> np.ndarray:
    """Our draft over whole sequences (positions 0..T-1): self-attention through ``windowed_ring_attention``
    over a ring holding every position (plus each query's own key as the new key), cross-attention through
    ``cache_attention`` with the target K/V cache cut at ``t - cross_gap + 1`` slots for the query at t."""
    B, T = np.shape(tokens_BxT)
    run = _full_logits_fn(draft.config, np.dtype(draft.param_dtype), B, T, impl)
    return np.asarray(run(draft.variables, jnp.asarray(tokens_BxT), jnp.asarray(embed_VxD), jnp.asarray(lm_head_DxV),
                          jnp.asarray(target_k), jnp.asarray(target_v), jnp.int32(cross_gap)))


@functools.lru_cache(maxsize=None)
def _full_logits_fn(c: DraftConfig, dtype, B: int, T: int, impl: str):
    module = DraftLayer(c, dtype)
    assert c.ring_capacity >= T

    @jax.jit
    def run(variables, tokens, embed, lm_head, k_cache, v_cache, cross_gap):
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = embed[tokens].astype(dtype)
        k_self, v_self = module.apply(variables, x, positions, method=DraftLayer.self_kv)
        ring = RingCache.empty(B, c.ring_capacity, c.num_kv_heads, c.head_dim, dtype)
        ring = ring.write(k_self, v_self, positions, jnp.ones((B, T), bool))
        own = jnp.broadcast_to(jnp.eye(T, dtype=bool), (B, T, T))

        def attend_self(q):
            return windowed_ring_attention(q, positions, ring.k, ring.v, ring.pos, c.window, k_self, v_self, own,
                                           impl=impl)[0]

        def attend_cross(q):  # one row per query, so that each query has its own visible prefix
            H, D = q.shape[2], q.shape[3]
            rows_k = jnp.repeat(k_cache, T, axis=0)
            rows_v = jnp.repeat(v_cache, T, axis=0)
            lengths = jnp.clip(positions.reshape(-1) - cross_gap + 1, 0, k_cache.shape[1])
            o = cache_attention(q.reshape(B * T, 1, H, D), rows_k, rows_v, lengths, impl=impl)[0]
            return o.reshape(B, T, H, D)

        y = module.apply(variables, x, positions, attend_self, attend_cross)
        return jnp.dot(y.astype(jnp.float32), lm_head, precision="highest")

    return run


def random_inputs(config: TargetConfig, batch: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch, length))
    embed = rng.normal(0, 1.0, (config.vocab_size, config.hidden_size)).astype(np.float32)
    lm_head = rng.normal(0, 0.2, (config.hidden_size, config.vocab_size)).astype(np.float32)
    kv_shape = (batch, length, config.num_kv_heads, config.head_dim)
    target_k = rng.normal(0, 1.0, kv_shape).astype(np.float32)
    target_v = rng.normal(0, 1.0, kv_shape).astype(np.float32)
    return tokens, embed, lm_head, target_k, target_v


def torch_full_logits(draft: Draft, hf_config: dict, tokens, embed, lm_head_DxV, target_k, target_v,
                      cross_gap: int = 1) -> np.ndarray:
    model = torch_draft(draft, hf_config)
    return draft_logits(model, hf_config, tokens, embed, lm_head_DxV.T.copy(), target_k, target_v,
                        window=draft.config.window, cross_gap=cross_gap).numpy()


@pytest.mark.parametrize("cross_gap", [1, 3])
@pytest.mark.parametrize("name", list(TARGETS))
def test_draft_layer_matches_torch_reference(name, cross_gap):
    config = target_config(name)
    draft = random_draft(config, seed=3)
    hf = hf_config_from_target_config(config)
    tokens, embed, lm_head, tk, tv = random_inputs(config, batch=2, length=40, seed=7)
    ours = jax_full_logits(draft, tokens, embed, lm_head, tk, tv, cross_gap)
    ref = torch_full_logits(draft, hf, tokens, embed, lm_head, tk, tv, cross_gap)
    assert np.abs(ref).max() > 1.0  # logits are not trivially small
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_window_and_gap_matter():
    """The comparison above is sensitive to the window and to the cross-attention gap."""
    config = target_config("llama-gqa")
    draft = random_draft(config, seed=4)
    hf = hf_config_from_target_config(config)
    tokens, embed, lm_head, tk, tv = random_inputs(config, batch=2, length=40, seed=8)
    ours = jax_full_logits(draft, tokens, embed, lm_head, tk, tv, 1)
    model = torch_draft(draft, hf)
    wide = draft_logits(model, hf, tokens, embed, lm_head.T.copy(), tk, tv, window=16, cross_gap=1).numpy()
    gap2 = draft_logits(model, hf, tokens, embed, lm_head.T.copy(), tk, tv, window=WINDOW, cross_gap=2).numpy()
    # identical while the window covers the whole prefix, then different
    np.testing.assert_allclose(ours[:, :WINDOW + 1], wide[:, :WINDOW + 1], atol=TOL, rtol=0)
    assert np.abs(ours[:, WINDOW + 1:] - wide[:, WINDOW + 1:]).max() > 1e-2
    assert np.abs(ours[:, 1:] - gap2[:, 1:]).max() > 1e-2


def _node_path(parents, node: int) -> list[int]:
    """The nodes from the root's child down to ``node``."""
    path = []
    while node:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def _assert_levels_are_top_c(spec: TreeSpec, tokens, parents, logp_ref: dict[int, np.ndarray]) -> None:
    """Each level holds the top-c (parent, token) pairs of the level above by cumulative reference log-prob."""
    def nodes(level: int) -> range:  # level 0: the root
        return range(spec.offsets[level - 1] if level else 0, spec.offsets[level])

    score = {0: 0.0}
    for level in range(1, spec.depth + 1):
        above = list(nodes(level - 1))
        candidates = np.stack([score[p] + logp_ref[p] for p in above])  # [parents, V]
        chosen = np.zeros_like(candidates, bool)
        for node in nodes(level):
            p = above.index(int(parents[node]))
            chosen[p, tokens[node]] = True
            score[node] = candidates[p, tokens[node]]
        assert chosen.sum() == spec.shape[level - 1]  # distinct pairs
        assert candidates[chosen].min() >= candidates[~chosen].max() - 2 * level * TOL, f"level {level}"


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "qwen2-mqa"])
def test_prefill_root_and_tree_levels_match_torch(name):
    """draft_prefill fills the ring from the prompt, draft_root adds the pending tokens, build_tree runs the
    draft on each tree level at once (ring + the tree's own K/V under the ancestor mask). The log-probs after the
    root and after every node the draft ran on must equal the torch layer's last-position distribution over the
    whole sequence up to that node (committed tokens, root, the node's ancestors), with the target's last-layer
    K/V of positions <= root - 1; and each level must be the top-c of cumulative torch log-probs. A random draft,
    not an oracle, so every log-prob counts; sequences exceed the 128-slot ring, so it wraps."""
    config = target_config(name, vocab_size=160)
    target = Target(config=config, params=init_target_params(config, jax.random.PRNGKey(0), std=0.2))
    draft = random_draft(config, seed=5)
    dc = draft.config
    spec = TreeSpec.parse((3, 5, 4), config.vocab_size)
    lengths = np.array([150, 97])            # whole sequences; the last token is the root
    num_pending = np.array([3, 1])
    B, A = len(lengths), 6
    Tmax = int(lengths.max())
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, config.vocab_size, (B, Tmax)).astype(np.int32)

    committed = lengths - num_pending
    pending = np.zeros((B, A), np.int32)
    for b in range(B):
        pending[b, :num_pending[b]] = tokens[b, committed[b]:lengths[b]]
    ds = draft.settings("xla")

    @jax.jit
    def run(target_params, weights, tokens):
        # Target cache: K/V of positions 0 .. length-2 (the root is not in it yet).
        cache = init_cache(config.num_layers, B, 256, config.num_kv_heads, config.head_dim, jnp.float32)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((Tmax - 1, Tmax - 1), bool)), (B, Tmax - 1, Tmax - 1))
        positions = jnp.broadcast_to(jnp.arange(Tmax - 1, dtype=jnp.int32), (B, Tmax - 1))
        _, cache = forward(target_params, config, tokens[:, :-1], positions, cache, causal, impl="xla")
        cache = cache.replace(lengths=jnp.asarray(lengths - 1, jnp.int32))
        ring = draft_prefill(ds, weights, target_params, tokens, jnp.asarray(committed))
        logp_root, ring = draft_root(ds, weights, target_params, cache, ring, jnp.asarray(pending),
                                     jnp.asarray(num_pending, jnp.int32))
        root = tokens[np.arange(B), lengths - 1]
        return build_tree(spec, ds, weights, target_params, cache, ring, root, logp_root), cache

    tree, cache = run(target.params, draft.weights, jnp.asarray(tokens))
    tree_tokens, parents, draft_logp = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.draft_logp))

    hf = hf_config_from_target_config(config)
    model = torch_draft(draft, hf)
    embed = np.asarray(target.params["embed"])
    lm_head = np.asarray(target.params["lm_head"])
    for b in range(B):
        n = int(lengths[b])
        tk = np.asarray(cache.k[-1])[b:b + 1, :n - 1]
        tv = np.asarray(cache.v[-1])[b:b + 1, :n - 1]
        logp_ref = {}
        for node in np.flatnonzero(spec.node_depths < spec.depth):  # the draft never runs on the last level
            sequence = np.concatenate([tokens[b, :n], tree_tokens[b, _node_path(parents[b], node)]])
            logits = draft_logits(model, hf, sequence[None], embed, lm_head.T.copy(), tk, tv, window=dc.window,
                                  cross_gap=1)
            logp_ref[node] = torch.log_softmax(logits[0, -1], dim=-1).numpy()
            np.testing.assert_allclose(draft_logp[b, node], logp_ref[node], atol=TOL, rtol=0,
                                       err_msg=f"row {b}, node {node}")
        _assert_levels_are_top_c(spec, tree_tokens[b], parents[b], logp_ref)
