"""Training data: local files read and tokenised with ``datasets`` (cached on disk), turned into fixed-length
rows, and served in a deterministic, resumable order.

A row is ``tokens [L]`` (int32), ``targets [L]`` (int8: 1 where the token is a training target, predicted from
the position before it) and ``length`` (real tokens; the rest is padding). Formats:

* ``text``: documents (``data.text_field``; a ``.txt`` file is one document per line), EOS after each
  (``data.append_eos``); packed (concatenated and cut into full rows, the tail of each tokenised batch
  dropped) or, with ``pack: false``, one row per document cut to ``L`` and right-padded.
* ``prompt_answer``: one row per example, ``prompt + answer (+ EOS)``; only answer tokens are targets; a prompt
  too long for the row loses its beginning.

EOS is a target only with ``data.eos_is_target`` (the reference's stage-1 data pads with EOS and so never
trains it). Tokenisation uses the target's tokenizer as it encodes by default (a Llama
tokenizer adds BOS to every segment, as the reference's collators do).

``python -m train.data --config FILE [dotted.key=value ...]`` tokenises a config's data ahead of training (the
cache is what ``train.main`` then reads), e.g. once before several runs share ``data.cache_dir``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import sys

import numpy as np

from longspec_jax.config import TargetConfig
from longspec_jax.errors import ConfigError
from train.config import DataSection, TrainConfig, load_config

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
DOCS_PER_BATCH = 64


class TokenRows:
    """A tokenised corpus as fixed-length rows (a ``datasets.Dataset`` in numpy format)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, indices) -> dict:
        """``{"tokens" [k, L] int32, "targets" [k, L] int8, "lengths" [k] int32}`` for row ``indices``."""
        batch = self.dataset[np.asarray(indices, np.int64)]
        return {"tokens": np.asarray(batch["tokens"], np.int32), "targets": np.asarray(batch["targets"], np.int8),
                "lengths": np.asarray(batch["length"], np.int32)}


