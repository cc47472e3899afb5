"""Inputs of the long-context tasks benchmark: LongBench-format tasks with the PyTorch LongSpec
evaluation's prompt templates, a long-reasoning prompt/answer format, a built-in repo-level code-completion task from a
corpus split (the fixture's dev split), and the length buckets and filters.

A :class:`Sample` holds the prompt as text and as token ids; its bucket is the length range it falls in.
Nothing here downloads: users bring LongBench jsonl files (``context``, ``input``, ``answers``, ``length``).
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

# task -> (user turn, assistant prefix); {context} and {input} come from the LongBench record
TEMPLATES = {
    "gov_report": ("You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                   "Report:\n{context}\n\nNow, write a one-page summary of the report.", "Summary:"),
    "qmsum": ("You are given a meeting transcript and a query containing a question or instruction. Answer the "
              "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
              "above meeting transcript in one or more sentences.\n\nQuery: {input}", "Answer:"),
    "multi_news": ("You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
                   "{context}\n\nNow, write a one-page summary of all the news.", "Summary:"),
    "lcc": ("Please complete the code given below. \n{context}Now, complete the code given.", ""),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Now, complete the code given.", ""),
}
SYSTEM = "You are a helpful assistant"
BUCKETS = ((2048, 4096), (4096, 8192), (8192, 16384), (16384, 32768))  # (lo, hi]: tokens of the prompt
FUNCTION_START = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]", re.MULTILINE)


@dataclasses.dataclass
class Sample:
    task: str
    id: str
    prompt: str
    answers: list[str]
    tokens: list[int]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def bucket(self) -> str | None:
        return bucket_name(self.length)


def bucket_name(length: int, buckets=BUCKETS) -> str | None:
    """``"2-4k"`` ... ``"16-32k"`` for a prompt of ``length`` tokens in ``(lo, hi]``, else None (buckets under
    1024 tokens are named in tokens: ``"16-32"``)."""
    for lo, hi in buckets:
        if lo < length <= hi:
            return f"{lo // 1024}-{hi // 1024}k" if lo >= 1024 else f"{lo}-{hi}"
    return None


def bucket_bounds(name: str, buckets=BUCKETS) -> tuple[int, int]:
    """The ``(lo, hi)`` of a bucket name."""
    for lo, hi in buckets:
        if bucket_name(hi, buckets) == name:
            return lo, hi
    raise ValueError(f"unknown bucket {name!r}; known: {[bucket_name(hi, buckets) for _, hi in buckets]}")


def chat_prompt(tokenizer, user: str, assistant_prefix: str = "") -> str:
    """The user turn as the tokenizer's chat template renders it (with a system turn), or, for a tokenizer
    without one, the reference's plain wrapper; then the assistant prefix."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        head = f"<s>system\n{SYSTEM}</s>\n<s>user\n{user}</s>\n<s>assistant\n"
    return head + assistant_prefix


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
    """The records of a jsonl file, each checked to hold ``fields``; errors name the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON: {e}") from None
            missing = [k for k in fields if not isinstance(row, dict) or k not in row]
            if missing:
                raise ValueError(f"{path}:{number}: missing field(s) {missing}")
            rows.append(row)
    return rows


def load_longbench(path: str, task: str, tokenizer) -> list[Sample]:
    """LongBench v1 records of ``task`` with its template."""
    if task not in TEMPLATES:
        raise ValueError(f"unknown LongBench task {task!r}; known: {', '.join(TEMPLATES)}")
    user, prefix = TEMPLATES[task]
    samples = []
    for i, row in enumerate(read_jsonl(path, ("context", "input", "answers"))):
        prompt = chat_prompt(tokenizer, user.format(context=row["context"], input=row["input"]), prefix)
        samples.append(Sample(task=task, id=str(row.get("_id", i)), prompt=prompt, answers=list(row["answers"]),
                              tokens=tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return samples


def load_reasoning(path: str, tokenizer, task: str = "reasoning") -> list[Sample]:
    """Long-reasoning records ``{"prompt": ..., "answer": ...}``: the prompt as the user turn."""
    samples = []
    for i, row in enumerate(read_jsonl(path, ("prompt", "answer"))):
        prompt = chat_prompt(tokenizer, row["prompt"])
        samples.append(Sample(task=task, id=str(row.get("id", i)), prompt=prompt, answers=[row["answer"]],
                              tokens=tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return samples


def repo_completion(docs: list[dict], tokenizer, buckets=BUCKETS, per_bucket: int = 4, seed: int = 0,
                    answer_chars: int = 2000) -> list[Sample]:
    """Repo-level code completion: a repository's documents (jsonl rows with ``repo`` and ``text``, in order)
    concatenated, cut just after the ``def`` of a function at a seeded random place whose prefix falls in each
    bucket; the prompt is the prefix's last tokens (a bucket-sized window), the answer the text that followed,
    up to the next function."""
    rng = np.random.default_rng(seed)
    by_repo: dict[str, list[str]] = {}
    for row in docs:
        by_repo.setdefault(row["repo"], []).append(row["text"])
    cuts = []  # (repo, text, char cut, tokens of text[:cut])
    for repo in sorted(by_repo):
        text = "\n".join(by_repo[repo])
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ends = np.array([end for _, end in encoded["offset_mapping"]])
        for match in FUNCTION_START.finditer(text):
            cut = match.end()
            cuts.append((repo, text, cut, encoded["input_ids"][:int(np.searchsorted(ends, cut, side="right"))]))
    samples = []
    for lo, hi in buckets:
        fits = [c for c in cuts if len(c[3]) > lo]
        for k in rng.permutation(len(fits))[:per_bucket]:
            repo, text, cut, prefix = fits[k]
            window = int(rng.integers(lo + 1, hi + 1))
            tokens = prefix[-window:]
            following = FUNCTION_START.search(text, cut)
            end = min(following.start() if following else len(text), cut + answer_chars)
            samples.append(Sample(task="repo_completion", id=f"{repo}:{cut}", prompt=tokenizer.decode(tokens),
                                  answers=[text[cut:end]], tokens=list(tokens)))
    return samples


def select(samples: list[Sample], min_tokens: int = 1200, max_tokens: int | None = None, buckets=BUCKETS,
           limit: int | None = None) -> list[Sample]:
    """The reference's filter ``min_tokens < length <= max_tokens`` (its max: the model's context - 2000), only
    lengths inside one of ``buckets`` (``(lo, hi]`` pairs), and at most ``limit`` samples per (task, bucket), in
    order."""
    kept, seen = [], {}
    for s in samples:
        bucket = bucket_name(s.length, buckets)
        if s.length <= min_tokens or (max_tokens is not None and s.length > max_tokens) or bucket is None:
            continue
        key = (s.task, bucket)
        if limit is not None and seen.get(key, 0) >= limit:
            continue
        seen[key] = seen.get(key, 0) + 1
        kept.append(s)
    return kept
