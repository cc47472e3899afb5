"""Training configuration: typed dataclasses, filled from a YAML file and ``dotted.key=value`` overrides.

OmegaConf (structured configs) does the merging and type conversion; this module turns its errors into
:class:`longspec_jax.errors.ConfigError` messages that name the key (with a close-match hint for unknown keys)
and checks what OmegaConf cannot: files that must exist, values in range, batch sizes that divide.
Keys without a default (``???``) must be given. Defaults of the recipe equal the PyTorch LongSpec reference's.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import jax.numpy as jnp
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from longspec_jax.errors import ConfigError

DATA_FORMATS = ("text", "prompt_answer")
VOCAB_LOSSES = ("full", "subset")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}  # config name -> dtype
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


@dataclasses.dataclass
class TargetSection:
    path: str = MISSING             # HF directory of the frozen target (config.json, *.safetensors, tokenizer)
    dtype: str = "bfloat16"         # dtype of the target's weights and forward


@dataclasses.dataclass
class DataSection:
    train: list[str] = MISSING      # jsonl / json / parquet / txt files
    eval: list[str] = dataclasses.field(default_factory=list)  # held-out files for the periodic evaluation
    format: str = "text"            # "text": documents; "prompt_answer": loss on the answer only
    text_field: str = "text"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    seq_len: int = 1024             # tokens per row
    pack: bool = True               # text: concatenate documents (EOS between them) and cut into full rows
    append_eos: bool = True         # EOS after each document / answer
    eos_is_target: bool = False     # the reference's stage-1 data never trains EOS (its pad id is the EOS)
    eval_rows: int = 64             # rows of the eval files used by each evaluation
    cache_dir: str = ""             # tokenised-data cache ("" = <checkpoint.dir>/data_cache)
    num_proc: int = 0               # tokeniser processes (0 = one per CPU core, at most 16)


@dataclasses.dataclass
class DraftSection:
    window: int = 512               # self-attention window
    init: str = ""                  # start from this draft (LongSpec HF dir, .pth, or a training checkpoint dir)
    vocab_size: int = 0             # K > 0: the K most frequent trained-on tokens as the draft vocabulary
                                    # (checkpoint.dir/draft_vocab.npy, exported with the draft); 0: none
    vocab_loss: str = "full"        # "full": the loss over every token; "subset": over the K of vocab_size


@dataclasses.dataclass
class AnchorSection:
    """Anchor-offset position indices (the LongSpec recipe), drawn per sequence."""

    enabled: bool = True
    max_anchors: int = 4            # anchor count drawn from 0..max_anchors
    offset_ceiling: int | None = 30000  # offset drawn from 0..min(ceiling, max_positions - margin) - length;
                                        # null: the target's whole window, max_positions - margin
    context_margin: int = 1000
    length_threshold: int = 1200    # sequences longer than this keep plain positions


@dataclasses.dataclass
class NoiseSection:
    """Flash noisy training (the LongSpec recipe): the query at t sees target K/V at 0..t-s, s in 1..max_shift."""

    max_shift: int = 4


@dataclasses.dataclass
class LossSection:
    kl_weight: float = 0.0          # weight of KL(target || draft) next to the data cross-entropy
    chunk_tokens: int = 4096        # tokens per LM-head chunk (logits never exist for more at once)


@dataclasses.dataclass
class TrainSection:
    steps: int = MISSING
    batch_size: int = MISSING       # rows per optimizer step, over all devices
    grad_accum: int = 1             # micro-batches per step
    seed: int = 0
    compute_dtype: str = "bfloat16"  # draft compute dtype (master weights and optimizer state are float32)
    log_every: int = 10
    eval_every: int = 0             # 0: evaluate only after the last step (when data.eval is set)
    peak_tflops: float = 0.0        # per device, for model-FLOPs utilisation (0: the device's datasheet bf16 peak)


@dataclasses.dataclass
class OptimSection:
    lr: float = MISSING
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 1e-4      # cosine decays to lr * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-6
    weight_decay: float = 0.1       # on matrices only (not on norms and biases)
    clip: float = 1.0


@dataclasses.dataclass
class CheckpointSection:
    dir: str = MISSING
    every: int = 500
    keep: int = 3
    async_save: bool = True


@dataclasses.dataclass
class MeshSection:
    data: int = 0                   # data-parallel axis (0: all devices / fsdp)
    fsdp: int = 1                   # parameter (and optimizer state) sharding axis


@dataclasses.dataclass
class LogSection:
    tensorboard: bool = True
    progress: bool = True           # a progress bar on stderr


@dataclasses.dataclass
class TrainConfig:
    target: TargetSection = dataclasses.field(default_factory=TargetSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    draft: DraftSection = dataclasses.field(default_factory=DraftSection)
    anchor: AnchorSection = dataclasses.field(default_factory=AnchorSection)
    noise: NoiseSection = dataclasses.field(default_factory=NoiseSection)
    loss: LossSection = dataclasses.field(default_factory=LossSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """``path`` (YAML) merged over the defaults, then ``overrides`` (``dotted.key=value``); validated."""
    merged = OmegaConf.structured(TrainConfig)
    layers = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as e:  # yaml errors of several types
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        layers.append(OmegaConf.from_dotlist([item]))
    try:
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _config_error(e) from None
    validate(config)
    return config


def _config_error(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    if isinstance(e, MissingMandatoryValue):
        return ConfigError(f"missing required config value {key}")
    if isinstance(e, ConfigKeyError):
        parent, _, name = key.rpartition(".")
        known = _known_keys(parent)
        hint = difflib.get_close_matches(name, known, n=1)
        where = f"section {parent!r}" if parent else "the top level"
        suggestion = f"; did you mean {'.'.join(filter(None, [parent, hint[0]]))}?" if hint else ""
        return ConfigError(f"unknown config key {key}{suggestion} (keys of {where}: {', '.join(known)})")
    if isinstance(e, ValidationError):
        first = str(e).splitlines()[0]
        return ConfigError(f"bad value for {key}: {first}")
    return ConfigError(f"config error at {key}: {str(e).splitlines()[0]}")


def _known_keys(section: str) -> list[str]:
    node: Any = TrainConfig
    for part in filter(None, section.split(".")):
        fields = {f.name: f for f in dataclasses.fields(node)}
        node = fields[part].default_factory if part in fields else None
        if node is None:
            return []
    return [f.name for f in dataclasses.fields(node)]


def config_to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def validate(c: TrainConfig) -> None:
    """Checks that cannot be expressed as types: files exist, values in range, sizes divide."""
    if not os.path.isfile(os.path.join(c.target.path, "config.json")):
        raise ConfigError(f"target.path: no HF model directory (config.json) at {c.target.path!r}")
    for key in ("train", "eval"):
        files = getattr(c.data, key)
        if key == "train" and not files:
            raise ConfigError("data.train: give at least one file")
        for f in files:
            if not os.path.isfile(f):
                raise ConfigError(f"data.{key}: file not found: {f}")
            if not f.endswith(DATA_SUFFIXES):
                raise ConfigError(f"data.{key}: {f} has an unsupported type; use {', '.join(DATA_SUFFIXES)}")
    if c.draft.init and not os.path.exists(c.draft.init):
        raise ConfigError(f"draft.init: not found: {c.draft.init}")
    _choice("data.format", c.data.format, DATA_FORMATS)
    _choice("target.dtype", c.target.dtype, tuple(DTYPES))
    _choice("train.compute_dtype", c.train.compute_dtype, tuple(DTYPES))
    _choice("draft.vocab_loss", c.draft.vocab_loss, VOCAB_LOSSES)
    if c.draft.vocab_loss == "subset" and c.draft.vocab_size < 1:
        raise ConfigError("draft.vocab_loss subset needs a draft vocabulary: set draft.vocab_size > 0")
    for key, value, low in (("data.seq_len", c.data.seq_len, 2), ("train.steps", c.train.steps, 1),
                            ("train.batch_size", c.train.batch_size, 1), ("train.grad_accum", c.train.grad_accum, 1),
                            ("train.log_every", c.train.log_every, 1), ("checkpoint.every", c.checkpoint.every, 1),
                            ("checkpoint.keep", c.checkpoint.keep, 1), ("draft.window", c.draft.window, 1),
                            ("noise.max_shift", c.noise.max_shift, 1), ("loss.chunk_tokens", c.loss.chunk_tokens, 1),
                            ("anchor.max_anchors", c.anchor.max_anchors, 0),
                            ("anchor.context_margin", c.anchor.context_margin, 0), ("mesh.data", c.mesh.data, 0),
                            ("mesh.fsdp", c.mesh.fsdp, 1), ("train.eval_every", c.train.eval_every, 0),
                            ("data.eval_rows", c.data.eval_rows, 1), ("data.num_proc", c.data.num_proc, 0),
                            ("draft.vocab_size", c.draft.vocab_size, 0)):
        if value < low:
            raise ConfigError(f"{key} must be >= {low}, got {value}")
    if c.anchor.offset_ceiling is not None and c.anchor.offset_ceiling < 1:
        raise ConfigError(f"anchor.offset_ceiling must be a positive integer, or null for the target's whole window, "
                          f"got {c.anchor.offset_ceiling}")
    if not c.optim.lr > 0:
        raise ConfigError(f"optim.lr must be positive, got {c.optim.lr}")
    if not 0 <= c.optim.warmup_ratio < 1:
        raise ConfigError(f"optim.warmup_ratio must be in [0, 1), got {c.optim.warmup_ratio}")
    if c.loss.kl_weight < 0:
        raise ConfigError(f"loss.kl_weight must be >= 0, got {c.loss.kl_weight}")
    if c.train.batch_size % c.train.grad_accum:
        raise ConfigError(f"train.batch_size {c.train.batch_size} is not a multiple of train.grad_accum "
                          f"{c.train.grad_accum}")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
