"""The multi-device tensor-parallel cases: ``python -m tests.sharded_cases CASE ...`` in a fresh interpreter with
8 fake CPU devices (``tests/test_tensor_parallel.py`` starts it with ``XLA_FLAGS``, which must be set before jax
starts). Each case asserts and prints ``OK <case>``; meshes are named model x data (``4x2``: tensor parallel over
4 devices, batch rows over 2).

The last case runs the continuous-batching engine on a sharded target.

Also the tiny tensor-parallel model (16 query / 8 KV heads, so TP 8 divides the KV heads) and a checkpoint writer
shared with the single-device tests.
"""

from __future__ import annotations

import json
import re
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import tests.conftest  # noqa: F401  (CPU, float32 matmuls at highest precision)
from infer import PromptLookup, generate
from longspec_jax.testing import oracle_draft
from infer.decoding import DecodeSettings
from infer.generate import on_mesh
from infer.plain import decode_step
from longspec_jax import load_target
from longspec_jax.config import TargetConfig
from longspec_jax.draft import DraftConfig, init_draft
from longspec_jax.kv_cache import init_cache
from longspec_jax.mesh import HEADS, make_mesh
from longspec_jax.safetensors_io import save_file
from longspec_jax.sampling import SamplingConfig
from longspec_jax.target import Target, forward, init_target_params, lm_head_logits
from longspec_jax.tensor_parallel import shard_draft, shard_target
from longspec_jax.weights import target_tensor_specs

TP_CONFIG = TargetConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=128, num_layers=2,
                         num_heads=16, num_kv_heads=8, head_dim=8, max_position_embeddings=1024)
PROMPTS = [list(range(5, 25)), [9, 3, 7] * 4 + [1]]  # ragged: 20 and 13 tokens
MAX_NEW = 24
TREE = (2, 3, 3)
MESHES = {"8x1": (8, 1), "4x2": (4, 2), "2x1": (2, 1)}  # model x data


def tp_target(seed: int = 0, config: TargetConfig = TP_CONFIG) -> Target:
    """float32 random weights, std 0.3: logits well separated, so greedy argmax is never decided by rounding."""
    return Target(config, init_target_params(config, jax.random.PRNGKey(seed), std=0.3))


