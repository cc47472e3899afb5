"""The outside anchor of the tasks benchmark: Hugging Face ``generate`` on the same target in PyTorch, plain and
with its own prompt lookup (``prompt_lookup_num_tokens``), batch 1, timed like ours (generation minus a probe
call: here one new token, as eager PyTorch has no compile to share)."""

from __future__ import annotations

import time


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

    def run(self, tokens: list[int], new_tokens: int, temperature: float, lookup_tokens: int | None, seed: int,
            eos_ids: list[int] | None, reps: int = 1) -> dict:
        """One prompt: ``generated`` [1], ``rounds`` None (HF does not report them), ``total_s`` and ``probe_s``
        (medians of ``reps`` calls; the probe makes ``probe_generated`` [1] = one token), ``tokens`` (the new
        tokens), ``peak_bytes`` (torch's peak on the GPU)."""
        torch = self.torch
        ids = torch.tensor([tokens], device=self.device)
        kwargs = dict(do_sample=temperature > 0, pad_token_id=0,
                      eos_token_id=eos_ids if eos_ids else None)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        if lookup_tokens:
            kwargs["prompt_lookup_num_tokens"] = lookup_tokens
        if not eos_ids:
            kwargs["min_new_tokens"] = new_tokens
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
        new = out[0, len(tokens):].tolist()
        return dict(generated=[len(new)], rounds=None, total_s=sorted(total)[reps // 2],
                    probe_s=sorted(prefill)[reps // 2], probe_generated=[1], tokens=[new],
                    peak_bytes=torch.cuda.max_memory_allocated() if self.cuda else None)
