"""Export a draft from an Orbax training checkpoint to a PyTorch LongSpec format.

    python -m train.export --checkpoint DIR --out OUT --format hf|pth [--step N] [--dtype float32|bfloat16|float16]

``hf`` writes ``OUT/model.safetensors`` + ``OUT/config.json`` (load with ``LlamaGlideDecoderLayer.from_pretrained``
/ ``Qwen2GlideDecoderLayer.from_pretrained``, or ``longspec_jax.load_draft``); ``pth`` writes
``OUT/draft_model_weights.pth`` (the training code's format) and the same ``config.json``. The target config
comes from the checkpoint's metadata, so the target's weights are not needed. Without ``--step`` the newest
complete step is exported. A draft vocabulary the run chose (``DIR/draft_vocab.npy``) is copied beside the
weights.
"""

from __future__ import annotations

import argparse
import os
import sys

from longspec_jax.draft_io import EXPORT_DTYPES, FORMATS, save_draft
from longspec_jax.draft_vocab import load_draft_vocab, save_draft_vocab
from train.checkpointing import restore_checkpoint


def export_checkpoint(checkpoint: str, out: str, format: str = "hf", step: int | None = None,
                      dtype: str = "float32") -> str:
    """Exports one training checkpoint; returns the path of the written weights file."""
    ckpt = restore_checkpoint(checkpoint, step, restore_opt_state=False)
    path = save_draft(ckpt.to_draft(), out, format=format, dtype=dtype)
    ids = load_draft_vocab(checkpoint, ckpt.target_config["vocab_size"])
    if ids is not None:
        save_draft_vocab(ids, os.path.dirname(path))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="Orbax training checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", choices=FORMATS, default="hf", help="hf: config.json + model.safetensors; "
                        "pth: draft_model_weights.pth (default: hf)")
    parser.add_argument("--step", type=int, default=None, help="step to export (default: the newest complete)")
    parser.add_argument("--dtype", choices=tuple(EXPORT_DTYPES), default="float32",
                        help="dtype of the written weights (default: float32, like the released drafts)")
    args = parser.parse_args(argv)
    try:
        path = export_checkpoint(args.checkpoint, args.out, args.format, args.step, args.dtype)
    except ValueError as e:  # CheckpointError, WeightsError, ConfigError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
