"""Helpers of the server tests: a tiny model pair on disk, a server process, Prometheus samples."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from infer.engine import Chunk, EngineDead, EngineStats, QueueFull, RequestHandle
from tests.train_helpers import build_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def bpe_tokenizer(path, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (320 tokens) saved in ``path``, with ``chat_template``."""
    tokenizer = build_tokenizer(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition by name, labels (if any) appended as ``{k="v",...}``."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


class FakeEngine:
    """Byte tokens (sum of the prompt + 7 i) mod 256 at T = 0, random at T > 0; 1-3 tokens per step."""

    def __init__(self, config, step_s: float = 0.005):
        self.config, self.step_s = config, step_s
        self._waiting: collections.deque = collections.deque()
        self._running: list = []
        self._lock = threading.Lock()
        self._alive, self._stop = False, False
        self._next_id = 0
        self.counts = dict(prompt_tokens=0, generation_tokens=0)

    def start(self):
        self._alive = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt_ids, params):
        if not self._alive:
            raise EngineDead("stopped")
        if len(prompt_ids) + params.max_tokens > self.config.max_context:
            raise ValueError("prompt + max_tokens beyond max_context")
        with self._lock:
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self._waiting)} waiting")
            self._next_id += 1
            handle = RequestHandle(self._next_id, tuple(prompt_ids), params, self)
            handle._rng = np.random.default_rng(params.seed)
            self._waiting.append(handle)
        return handle

    def stats(self):
        with self._lock:
            return EngineStats(running=len(self._running), waiting=len(self._waiting), **self.counts)

    @property
    def alive(self):
        return self._alive

    def shutdown(self):
        self._stop = True
        self._thread.join()

    def _wake(self):
        pass

    def _loop(self):
        while not self._stop:
            with self._lock:
                while self._waiting and len(self._running) < self.config.max_batch:
                    handle = self._waiting.popleft()
                    handle.timings.admitted = time.monotonic()
                    self.counts["prompt_tokens"] += len(handle.prompt_ids)
                    self._running.append(handle)
                for handle in list(self._running):
                    if handle.cancelled:
                        handle._push(Chunk((), "abort"))
                        self._running.remove(handle)
                        continue
                    n = min(1 + handle.num_generated % 3, handle.params.max_tokens - handle.num_generated)
                    base = sum(handle.prompt_ids) + 7 * handle.num_generated
                    if handle.params.temperature > 0:
                        tokens = tuple(int(t) for t in handle._rng.integers(32, 127, n))
                    else:
                        tokens = tuple((base + 7 * i) % 256 for i in range(n))
                    done = handle.num_generated + n >= handle.params.max_tokens
                    self.counts["generation_tokens"] += n
                    handle._push(Chunk(tokens, "length" if done else None))
                    if done:
                        self._running.remove(handle)
            time.sleep(self.step_s)
        self._alive = False
