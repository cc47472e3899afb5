"""Our Llama / Qwen2 target vs transformers (PyTorch, CPU) on tiny random models, in float32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import HF_CONFIGS, hf_greedy, hf_logits, random_prompt
from infer import generate
from longspec_jax import load_target
from longspec_jax.config import RopeConfig
from longspec_jax.kv_cache import init_cache
from longspec_jax.rope import inverse_frequencies
from longspec_jax.target import forward, lm_head_logits, prefill

PROMPT_LEN = 64
LOGIT_TOL = 1e-4
NAMES = list(HF_CONFIGS)


@functools.partial(jax.jit, static_argnames=("config", "chunk", "impl"))
def chunked_logits(params, config, tokens_BxT, *, chunk, impl):
    """Logits at every position, running the prompt through ``forward`` ``chunk`` tokens at a time, so every
    chunk after the first reads the earlier ones from the KV cache."""
    B, T = tokens_BxT.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, params["embed"].dtype)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (B, chunk, chunk))
    outs = []
    for start in range(0, T, chunk):
        positions = jnp.broadcast_to(jnp.arange(start, start + chunk, dtype=jnp.int32), (B, chunk))
        cache = cache.replace(lengths=jnp.full((B,), start, jnp.int32))
        hidden, cache = forward(params, config, tokens_BxT[:, start:start + chunk], positions, cache, mask,
                                impl=impl)
        outs.append(lm_head_logits(params, hidden))
    return jnp.concatenate(outs, axis=1)


@functools.partial(jax.jit, static_argnames=("config", "chunk"))
def prefill_logits(params, config, tokens_BxT, lengths_B, *, chunk):
    B, T = tokens_BxT.shape
    cache = init_cache(config.num_layers, B, T, config.num_kv_heads, config.head_dim, params["embed"].dtype)
    logits, cache = prefill(params, config, tokens_BxT, lengths_B, cache, chunk=chunk, impl="xla")
    return logits, cache.lengths


@pytest.fixture(scope="module")
def loaded(hf_model_dir):
    """``loaded(name) -> (torch model, float32 Target)``."""
    cache = {}

    def get(name):
        if name not in cache:
            model, path = hf_model_dir(name)
            cache[name] = (model, load_target(path, dtype=jnp.float32))
        return cache[name]

    return get


def test_config_read_from_hf(loaded):
    _, target = loaded("llama-gqa-llama3")
    c = target.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (4, 2, 16, False)
    assert c.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_position_embeddings=64)
    _, qwen = loaded("qwen2-gqa-tied")
    assert qwen.config.qkv_bias and qwen.config.tie_word_embeddings and "lm_head" not in qwen.params
    assert qwen.config.rope.theta == 1234.5
    _, biased = loaded("llama-gqa-bias-hd32")
    assert biased.config.head_dim == 32 and biased.config.o_bias and biased.config.mlp_bias


@pytest.mark.parametrize("rope_name", ["llama-gqa-llama3", "llama-mha-tied-linear"])
def test_rope_scaling_changes_angles_at_tested_positions(loaded, rope_name):
    """The scaled configs must really rotate differently from unscaled RoPE within the 64-token prompt."""
    _, target = loaded(rope_name)
    rope, hd = target.config.rope, target.config.head_dim
    plain = RopeConfig(theta=rope.theta)
    angle_gap = (PROMPT_LEN - 1) * np.abs(inverse_frequencies(rope, hd) - inverse_frequencies(plain, hd))
    assert angle_gap.max() > 1.0


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, name):
    model, target = loaded(name)
    prompt = random_prompt(PROMPT_LEN, target.config.vocab_size, seed=1)
    expected = hf_logits(model, prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    whole = np.asarray(chunked_logits(target.params, target.config, tokens, chunk=PROMPT_LEN, impl="xla"))[0]
    chunked = np.asarray(chunked_logits(target.params, target.config, tokens, chunk=16, impl="xla"))[0]
    assert np.abs(whole - expected).max() < LOGIT_TOL
    assert np.abs(chunked - expected).max() < LOGIT_TOL


def test_logits_naive_attention_match_transformers(loaded):
    model, target = loaded("llama-gqa-llama3")
    prompt = random_prompt(PROMPT_LEN, target.config.vocab_size, seed=2)
    got = chunked_logits(target.params, target.config, jnp.asarray([prompt]), chunk=16, impl="naive")
    assert np.abs(np.asarray(got)[0] - hf_logits(model, prompt)).max() < LOGIT_TOL


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "qwen2-gqa-tied"])
def test_chunked_prefill_last_logits_batch(loaded, name):
    """Right-padded batch of two prompts of different lengths, prefilled 16 tokens at a time."""
    model, target = loaded(name)
    lengths = [PROMPT_LEN, 45]
    prompts = [random_prompt(n, target.config.vocab_size, seed=10 + n) for n in lengths]
    tokens = np.zeros((2, PROMPT_LEN), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    logits, cache_lengths = prefill_logits(target.params, target.config, jnp.asarray(tokens),
                                           jnp.asarray(lengths, jnp.int32), chunk=16)
    assert np.asarray(cache_lengths).tolist() == lengths
    for b, p in enumerate(prompts):
        assert np.abs(np.asarray(logits)[b] - hf_logits(model, p)[-1]).max() < LOGIT_TOL


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_matches_transformers(loaded, name):
    model, target = loaded(name)
    vocab = target.config.vocab_size
    prompts = [random_prompt(23, vocab, seed=3), random_prompt(40, vocab, seed=4)]
    # prefill_chunk=16 < prompt lengths: the batch is prefilled in chunks, rows padded to 48.
    out = generate(target, prompts, max_new_tokens=48, eos_token_id=[], prefill_chunk=16)
    assert out.tokens.shape == (2, 48)
    assert out.num_generated.tolist() == [48, 48]
    for b, prompt in enumerate(prompts):
        expected = hf_greedy(model, prompt, 48)
        assert len(expected) == 48
        np.testing.assert_array_equal(out.tokens[b], expected, err_msg=f"{name}: prompt {b}")


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "qwen2-mha-untied"])
def test_attention_impls_give_same_tokens(loaded, name):
    _, target = loaded(name)
    vocab = target.config.vocab_size
    prompts = [random_prompt(23, vocab, seed=3), random_prompt(40, vocab, seed=4)]
    runs = {impl: generate(target, prompts, max_new_tokens=48, eos_token_id=[], prefill_chunk=16, attention=impl)
            for impl in ("naive", "xla")}
    np.testing.assert_array_equal(runs["naive"].tokens, runs["xla"].tokens)


@pytest.mark.parametrize("shape_BxT", [(1, 1), (1, 3), (2, 1)])
def test_lm_head_logits_is_the_float32_matmul_for_any_row_count(shape_BxT):
    params = {"lm_head": jax.random.normal(jax.random.key(0), (32, 100), jnp.bfloat16)}
    hidden_BxTxd = jax.random.normal(jax.random.key(1), (*shape_BxT, 32), jnp.bfloat16)
    expected = jnp.dot(hidden_BxTxd.astype(jnp.float32), params["lm_head"].astype(jnp.float32))
    logits = lm_head_logits(params, hidden_BxTxd)
    assert logits.shape == (*shape_BxT, 100) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_lm_head_logits_never_multiplies_a_single_row():
    """One row goes to the matmul as two (cuBLAS has no bf16 -> f32 matrix-vector product: XLA would convert
    the whole LM head to float32 on every decoding step; the GPU side of this is in test_gpu_repro.py)."""
    params = {"lm_head": jnp.zeros((32, 100), jnp.bfloat16)}
    jaxpr = jax.make_jaxpr(lm_head_logits)(params, jnp.zeros((1, 1, 32), jnp.bfloat16))
    [dot] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dot.invars[0].aval.shape == (1, 2, 32)
