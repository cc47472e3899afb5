"""The embedded default model (``infer/default_model/target``, a trained code LM): loads, tokenizes, generates and
matches HF greedy decoding."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer import generate
from infer.main import DEFAULT_MODEL
from longspec_jax import load_target
from longspec_jax.config import TargetConfig

TARGET_DIR = os.fspath(DEFAULT_MODEL / "target")
PROMPT = "import os\n\n\ndef read_lines(path):\n    "
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target_f32():
    return load_target(TARGET_DIR, dtype=jnp.float32)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype="float32").eval()
    model.generation_config.eos_token_id = None  # fixed-length greedy comparison
    return model


def test_config_and_tokenizer():
    from transformers import AutoTokenizer

    c = TargetConfig.from_dir(TARGET_DIR)
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_layers) == ("llama", 16384, 384, 8)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope.theta) == (6, 2, 64, 1e6)
    assert c.eos_token_ids == (1,)
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)  # as load_target reads it
    ids = tok.encode(PROMPT)
    assert ids and max(ids) < c.vocab_size
    assert tok.decode(ids) == PROMPT
    assert tok.convert_ids_to_tokens([0, 1]) == ["<s>", "</s>"]


@pytest.mark.slow
def test_bf16_load_and_generate():
    target = load_target(TARGET_DIR, dtype=jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(target.params))
    ids = target.tokenizer.encode(PROMPT)
    out = generate(target, [ids], max_new_tokens=16)
    n = int(out.num_generated[0])
    assert 1 <= n <= 16
    assert ((out.tokens[0, :n] >= 0) & (out.tokens[0, :n] < target.config.vocab_size)).all()
    assert (out.tokens[0, n:] == -1).all()
    assert isinstance(target.tokenizer.decode(out.tokens[0, :n].tolist()), str)


@pytest.mark.slow
def test_greedy_matches_transformers_float32(target_f32, hf_model):
    import torch

    ids = target_f32.tokenizer.encode(PROMPT)
    out = generate(target_f32, [ids], max_new_tokens=NEW_TOKENS, eos_token_id=[])
    with torch.no_grad():
        prompt = torch.tensor([ids])
        hf = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=3)
    expected = hf[0, len(ids):].numpy()
    assert len(expected) == NEW_TOKENS
    np.testing.assert_array_equal(out.tokens[0], expected)
    text = target_f32.tokenizer.decode(out.tokens[0].tolist())
    assert text.strip(), "the trained model should continue Python code with some text"


@pytest.mark.slow
def test_prompt_logits_match_transformers_float32(target_f32, hf_model):
    """Last-token logits of the prompt (our chunked prefill through generate's planner vs HF)."""
    import torch

    from longspec_jax.kv_cache import init_cache
    from longspec_jax.target import prefill

    ids = target_f32.tokenizer.encode(PROMPT * 3)
    T = 64
    assert len(ids) <= T
    c = target_f32.config
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    cache = init_cache(c.num_layers, 1, T, c.num_kv_heads, c.head_dim, jnp.float32)
    logits, _ = jax.jit(prefill, static_argnames=("config", "chunk"))(
        target_f32.params, c, jnp.asarray(tokens), jnp.asarray([len(ids)], jnp.int32), cache, chunk=16)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(np.asarray(logits)[0] - expected).max() < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_the_first_command_writes_python_without_repeating_a_line(temperature, capsys):
    """``python -m infer.main --prompt "def fibonacci(n):"`` at T = 0 and 0.7: 64 tokens of Python-shaped code (an
    assignment or a return), no line more than twice, and the decode rate and tau reported."""
    from infer.main import main

    assert main(["--prompt", "def fibonacci(n):", "--temperature", temperature]) == 0
    out, err = capsys.readouterr()
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    assert len(lines) >= 4 and max(lines.count(line) for line in lines) <= 2, out
    assert re.search(r"^\s*(return\b|[\w.]+(\[[^]]*\])? = )", out, re.M), out
    assert re.search(r"decode 63 tokens in [\d.]+ s: [\d.]+ tokens/s", err) and "tokens per round (tau)" in err, err
