"""Tiny training setups built in the test: a byte-level BPE tokenizer, a random HF Llama target saved with it,
a structured text corpus (so that a draft can learn something in a few steps), and config files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0..3, as in the code-LM fixture


def corpus_lines(count: int, seed: int) -> list[str]:
    """Python-like documents with a regular structure."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        lines = []
        for _ in range(int(rng.integers(3, 8))):
            n = int(rng.integers(0, 50))
            op = ["+", "-", "*"][int(rng.integers(0, 3))]
            lines.append(f"def f_{n}(x):\n    return x {op} {n}\n")
        docs.append("\n".join(lines))
    return docs


def build_tokenizer(path: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(200, seed=99), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def build_target_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """A random float32 Llama (hidden 64, 2 layers, GQA 4/2) with a tokenizer, saved as an HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                  initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).float().eval()
    model.save_pretrained(path)
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({field: t}) + "\n")
    return path


def write_config(path: Path, target: Path, train_files: list[Path], ckpt: Path, **sections) -> Path:
    """A small config: seq_len 64, batch 8, 20 steps, lr 3e-3, checkpoints every 5 steps."""
    config = {
        "target": {"path": str(target), "dtype": "float32"},
        "data": {"train": [str(p) for p in train_files], "seq_len": 64},
        "train": {"steps": 20, "batch_size": 8, "seed": 0, "compute_dtype": "float32", "log_every": 1},
        "optim": {"lr": 3e-3},
        "checkpoint": {"dir": str(ckpt), "every": 5, "async_save": False},
        "log": {"tensorboard": False, "progress": False},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(config))
    return path
