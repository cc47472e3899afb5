"""GPU: the same greedy ``generate()`` (plain and speculative, the embedded bf16 pair) gives the same tokens in two
fresh processes (``reproducible=True``, the default). Run with JAX_PLATFORMS=cuda."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import jax
import pytest

from infer.main import DEFAULT_MODEL

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda)")]


def test_two_fresh_processes_give_the_same_tokens(tmp_path):
    sources = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    text = "\n".join(open(path, encoding="utf-8").read() for path in sources)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "infer.bench", "repro", "--out", str(out),
                    "--target", str(DEFAULT_MODEL / "target"), "--draft", str(DEFAULT_MODEL / "draft"),
                    "--prompts", str(prompts), "--contexts", "4096", "--num-prompts", "4", "--new-tokens", "96",
                    "--modes", "on", "--processes", "2"], check=True)
    rows = json.loads((out / "bench_repro.json").read_text())["rows"]
    assert set(rows) == {"on/plain/4096", "on/speculative/4096"}
    for key, row in rows.items():
        assert row["same"] == row["prompts"] == 4, f"{key}: processes differ at {row['first_difference']}"


def test_reproducible_compile_is_about_as_fast_as_autotuned():
    """The reproducible compile (no autotuning) once left XLA's Triton GEMMs on their default tiles: 10x slower
    prefill and 2.5x slower decoding on the padded 8B pair. Four layers of Llama-3-8B shapes, 4k prompt."""
    import time

    import jax.numpy as jnp
    import numpy as np

    from infer.bench.decode import LLAMA3_8B
    from longspec_jax.testing import random_target
    from infer.generate import generate

    target = random_target(dict(LLAMA3_8B, num_layers=4), None, jnp.bfloat16, std=0.02)
    prompt = np.random.default_rng(0).integers(0, LLAMA3_8B["vocab_size"], 4000).tolist()

    def seconds(new_tokens, reproducible):
        generate(target, [prompt], max_new_tokens=new_tokens, eos_token_id=[], reproducible=reproducible)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            generate(target, [prompt], max_new_tokens=new_tokens, eos_token_id=[], reproducible=reproducible)
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    for new_tokens in (1, 256):  # prefill alone, then prefill + decoding
        autotuned, reproducible = seconds(new_tokens, False), seconds(new_tokens, True)
        assert reproducible < 1.2 * autotuned, (new_tokens, reproducible, autotuned)


def test_reproducible_single_row_lm_head_keeps_its_kernel_in_bf16():
    """Under the reproducible (cuBLAS) compile a one-row bf16 -> f32 LM head became an f32 GEMV on a kernel
    converted to float32 on every step (194 against 45 us at 4608 x 16384 on the H200)."""
    import re

    import jax.numpy as jnp

    from infer.generate import REPRODUCIBLE_OPTIONS
    from longspec_jax.target import lm_head_logits

    d, V = 512, 4096
    params = {"lm_head": jnp.zeros((d, V), jnp.bfloat16)}
    hlo = jax.jit(lm_head_logits).lower(params, jnp.zeros((1, 1, d), jnp.bfloat16)).compile(
        compiler_options=REPRODUCIBLE_OPTIONS).as_text()
    assert not re.search(rf"f32\[{d},{V}\]\S* convert\(", hlo), "the LM head kernel is converted to float32"
