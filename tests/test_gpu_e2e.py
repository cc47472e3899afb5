"""GPU end to end: bf16 speculative decoding equals plain greedy decoding, up to divergences at near-ties of the
target's logits (docs/architecture.md, "Numerics and testing"), with the all-Pallas attention, with what ``auto``
picks (on Hopper the Mosaic GPU cache half for verification and prefill), and with the Mosaic GPU and the cuDNN
cache halves named. Run with JAX_PLATFORMS=cuda."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from infer import generate
from infer.bench.near_tie import parting
from infer.main import DEFAULT_MODEL
from longspec_jax import load_target
from longspec_jax.draft import DraftConfig, init_draft
from tests.spec_helpers import oracle_draft

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda)")]

TARGET = os.fspath(DEFAULT_MODEL / "target")  # the embedded trained code LM
PROMPT = '''import os
import sys


def read_lines(path):
    """Return the lines of a text file."""
    with open(path) as f:
'''


def _check_same_or_near_tie(prompt, ours, ref, target32):
    p = parting(target32, prompt, ours, ref)
    assert p is None or p["near_tie"], f"first divergence at {p['at']} with top-2 gap {p['f32_top2_gap']:.3f}"
    return p is None


@pytest.mark.parametrize("attention", ["pallas", "auto", "mosaic", "cudnn"])
def test_bf16_speculative_matches_greedy(attention):
    target = load_target(TARGET, dtype=jnp.bfloat16)
    target32 = load_target(TARGET, dtype=jnp.float32, load_tokenizer=False)
    prompt = target.tokenizer(PROMPT)["input_ids"]
    prompts = [prompt, prompt[:20]]
    ref = generate(target, prompts, max_new_tokens=96, eos_token_id=[], attention=attention)
    xla = generate(target, prompts, max_new_tokens=96, eos_token_id=[], attention="xla")
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    oracle = oracle_draft(draft, prompts, ref.tokens, wrong_every=5, vocab_size=target.config.vocab_size)
    exact_rows = 0
    for candidate in (xla,
                      generate(target, prompts, draft=draft, max_new_tokens=96, eos_token_id=[],
                               attention=attention),
                      generate(target, prompts, draft=oracle, max_new_tokens=96, eos_token_id=[],
                               attention=attention)):
        for b, p in enumerate(prompts):
            exact_rows += _check_same_or_near_tie(p, candidate.tokens[b], ref.tokens[b], target32)
    assert exact_rows >= 4  # most rows must match exactly; the rest only at near-ties


@pytest.mark.parametrize("attention", ["pallas", "auto", "mosaic", "cudnn"])
def test_bf16_speculative_matches_greedy_at_32k(attention):
    """32k tokens of dev-split source (pygments, pyparsing, mpmath on the GPU box) as the prompt."""
    from infer.bench.spec_inputs import dev_prompt_tokens

    target = load_target(TARGET, dtype=jnp.bfloat16)
    target32 = load_target(TARGET, dtype=jnp.float32, load_tokenizer=False)
    prompt = dev_prompt_tokens(target.tokenizer, 32768)
    ref = generate(target, [prompt], max_new_tokens=128, eos_token_id=[], attention=attention, max_context=40000)
    draft = init_draft(DraftConfig.from_target(target.config), jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    oracle = oracle_draft(draft, [prompt], ref.tokens, wrong_every=4, vocab_size=target.config.vocab_size,
                          slots=40000)
    results = []
    for d in (draft, oracle):
        out = generate(target, [prompt], draft=d, max_new_tokens=128, eos_token_id=[], attention=attention,
                       max_context=40000)
        results.append(_check_same_or_near_tie(prompt, out.tokens[0], ref.tokens[0], target32))
    print("exact rows:", results)
