"""Measure how often a draft's tree children are accepted, by tree kind, temperature, depth and sibling rank, and
store it beside the draft as ``speculation_profile.json``, from which ``generate`` chooses how to speculate:

    python -m infer.calibrate --target DIR --draft DIR --prompts corpus/dev.jsonl --context 16384

Speculative decoding runs on prompt windows cut from the documents (a jsonl ``text`` field, or plain text
files) with wide probe trees: the draft's top-k beams at T = 0, trees sampled from the draft at each T > 0.
Every round's walk adds, for each depth it visited, which sibling ranks it tried and which it accepted
(:func:`longspec_jax.tree.rank_outcomes`); the profile holds their ratios
(:func:`longspec_jax.speculation_profile.profile_from_counts`). The output is the target's own whatever the rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from infer.generate import generate
from longspec_jax.speculation_profile import SpeculationProfile, profile_from_counts, save_profile
from longspec_jax.tree import SAMPLING_KINDS

PROBE_SHAPE = (8, 8, 8, 8, 8, 8)  # six levels of eight: up to eight ranks tried at the nodes the walk visits


def prompt_windows(docs: list[list[int]], context: int, count: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``context`` tokens at seeded random (document, offset) places."""
    rng = np.random.default_rng([seed, context])
    long_docs = [d for d in docs if len(d) >= context]
    if not long_docs:
        raise ValueError(f"no prompt document has {context} tokens")
    windows = []
    for _ in range(count):
        doc = long_docs[int(rng.integers(len(long_docs)))]
        start = int(rng.integers(len(doc) - context + 1))
        windows.append(doc[start:start + context])
    return windows


def read_documents(path: str, field: str = "text") -> list[str]:
    """The documents of a jsonl file (``field`` of each line) or of a plain text file (the whole file)."""
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path} does not exist")
    with open(path) as f:
        if not path.endswith(".jsonl"):
            return [f.read()]
        try:
            return [json.loads(line)[field] for line in f if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: every line must be a JSON object with a {field!r} field ({e})") from None


def calibrate(target, draft, prompts: list[list[int]], temperatures, kinds=SAMPLING_KINDS[:1], new_tokens: int = 128,
              batch: int = 4, seed: int = 0, progress=None) -> SpeculationProfile:
    """The draft's profile over ``prompts``: beams at T = 0, each sampled ``kind`` at each T > 0."""
    counts, taus = {}, []
    for temperature in temperatures:
        for kind in (["beams"] if temperature == 0 else list(kinds)):
            tried = accepted = 0
            tokens = passes = 0
            for start in range(0, len(prompts), batch):
                out = generate(target, prompts[start:start + batch], draft=draft, max_new_tokens=new_tokens,
                               temperature=temperature, tree_shape=PROBE_SHAPE, eos_token_id=[], seed=seed + start,
                               draft_sampling=False if kind == "beams" else kind)
                tried, accepted = tried + out.rank_tried, accepted + out.rank_accepted
                tokens += int(out.num_generated.sum())
                passes += int(out.num_rounds.sum()) + len(out.num_rounds)  # the prefill pass emits one token too
                if progress:
                    progress(f"{kind} T={temperature:g}: {min(start + batch, len(prompts))}/{len(prompts)} prompts, "
                             f"tau {tokens / passes:.3f}")
            counts[(kind, float(temperature))] = (tried, accepted)
            taus.append((f"{kind} T={temperature:g}", round(tokens / passes, 3)))
    context = max(len(p) for p in prompts)
    profile = profile_from_counts(counts, f"calibrated on {len(prompts)} prompts of {context} tokens, "
                                          f"{new_tokens} new tokens each")
    return dataclasses.replace(profile, probe_tau=tuple(taus))


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return values


def _kinds(text: str) -> list[str]:
    kinds = text.split(",")
    bad = [k for k in kinds if k not in SAMPLING_KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown kind {bad[0]!r}; choose from {', '.join(SAMPLING_KINDS)}")
    return kinds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (HF Llama / Qwen2)")
    p.add_argument("--draft", required=True, help="LongSpec draft directory")
    p.add_argument("--prompts", required=True, help="documents: a .jsonl file (text field) or a text file")
    p.add_argument("--context", type=int, default=4096, help="prompt window length in tokens (default 4096)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompt windows (default 16)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--batch", type=int, default=4, help="prompts per generate call (default 4)")
    p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0], help="comma-separated (default 0,1)")
    p.add_argument("--kinds", type=_kinds, default=list(SAMPLING_KINDS[:1]),
                   help=f"sampled-tree kinds to measure at T > 0 (default {SAMPLING_KINDS[0]})")
    p.add_argument("--draft-vocab", metavar="FILE|full",
                   help="propose only from the sorted token ids of this .npy file (a draft vocabulary), or from the "
                        "full vocabulary despite the draft's own draft_vocab.npy")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for speculation_profile.json (default: the draft directory)")
    args = p.parse_args(argv)
    for name in ("context", "num_prompts", "new_tokens", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")

    import jax.numpy as jnp

    from infer.main import load_draft_arg
    from longspec_jax import load_target

    try:
        target = load_target(args.target, dtype=getattr(jnp, args.dtype))
        draft = load_draft_arg(args.draft, target, args.draft_vocab, prog="infer.calibrate")
        if target.tokenizer is None:
            raise ValueError(f"{args.target} has no tokenizer to read the prompts with")
        docs = [target.tokenizer(text)["input_ids"] for text in read_documents(args.prompts)]
        prompts = prompt_windows(docs, args.context, args.num_prompts, args.seed)
    except ValueError as e:
        p.error(str(e))
    profile = calibrate(target, draft, prompts, args.temperatures, args.kinds, args.new_tokens, args.batch,
                        args.seed, progress=lambda line: print(line, file=sys.stderr, flush=True))
    path = save_profile(profile, args.out or args.draft)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