def load_rows(config: TrainConfig, target_config: TargetConfig) -> tuple[TokenRows, TokenRows | None]:
    """The train rows and the eval rows (None without ``data.eval``) of a config, with the target's tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.target.path)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        raise ConfigError(f"target.path {config.target.path}: cannot load its tokenizer, which training needs "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    eos_id = target_config.eos_token_ids[0] if target_config.eos_token_ids else tokenizer.eos_token_id
    if eos_id is None:
        raise ConfigError("the target has no EOS token id (config or tokenizer); training data needs one")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    cache_dir = config.data.cache_dir or os.path.join(os.path.abspath(config.checkpoint.dir), "data_cache")
    train_rows = build_rows(config.data.train, config.data, tokenizer, eos_id, pad_id, cache_dir, desc="train")
    eval_rows = None
    if config.data.eval:
        eval_rows = build_rows(config.data.eval, config.data, tokenizer, eos_id, pad_id, cache_dir, desc="eval")
    return train_rows, eval_rows


def build_rows(files: list[str], data: DataSection, tokenizer, eos_id: int, pad_id: int, cache_dir: str,
               *, desc: str = "data") -> TokenRows:
    """Reads, tokenises and lays out ``files`` as rows (``datasets`` caches every stage under ``cache_dir``)."""
    fields = [data.text_field] if data.format == "text" else [data.prompt_field, data.answer_field]
    raw = load_fields(files, fields, cache_dir)
    tokenize = _tokenize_text if data.format == "text" else _tokenize_prompt_answer
    tok_key = _fingerprint(files, tokenizer, data, ("format", "text_field", "prompt_field", "answer_field",
                                                    "append_eos") + (("seq_len",) if data.format != "text" else ()),
                           eos_id)
    num_proc = min(data.num_proc or min(16, os.cpu_count() or 1), max(1, len(raw) // DOCS_PER_BATCH))
    if num_proc > 1:  # processes tokenise in parallel; the tokenizer's own threads would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokens = raw.map(tokenize, batched=True, batch_size=DOCS_PER_BATCH, remove_columns=raw.column_names,
                     fn_kwargs=dict(tokenizer=tokenizer, data=data, eos_id=eos_id),
                     num_proc=num_proc if num_proc > 1 else None,
                     new_fingerprint=tok_key, desc=f"{desc}: tokenise")
    rows_key = _fingerprint(files, tokenizer, data, ("seq_len", "pack", "eos_is_target"), tok_key, pad_id)
    if data.format == "text" and data.pack:
        layout, kwargs = _pack, dict(seq_len=data.seq_len)
    else:
        layout, kwargs = _cut_and_pad, dict(seq_len=data.seq_len, pad_id=pad_id)
    rows = tokens.with_format("numpy").map(layout, batched=True, batch_size=DOCS_PER_BATCH,
                                          remove_columns=tokens.column_names,
                      fn_kwargs=dict(kwargs, eos_id=eos_id, eos_is_target=data.eos_is_target),
                      new_fingerprint=rows_key, desc=f"{desc}: rows")
    if len(rows) == 0:
        raise ValueError(f"{desc}: {', '.join(files)} give no row of {data.seq_len} tokens")
    return TokenRows(rows.with_format("numpy"))


def load_fields(files: list[str], fields: list[str], cache_dir: str | None):
    """The ``fields`` columns of the rows of ``files`` (jsonl, json, parquet, txt), one dataset."""
    import datasets

    parts = []
    for path in files:
        builder = BUILDERS[os.path.splitext(path)[1]]
        part = datasets.load_dataset(builder, data_files=[path], split="train", cache_dir=cache_dir)
        missing = [f for f in fields if f not in part.column_names]
        if missing:
            raise ValueError(f"{path}: rows have no field {', '.join(map(repr, missing))} (fields: "
                             f"{', '.join(part.column_names)}); set data.text_field / prompt_field / answer_field")
        parts.append(part.select_columns(fields))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _fingerprint(files, tokenizer, data: DataSection, fields: tuple[str, ...], *extra) -> str:
    """Cache key of a stage: the files (path, size, mtime), the tokenizer, the ``data`` settings it depends on."""
    h = hashlib.sha256()
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns};".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's whole spec (vocab and merges)
    h.update((backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode())
    h.update(json.dumps([{k: getattr(data, k) for k in fields}, *extra], sort_keys=True).encode())
    return h.hexdigest()[:32]


def _tokenize_text(batch, tokenizer, data: DataSection, eos_id: int):
    ids = tokenizer(batch[data.text_field])["input_ids"]
    return {"ids": [x + [eos_id] if data.append_eos else x for x in ids], "prompt": [0] * len(ids)}


def _tokenize_prompt_answer(batch, tokenizer, data: DataSection, eos_id: int):
    prompts = tokenizer(batch[data.prompt_field])["input_ids"]
    answers = tokenizer(batch[data.answer_field])["input_ids"]
    ids, prompt_lens = [], []
    for p, a in zip(prompts, answers):
        a = a + [eos_id] if data.append_eos else a
        p = p[max(0, len(p) + len(a) - data.seq_len):]  # keep the answer; the prompt loses its beginning
        ids.append(p + a)
        prompt_lens.append(len(p))
    return {"ids": ids, "prompt": prompt_lens}


def _targets(tokens: np.ndarray, first_target: int, length: int, eos_id: int, eos_is_target: bool) -> np.ndarray:
    t = np.zeros(tokens.shape, np.int8)
    t[max(first_target, 1):length] = 1
    if not eos_is_target:
        t[tokens == eos_id] = 0
    return t


def _pack(batch, seq_len: int, eos_id: int, eos_is_target: bool):
    stream = np.concatenate(list(batch["ids"])).astype(np.int32)
    n = len(stream) // seq_len
    tokens = stream[:n * seq_len].reshape(n, seq_len)
    return {"tokens": tokens, "targets": [_targets(row, 1, seq_len, eos_id, eos_is_target) for row in tokens],
            "length": [seq_len] * n}


def _cut_and_pad(batch, seq_len: int, pad_id: int, eos_id: int, eos_is_target: bool):
    tokens, targets, lengths = [], [], []
    for ids, prompt_len in zip(batch["ids"], batch["prompt"]):
        ids = np.asarray(ids[:seq_len], np.int32)
        row = np.full(seq_len, pad_id, np.int32)
        row[:len(ids)] = ids
        tokens.append(row)
        targets.append(_targets(row, prompt_len, len(ids), eos_id, eos_is_target))
        lengths.append(len(ids))
    return {"tokens": tokens, "targets": targets, "length": lengths}


class BatchOrder:
    """Which rows each step reads: step ``i`` takes global rows ``[i*B, (i+1)*B)`` of an endless sequence of
    permutations of the data, one per epoch, each seeded by ``(seed, epoch)``. A function of the step alone, so
    a resumed run reads exactly what the uninterrupted run would have."""

    def __init__(self, num_rows: int, batch_size: int, seed: int):
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        g = step * self.batch_size + np.arange(self.batch_size)
        epochs, offsets = np.divmod(g, self.num_rows)
        return np.array([self._perm(int(e))[o] for e, o in zip(epochs, offsets)], np.int64)


class Batches:
    """Host batches ``[micro_batches, rows / micro_batches, ...]`` for steps ``start, start + 1, ...``, each
    read in a background thread while the previous step runs."""

    def __init__(self, rows: TokenRows, order: BatchOrder, micro_batches: int, start: int):
        self.rows, self.order, self.micro = rows, order, micro_batches
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._next = self._pool.submit(self._read, start)
        self._step = start

    def _read(self, step: int) -> dict:
        batch = self.rows.rows(self.order.indices(step))
        return {k: v.reshape((self.micro, v.shape[0] // self.micro) + v.shape[1:]) for k, v in batch.items()}

    def next(self) -> dict:
        batch = self._next.result()
        self._step += 1
        self._next = self._pool.submit(self._read, self._step)
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data", description="Tokenise a training config's data.")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        train_rows, eval_rows = load_rows(config, TargetConfig.from_dir(config.target.path))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"train: {len(train_rows)} rows of {config.data.seq_len} tokens"
          + (f"; eval: {len(eval_rows)} rows" if eval_rows is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
