"""Helpers of the server tests: a tiny model pair on disk, a server process shared by the test workers, the
solo greedy reference, Prometheus samples."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT
from tests.train_helpers import build_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def bpe_tokenizer(path, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (320 tokens) saved in ``path``, with ``chat_template``."""
    tokenizer = build_tokenizer(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


@dataclasses.dataclass(frozen=True)
class Pair:
    target: str
    draft: str


def write_tiny_pair(root: Path, seed: int = 0) -> Pair:
    """A random float32 Llama (hidden 64, 2 layers, GQA 4/2, no EOS) with the BPE tokenizer and its chat template,
    and a random LongSpec draft for it. Weights of std 0.3 and norms near 1 keep greedy argmax far from ties."""
    from longspec_jax import save_draft
    from longspec_jax.config import TargetConfig
    from longspec_jax.safetensors_io import save_file
    from longspec_jax.testing import random_draft
    from longspec_jax.weights import target_tensor_specs

    target, draft = root / "target", root / "draft"
    target.mkdir(parents=True)
    tokenizer = bpe_tokenizer(target)
    hf = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)
    (target / "config.json").write_text(json.dumps(hf))
    config, rng = TargetConfig.from_hf_dict(hf), np.random.default_rng(seed)
    save_file({spec.name: ((1.0 if "norm" in spec.name else 0.0) + 0.3 * rng.standard_normal(spec.shape))
               .astype(np.float32) for spec in target_tensor_specs(config)}, os.fspath(target / "model.safetensors"))
    save_draft(random_draft(seed, config), draft, target=hf)
    return Pair(os.fspath(target), os.fspath(draft))


class Reference:
    """Solo plain greedy decoding (``generate``, no draft) of the target in ``path`` in float32, detokenized as the
    server does; prompts padded to ``pad_to`` tokens, so that every call shares one compiled program."""

    def __init__(self, path: str, max_new: int = 64, pad_to: int = 128):
        import functools

        import jax.numpy as jnp

        from longspec_jax import load_target

        self.target = load_target(path, dtype=jnp.float32)
        self.decode = functools.partial(self.target.tokenizer.decode, skip_special_tokens=True)
        self.max_new, self.pad_to = max_new, pad_to

    def encode(self, text: str) -> list[int]:
        return list(self.target.tokenizer.encode(text))

    def complete(self, prompt_ids: list[int], n: int) -> tuple[str, str]:
        """The text of the first ``n`` tokens and the finish reason (``stop`` at EOS, else ``length``)."""
        from infer.detokenize import IncrementalDetokenizer
        from infer.generate import generate

        assert n <= self.max_new and len(prompt_ids) <= self.pad_to
        out = generate(self.target, [prompt_ids], max_new_tokens=self.max_new, temperature=0.0,
                       pad_prompts_to=self.pad_to)
        tokens = out.tokens[0, :int(out.num_generated[0])].tolist()
        detok = IncrementalDetokenizer(self.decode, prompt_ids)
        text = detok.push(tokens[:n]) + detok.finish()
        return text, "length" if len(tokens) >= n else "stop"

    def __call__(self, prompt_ids: list[int], n: int) -> str:
        return self.complete(prompt_ids, n)[0]


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on the file ``path`` across processes (the pytest-xdist workers)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_pair(root: Path) -> Pair:
    """The tiny pair in ``root / "pair"``, written by the first worker that asks."""
    with locked(root / "pair.lock"):
        if not (root / "pair" / "done").exists():
            write_tiny_pair(root / "pair")
            (root / "pair" / "done").touch()
    return Pair(os.fspath(root / "pair" / "target"), os.fspath(root / "pair" / "draft"))


class SharedServer:
    """``python -m infer.serve --port 0 ARGS``, shared by the pytest-xdist workers of a run through the folder
    ``root``: the first to open it starts the process, the last to close it stops it. A test holds
    ``exclusive()`` while it uses the server, since tests read its counters and its load."""

    def __init__(self, root: Path, args: list[str], timeout: float = 600):
        root.mkdir(parents=True, exist_ok=True)
        self._root, self._state, self._proc = root, root / "state.json", None
        with locked(root / "users.lock"):
            state = json.loads(self._state.read_text()) if self._state.exists() else {"users": 0}
            if not state["users"]:
                state = self._start(args, timeout)
            state["users"] += 1
            self._state.write_text(json.dumps(state))
        self.url, self.ready_line, self._pid = state["url"], state["ready_line"], state["pid"]

    def _start(self, args: list[str], timeout: float) -> dict:
        log = self._root / "server.log"
        with open(log, "w") as out:
            self._proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--host", "127.0.0.1", "--port", "0",
                                           *args], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
        deadline = time.monotonic() + timeout
        while not (ready := re.search(r"\[infer\.serve\] ready: (http://\S+).*", log.read_text())):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return {"users": 0, "url": ready.group(1), "ready_line": ready.group(0), "pid": self._proc.pid}

    def close(self) -> None:
        with locked(self._root / "users.lock"):
            state = json.loads(self._state.read_text())
            state["users"] -= 1
            self._state.write_text(json.dumps(state))
            if state["users"]:
                return
            if self._proc is None:
                os.kill(self._pid, signal.SIGTERM)
                return
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    @contextlib.contextmanager
    def exclusive(self):
        with locked(self._root / "use.lock"):
            yield self

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """The metrics once no request runs or waits (``AssertionError`` after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if values["longspec:num_requests_running"] == values["longspec:num_requests_waiting"] == 0:
                return values
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {values}"
            time.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition by name, labels (if any) appended as ``{k="v",...}``."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values
