"""The outside anchor of the tasks benchmark: Hugging Face ``generate`` on the same target in PyTorch, plain (any
batch: prompts left-padded, with an attention mask) and with its own prompt lookup (``prompt_lookup_num_tokens``;
transformers runs it at batch 1 only), timed like ours (generation minus a probe call: here one new token, as
eager PyTorch has no compile to share)."""

from __future__ import annotations

import os
import time

# the variables by which a user sets JAX's GPU memory allocation (jax.readthedocs.io: GPU memory allocation)
JAX_ALLOCATOR_SETTINGS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                          "XLA_PYTHON_CLIENT_ALLOCATOR")


def leave_gpu_memory_to_torch(environ=os.environ) -> bool:
    """JAX takes 75% of a GPU's memory when its backend starts, which leaves HF's PyTorch model too little (batch 8
    of 16k prompts on the padded pair ran out of memory on the H200). Unless the user has set JAX's allocation,
    JAX grows its pool as it needs instead (plain decoding's rate unchanged there). Call it
    before JAX starts its backend; returns whether it changed ``environ``."""
    if any(key in environ for key in JAX_ALLOCATOR_SETTINGS):
        return False
    environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return True


class HFRunner:
    """One HF causal LM from the target's directory: bf16 on a GPU, float32 on the CPU."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        if self.cuda:
            self.model = self.model.cuda()
        self.device = next(self.model.parameters()).device
        self.warm = False  # eager PyTorch compiles nothing per shape: one untimed call warms the whole run

    def _generate(self, ids, new_tokens: int, kwargs: dict):
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    def run(self, prompts: list[list[int]], new_tokens: int, temperature: float, lookup_tokens: int | None,
            seed: int, eos_ids: list[int] | None, reps: int = 1) -> dict:
        """One batch of prompts: ``generated`` [B], ``rounds`` None (HF does not report them), ``total_s`` and
        ``probe_s`` (medians of ``reps`` calls; the probe makes ``probe_generated`` [B] = one token each),
        ``tokens`` (each row's new tokens, through its EOS), ``peak_bytes`` (torch's peak on the GPU)."""
        torch = self.torch
        if lookup_tokens and len(prompts) > 1:
            raise ValueError(f"HF prompt lookup runs at batch 1 only (transformers' assisted generation); got a "
                             f"batch of {len(prompts)}")
        ids, mask = left_padded(torch, prompts, PAD_ID, self.device)
        kwargs = dict(attention_mask=mask, do_sample=temperature > 0, pad_token_id=PAD_ID,
                      eos_token_id=eos_ids if eos_ids else None)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        if lookup_tokens:
            kwargs["prompt_lookup_num_tokens"] = lookup_tokens
        if not eos_ids:
            kwargs["min_new_tokens"] = new_tokens
        try:
            return self._timed(ids, new_tokens, kwargs, seed, eos_ids, reps)
        finally:  # torch's cached blocks back to the device, for the JAX methods that come next
            if self.cuda:
                torch.cuda.empty_cache()

    def _timed(self, ids, new_tokens: int, kwargs: dict, seed: int, eos_ids: list[int] | None, reps: int) -> dict:
        torch = self.torch
        if not self.warm:
            self._generate(ids, new_tokens, kwargs)
            self.warm = True
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        prefill, total = [], []
        for _ in range(reps):
            torch.manual_seed(seed)
            prefill.append(self._generate(ids, 1, {**kwargs, "min_new_tokens": 1} if not eos_ids else kwargs)[0])
            torch.manual_seed(seed)
            seconds, out = self._generate(ids, new_tokens, kwargs)
            total.append(seconds)
        new = [through_eos(row, eos_ids) for row in out[:, ids.shape[1]:].tolist()]
        return dict(generated=[len(t) for t in new], rounds=None, total_s=sorted(total)[reps // 2],
                    probe_s=sorted(prefill)[reps // 2], probe_generated=[1] * len(ids), tokens=new,
                    peak_bytes=torch.cuda.max_memory_allocated() if self.cuda else None)


PAD_ID = 0  # any id: left padding is masked out, and a row that ended is cut at its EOS before its padding


def left_padded(torch, prompts: list[list[int]], pad_id: int, device):
    """``ids`` [B, longest] with each prompt at the right end and ``attention_mask`` [B, longest] (1 on tokens):
    decoder-only batches grow at the right, so every row's next token follows its own last one."""
    longest = max(len(p) for p in prompts)
    ids = [[pad_id] * (longest - len(p)) + list(p) for p in prompts]
    mask = [[0] * (longest - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def through_eos(tokens: list[int], eos_ids: list[int] | None) -> list[int]:
    """A row's new tokens up to and including its first EOS (after it, HF fills with padding)."""
    ends = [i for i, t in enumerate(tokens) if t in (eos_ids or ())]
    return tokens[:ends[0] + 1] if ends else tokens
