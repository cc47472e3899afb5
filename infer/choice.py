"""What ``generate`` would choose for a pair when ``tree_shape`` and ``draft_sampling`` are left open, per
temperature and batch, as a table; read from the target's ``config.json`` and the draft's stored profile and
vocabulary, without loading weights:

    python -m infer.choice --target DIR --draft DIR --context 16384 --batches 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import os
import sys

from infer.speculation import DEFAULT_DEVICE, DEVICE_MODELS, DeviceModel, choose
from longspec_jax.config import TargetConfig
from longspec_jax.draft_vocab import load_draft_vocab
from longspec_jax.sampling import SamplingConfig
from longspec_jax.speculation_profile import DEFAULT_PROFILE, SpeculationProfile, load_profile


def speculation_table(config: TargetConfig, profile: SpeculationProfile | None, temperatures, batches,
                      context: int, device: DeviceModel | None = None,
                      draft_vocab_size: int | None = None) -> list[dict]:
    """``choose`` over temperatures x batches, as rows for a table: what auto does for one pair of models."""
    rows = []
    for t in temperatures:
        for b in batches:
            s = choose(config, profile, SamplingConfig(temperature=t), b, context, device=device,
                       draft_vocab_size=draft_vocab_size)
            rows.append({"temperature": t, "batch": b, "tree_shape": s.tree_shape, "draft_sampling": s.draft_sampling,
                         "expected_tokens": None if s.expected_tokens is None else round(s.expected_tokens, 3),
                         "predicted_speedup": None if s.predicted_speedup is None else round(s.predicted_speedup, 3)})
    return rows


def _table_markdown(rows: list[dict]) -> str:
    lines = ["| T | batch | tree_shape | draft_sampling | tokens per round | predicted speedup |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        shape = "plain" if r["tree_shape"] is None else ",".join(map(str, r["tree_shape"]))
        lines.append(f"| {r['temperature']:g} | {r['batch']} | {shape} | {r['draft_sampling'] or 'beams'} | "
                     f"{r['expected_tokens']:.2f} | {r['predicted_speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.choice",
                                description="Print what generate() chooses when tree_shape and draft_sampling are "
                                            "left open, per temperature and batch.")
    p.add_argument("--target", required=True, help="target model directory (its config.json is read)")
    p.add_argument("--draft", help="draft directory (its speculation_profile.json and draft_vocab.npy are read; "
                                   "default: the default rates)")
    p.add_argument("--context", type=int, default=16384, help="tokens of context (default 16384)")
    p.add_argument("--batches", default="1,2,4,8,16", help="comma-separated (default 1,2,4,8,16)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--device", choices=sorted(DEVICE_MODELS), default=DEFAULT_DEVICE,
                   help=f"the device model (default {DEFAULT_DEVICE})")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError as e:
        p.error(f"--batches and --temperatures take comma-separated numbers ({e})")
    if args.context < 1 or min(batches) < 1 or min(temperatures) < 0:
        p.error("--context and --batches must be positive and --temperatures >= 0")
    try:
        config = TargetConfig.from_dir(args.target)
        if args.draft and not os.path.isdir(args.draft):
            raise ValueError(f"draft directory not found: {args.draft}")
        profile = load_profile(args.draft) if args.draft else None
        vocab = load_draft_vocab(args.draft, config.vocab_size) if args.draft else None
    except ValueError as e:
        p.error(str(e))
    device = DEVICE_MODELS[args.device]
    rows = speculation_table(config, profile, temperatures, batches, args.context, device,
                             None if vocab is None else len(vocab))
    source = (profile or DEFAULT_PROFILE).source
    print(f"{device.name} cost model, context {args.context}, rates: {source}"
          + ("" if vocab is None else f", draft vocabulary of {len(vocab)}"))
    print(_table_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