def write_checkpoint(path: Path, hf_config: dict, seed: int = 0) -> Path:
    """An HF-layout checkpoint (``config.json`` + ``model.safetensors``) of random float32 tensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    rng = np.random.default_rng(seed)
    tensors = {spec.name: (0.3 * rng.standard_normal(spec.shape)).astype(np.float32)
               for spec in target_tensor_specs(TargetConfig.from_hf_dict(hf_config))}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def hf_config(**overrides) -> dict:
    c = TP_CONFIG
    return {**dict(model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                   max_position_embeddings=c.max_position_embeddings), **overrides}


def prompt_logits(target: Target, prompts=PROMPTS) -> np.ndarray:
    """Logits ``[B, T, V]`` after every prompt token (right-padded, one forward), on the target's mesh."""
    T = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    cfg = target.config

    @jax.jit
    def run(params, tokens_BxT):
        B = tokens_BxT.shape[0]
        cache = init_cache(cfg.num_layers, B, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        hidden, cache = forward(params, cfg, tokens_BxT, positions, cache, mask, impl="xla")
        return lm_head_logits(params, hidden), cache.k[0]

    with on_mesh(target.mesh):
        logits, k0 = run(target.params, jnp.asarray(tokens))
    if target.mesh is not None:  # the cache is laid out rows over data, KV heads over model
        assert k0.sharding.is_equivalent_to(NamedSharding(target.mesh, HEADS), 4), k0.sharding
    return np.asarray(logits)


def mesh_of(name: str):
    model, data = MESHES[name]
    return make_mesh(model, data, jax.devices()[:model * data])


def check_generate(name: str, speculative: bool) -> None:
    """Sharded logits, plain greedy and (optionally) speculative generate equal the single-device ones."""
    target = tp_target()
    sharded = shard_target(target, mesh_of(name))
    wqkv = sharded.params["layers"][0]["wqkv"]
    assert wqkv.shape == (128, MESHES[name][0], 256 // MESHES[name][0]) and "model" in str(wqkv.sharding.spec)
    np.testing.assert_allclose(prompt_logits(sharded), prompt_logits(target), rtol=1e-4, atol=1e-4)
    ref = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])
    out = generate(sharded, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    if speculative:
        draft = oracle_draft(init_draft(DraftConfig.from_target(TP_CONFIG, window=16), jax.random.PRNGKey(1)),
                             PROMPTS, ref.tokens, TP_CONFIG.vocab_size, 512, wrong_every=4)
        spec_ref = generate(target, PROMPTS, draft=draft, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=TREE)
        spec = generate(sharded, PROMPTS, draft=draft, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=TREE)
        np.testing.assert_array_equal(spec.tokens, ref.tokens)
        np.testing.assert_array_equal(spec.accept_counts, spec_ref.accept_counts)
        assert spec.accept_counts[:, 1:].sum() > 0  # multi-token rounds


def collectives(hlo_text: str) -> list[tuple[str, int]]:
    """(kind, element count) of every collective in a compiled program's HLO."""
    out = []
    for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(", hlo_text):
        out.append((m.group(2), int(np.prod([int(d) for d in m.group(1).split(",") if d]))))
    return out


def check_decode_collectives(name: str) -> None:
    """A sharded decode step communicates like Megatron tensor parallelism: two all-reduces of the token's
    hidden state per layer (after attention's output projection and after the MLP), one for the vocabulary-sharded
    embedding, and tiny all-gathers for the vocabulary-sharded argmax; no weight, cache or head data moves."""
    mesh, config = mesh_of(name), TP_CONFIG
    sharded = shard_target(tp_target(), mesh)
    settings = DecodeSettings(config=config, sampling=SamplingConfig(), capacity=64, prefill_chunk=32, out_len=4,
                              prompt_len=32, impl="auto")
    B = MESHES[name][1]
    with on_mesh(mesh):
        cache = jax.jit(lambda: init_cache(config.num_layers, B, 64, config.num_kv_heads, config.head_dim,
                                           jnp.float32))()
        text = jax.jit(lambda p, c, t, k: decode_step(p, settings, c, t, k)).lower(
            sharded.params, cache, jnp.zeros((B,), jnp.int32), jax.random.PRNGKey(0)).compile().as_text()
    found = collectives(text)
    reduces = [n for kind, n in found if kind == "all-reduce"]
    assert len(reduces) == 2 * config.num_layers + 1 and max(reduces) <= B * config.hidden_size, found
    assert all(kind in ("all-reduce", "all-gather") for kind, _ in found), found
    assert all(n <= B * jax.device_count() for kind, n in found if kind == "all-gather"), found


def case_fast() -> None:
    """The default suite's case: mesh 4x2, plain decoding, the collectives of a decode step, loading, and the
    errors."""
    check_generate("4x2", speculative=False)
    check_decode_collectives("4x2")
    check_decode_collectives("8x1")
    try:
        generate(shard_target(tp_target(), mesh_of("4x2")), PROMPTS + [[1, 2]], max_new_tokens=4)
    except ValueError as e:
        assert "data axis of 2" in str(e), e
    else:
        raise AssertionError("a batch of 3 on a data axis of 2 did not raise")
    try:
        shard_target(tp_target(), make_mesh(3, 1, jax.devices()[:3]))
    except ValueError as e:
        assert "8 KV heads" in str(e), e
    else:
        raise AssertionError("TP 3 with 8 KV heads did not raise")


def case_speculative() -> None:
    for name in MESHES:
        check_generate(name, speculative=True)


def case_draft_vocab() -> None:
    """A draft vocabulary on mesh 4x2 that leaves out a third of the tokens the target emits: its LM-head columns
    split over ``model`` where K divides (K = 4 * 40) and replicated where not (K = 161); greedy tokens equal plain
    decoding and the single-device acceptance counts, and a sampled tree draws as on one device."""
    target = tp_target()
    sharded = shard_target(target, mesh_of("4x2"))
    ref = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])
    excluded = np.unique(ref.tokens)[::3]
    kept = np.setdiff1d(np.arange(TP_CONFIG.vocab_size), excluded)
    base = init_draft(DraftConfig.from_target(TP_CONFIG, window=16), jax.random.PRNGKey(1))
    for k in (160, 161):
        draft = base.with_vocab(target, kept[:k])
        head_spec = shard_draft(draft, sharded.mesh).vocab.head.sharding.spec
        assert ("model" in str(head_spec)) == (k % 4 == 0), head_spec
        oracle = oracle_draft(draft, PROMPTS, ref.tokens, TP_CONFIG.vocab_size, 512, wrong_every=4)
        spec_ref = generate(target, PROMPTS, draft=oracle, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=TREE)
        spec = generate(sharded, PROMPTS, draft=oracle, max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=TREE)
        np.testing.assert_array_equal(spec.tokens, ref.tokens)
        np.testing.assert_array_equal(spec.accept_counts, spec_ref.accept_counts)
        assert spec.accept_counts[:, 1:].sum() > 0 and np.isin(spec.tokens, excluded).any()
    sampled = dict(max_new_tokens=MAX_NEW, eos_token_id=[], tree_shape=TREE, temperature=1.0, draft_sampling=True,
                   seed=2)
    np.testing.assert_array_equal(generate(sharded, PROMPTS, draft=draft, **sampled).tokens,
                                  generate(target, PROMPTS, draft=draft, **sampled).tokens)


