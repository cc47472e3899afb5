"""The HF PyTorch baseline of the decode benchmark: ``LlamaForCausalLM.generate`` at the same shapes.

  hf         ``model.generate(do_sample=False, min_new_tokens=max_new_tokens)``: time(N + 1 new tokens) -
             time(1 new token), i.e. N decode steps without the prefill (which both calls do); one call of N + 1
             and the best of two of 1, after a warm-up; wall time with ``torch.cuda.synchronize()`` around.
  hf_static  the same with ``cache_implementation="static"`` (one cache size for all contexts), which makes
             transformers ``torch.compile`` the decode step; the compile happens in an untimed warm-up call.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable

from infer.bench.harness import error_text


def hf_worker(shapes: dict, contexts: list[int], new_tokens: int, smoke: bool, record: Callable,
              static: bool) -> None:
    """Measures every context in turn; ``record(**fields)`` receives each result (or error)."""
    import numpy as np
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    part = "hf_static" if static else "hf"
    s = shapes
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    record(kind="env", part=part, device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
           transformers=transformers.__version__)
    N = new_tokens
    max_len = max(contexts) + N + 1
    config = LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                         intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                         num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                         head_dim=s["head_dim"], rms_norm_eps=s["rms_norm_eps"], rope_theta=s["rope_theta"],
                         max_position_embeddings=max(max_len, 8192), tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), torch.no_grad():
            model = LlamaForCausalLM(config)  # random init directly on the device
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if cuda:
        torch.cuda.synchronize()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record(kind="model", part=part, param_bytes=int(nbytes), init_s=time.perf_counter() - t0,
           attn_implementation=model.config._attn_implementation)

    gen_kwargs: dict = {}
    if static:
        gen_kwargs["cache_implementation"] = "static"
        if hasattr(GenerationConfig(), "max_cache_len"):
            gen_kwargs["max_cache_len"] = max_len  # one cache (and one compiled graph) for every context
        if smoke:
            gen_kwargs["disable_compile"] = True  # CPU smoke: exercise the static path without compiling

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def run(ids, n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, **gen_kwargs)
        sync()
        elapsed = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected {n}")
        return elapsed

    rng = np.random.default_rng(0)
    first = min(contexts)
    try:  # warm-up (CUDA/cuBLAS init; for hf_static the torch.compile of the decode step)
        ids = torch.as_tensor(rng.integers(0, s["vocab_size"], (1, first)), device=device)
        warm = run(ids, min(8, N))
        record(kind="warmup", part=part, context=first, new_tokens=min(8, N), seconds=warm)
    except Exception as e:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        record(kind="warmup", part=part, error=error_text(e))
        if static:
            return
    for ctx in contexts:
        try:
            ids = torch.as_tensor(rng.integers(0, s["vocab_size"], (1, ctx)), device=device)
            t1 = min(run(ids, 1), run(ids, 1))  # prefill + 1 token: cheap, so the best of two
            tn = run(ids, N + 1)
            t = tn - t1
            record(kind="decode", part=part, context=ctx, new_tokens=N, seconds=t, ms_per_token=1e3 * t / N,
                   tokens_per_s=N / t, generate_1_s=t1, generate_n_plus_1_s=tn,
                   peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(kind="decode", part=part, context=ctx, error=error_text(e))
            if cuda:
                torch.cuda.empty_cache()