def case_lookup_and_sampling() -> None:
    """Prompt lookup, T > 0 sampling (same draws: the random bits do not depend on the sharding), the Pallas
    kernels (interpret mode) under shard_map and streaming (ordered host callbacks), on mesh 4x2."""
    target = tp_target()
    sharded = shard_target(target, mesh_of("4x2"))
    streamed = []
    for kwargs in (dict(draft=PromptLookup(num_tokens=4)), dict(temperature=0.8, top_p=0.9, seed=3),
                   dict(attention="pallas"), dict(on_tokens=lambda tokens, emitted: streamed.append(tokens))):
        ref = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[], **kwargs)
        out = generate(sharded, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[], **kwargs)
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=str(kwargs))
    np.testing.assert_array_equal(np.stack(streamed[MAX_NEW:], axis=1), out.tokens)  # the sharded call's steps
    try:
        shard_target(sharded, mesh_of("2x1"))
    except ValueError as e:
        assert "already sharded" in str(e), e
    else:
        raise AssertionError("sharding a sharded target did not raise")


def case_loading(tmp: str) -> None:
    """``load_target(mesh=)`` equals loading on one device and sharding, and its peak host memory stays near one
    tensor on a checkpoint of many (biases, tied embeddings)."""
    small = write_checkpoint(Path(tmp) / "small", hf_config(attention_bias=True, mlp_bias=True,
                                                             tie_word_embeddings=True))
    mesh = make_mesh(8)
    loaded = load_target(small, dtype=jnp.float32, mesh=mesh)
    ref = shard_target(load_target(small, dtype=jnp.float32), mesh)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(ref.params)):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(prompt_logits(loaded), prompt_logits(load_target(small, dtype=jnp.float32)),
                               rtol=1e-4, atol=1e-4)

    big_config = hf_config(num_hidden_layers=12, hidden_size=256, intermediate_size=512, vocab_size=512)
    big = write_checkpoint(Path(tmp) / "big", big_config)
    specs = target_tensor_specs(TargetConfig.from_hf_dict(big_config))
    total = sum(4 * int(np.prod(s.shape)) for s in specs)
    largest = max(4 * int(np.prod(s.shape)) for s in specs)
    assert total > 30 * largest, (total, largest)
    tracemalloc.start()
    params = load_target(big, dtype=jnp.float32, mesh=mesh).params
    jax.block_until_ready(params)
    held, peak = tracemalloc.get_traced_memory()  # held: host buffers the CPU devices kept (zero-copy)
    tracemalloc.stop()
    print(f"loading {total / 2**20:.1f} MiB: host peak {peak / 2**20:.2f} MiB, {held / 2**20:.2f} MiB held by "
          f"the CPU devices at the end; largest tensor {largest / 2**20:.2f} MiB")
    assert peak < total / 8 and peak - held < 2 * largest, (peak, held, largest, total)


def case_engine() -> None:
    """The continuous-batching engine on a sharded target: greedy requests equal single-device generate, on
    meshes with and without rows split over data."""
    from infer.engine import Engine, EngineConfig, RequestParams

    target = tp_target()
    ref = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])
    draft = init_draft(DraftConfig.from_target(TP_CONFIG, window=16), jax.random.PRNGKey(1))
    for name in ("4x2", "8x1"):
        engine = Engine(shard_target(target, mesh_of(name)), draft,
                        EngineConfig(max_batch=2, max_context=64, prefill_chunk=16, tree_shape=TREE,
                                     compile_ahead=False))
        engine.start()
        greedy = [engine.submit(p, RequestParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in PROMPTS * 2]
        sampled = engine.submit(PROMPTS[0], RequestParams(max_tokens=MAX_NEW, temperature=1.0, ignore_eos=True))
        for b, handle in enumerate(greedy):
            assert handle.result() == ref.tokens[b % 2].tolist(), (name, b)
        assert len(sampled.result()) == MAX_NEW
        engine.shutdown()


CASES = {"fast": case_fast, "speculative": case_speculative, "lookup_and_sampling": case_lookup_and_sampling,
         "loading": case_loading, "draft_vocab": case_draft_vocab, "engine": case_engine}

if __name__ == "__main__":
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    for name in sys.argv[1:]:
        name, _, arg = name.partition("=")
        CASES[name](*([arg] if arg else []))
        print(f"OK {name}", flush=True)
