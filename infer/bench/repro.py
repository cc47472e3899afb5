"""Reproducibility across processes: the same greedy ``generate()`` calls in several fresh processes, compared.

    python -m infer.bench repro --out DIR --target DIR --draft DIR --prompts dev.jsonl [--processes 3] [--gpus 2]
    python -m infer.bench repro --out DIR --target DIR --draft DIR --time [--pad-script pad_model.py]
    python -m infer.bench repro --out DIR --smoke

Each child process loads the pair in bf16 and runs plain and speculative greedy ``generate()`` (batch 1,
``--new-tokens``) on the same seeded prompt windows of each context length, once per ``--modes`` entry
(``reproducible=False`` / ``True``), and writes its tokens. The parent starts ``--processes`` children at once
(round-robin over ``--gpus`` GPUs, no memory preallocation) and reports, per mode, method and context, how many
prompts gave the same tokens in every process and the first position where two processes differ.
``--options JSON`` replaces ``infer.generate.REPRODUCIBLE_OPTIONS`` in the children (to try a candidate fix).

``--time``: one process instead times ``generate()`` (compiled; median of ``--reps`` calls, prefill included)
plain and speculative, reproducible off and on, on one prompt per context: the speed cost of the fix.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys

import numpy as np

from infer.bench.drafts import prompt_windows
from infer.bench.harness import add_sized_args, arg_parser, finish, log, md_header, md_row, median_call, parse_sized
from infer.main import positive_ints_arg
from infer.bench.near_tie import first_divergence
from infer.bench.spec_inputs import pad_pair

MODES = {"off": False, "on": True}  # --modes name -> generate(reproducible=...)
DEFAULTS = dict(contexts=(4096, 16384), num_prompts=5, new_tokens=128)
SMOKE = dict(contexts=(40,), num_prompts=2, new_tokens=8)


def load_pair(args):
    """(target, draft, docs): the bf16 pair and the prompt documents as token lists."""
    import jax.numpy as jnp

    from longspec_jax import load_draft, load_target

    if args.smoke:
        from longspec_jax.testing import random_draft, tiny_target
        target = tiny_target(0)
        rng = np.random.default_rng(0)
        return target, random_draft(1), [rng.integers(0, target.config.vocab_size, 300).tolist() for _ in range(3)]
    target_dir, draft_dir = args.target, args.draft
    if args.pad_script:
        target_dir, padded = pad_pair(args.target, {"draft": args.draft}, args.pad_script, args.work)
        draft_dir = padded["draft"]
    target = load_target(target_dir, dtype=jnp.bfloat16)
    with open(args.prompts) as f:
        docs = [target.tokenizer(json.loads(line)["text"])["input_ids"] for line in f if line.strip()]
    return target, load_draft(draft_dir, target), docs


def child(args) -> dict:
    """Tokens of every (mode, method, context, prompt) in this process."""
    gen = importlib.import_module("infer.generate")
    if args.options:
        gen.REPRODUCIBLE_OPTIONS = json.loads(args.options)
    target, draft, docs = load_pair(args)
    out = {}
    for mode in args.modes:
        for method, d in (("plain", None), ("speculative", draft)):
            for context in args.contexts:
                out[f"{mode}/{method}/{context}"] = [
                    gen.generate(target, [p], draft=d, max_new_tokens=args.new_tokens, eos_token_id=[],
                                 reproducible=MODES[mode]).tokens[0].tolist()
                    for p in prompt_windows(docs, context, args.num_prompts, args.seed)]
    return out


def spawn_children(args, argv: list[str]) -> list[dict]:
    """Runs ``args.processes`` children at once and returns their token dicts."""
    procs, paths = [], []
    for i in range(args.processes):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        if args.gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i % args.gpus)
        paths.append(os.path.join(args.out, f"child{i}.json"))
        procs.append(subprocess.Popen([sys.executable, "-m", "infer.bench", "repro", *argv, "--child", paths[-1]],
                                      env=env))
    for i, proc in enumerate(procs):
        if proc.wait():
            raise RuntimeError(f"child {i} failed with exit code {proc.returncode}")
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
        os.remove(path)
    return results


def compare(children: list[dict]) -> dict:
    """Per key: prompts equal in every process, and each prompt's first position where a process differs from
    the first (None when all agree)."""
    report = {}
    for key in children[0]:
        firsts = []
        for i, tokens in enumerate(children[0][key]):
            found = [first_divergence(c[key][i], tokens) for c in children[1:]]
            found = [f for f in found if f is not None]
            firsts.append(min(found) if found else None)
        report[key] = dict(same=sum(f is None for f in firsts), prompts=len(firsts), first_difference=firsts)
    return report


def time_modes(args) -> dict:
    """Seconds per ``generate()`` call (median of ``reps`` after a compile call), per mode, method, context."""
    gen = importlib.import_module("infer.generate")
    target, draft, docs = load_pair(args)
    report = {}
    for context in args.contexts:
        prompt = prompt_windows(docs, context, 1, args.seed)[0]
        for method, d in (("plain", None), ("speculative", draft)):
            for mode in args.modes:
                def call():
                    return gen.generate(target, [prompt], draft=d, max_new_tokens=args.new_tokens,
                                        eos_token_id=[], reproducible=MODES[mode])
                call()
                seconds, _ = median_call(call, args.reps)
                report[f"{mode}/{method}/{context}"] = dict(seconds=seconds, tokens_per_s=args.new_tokens / seconds)
                log(f"ctx {context} {method} reproducible={mode}: {seconds * 1e3:.1f} ms")
    return report


def markdown(results: dict) -> str:
    if results["kind"] == "time":
        lines = md_header(["mode/method/context", "ms per generate()", "tokens/s"])
        lines += [md_row([k, f"{v['seconds'] * 1e3:.1f}", f"{v['tokens_per_s']:.1f}"])
                  for k, v in results["rows"].items()]
    else:
        lines = md_header(["mode/method/context", "prompts equal in all processes", "first differences"])
        lines += [md_row([k, f"{v['same']}/{v['prompts']}", [f for f in v["first_difference"] if f is not None]])
                  for k, v in results["rows"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = arg_parser("repro", __doc__, "tiny random pair on the CPU")
    p.add_argument("--target", help="HF directory of the target")
    p.add_argument("--draft", help="LongSpec draft directory")
    p.add_argument("--prompts", help="jsonl of prompt documents (a 'text' field each)")
    add_sized_args(p, (("contexts", positive_ints_arg, "prompt lengths"),
                       ("num-prompts", int, "prompt windows per context"),
                       ("new-tokens", int, "tokens per generation")), DEFAULTS, SMOKE)
    p.add_argument("--modes", default="off,on", help="reproducible off / on, comma-separated")
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--gpus", type=int, default=1, help="spread the children over this many GPUs")
    p.add_argument("--options", default="", help="JSON XLA options to use as REPRODUCIBLE_OPTIONS")
    p.add_argument("--time", action="store_true", help="time the modes in this process instead")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-script", help="pad target and draft to 8B cost with this pad_model.py first (--time)")
    p.add_argument("--work", default="/tmp/longspec_drafts", help="where padded models are written (reused)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: write this process's tokens to this file
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    args.modes = args.modes.split(",")
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown --modes {sorted(unknown)}; choose from {list(MODES)}")
    if not args.smoke and not (args.target and args.draft and args.prompts):
        p.error("--target, --draft and --prompts are required (or --smoke)")
    if args.child:
        with open(args.child, "w") as f:
            json.dump(child(args), f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = dict(date=datetime.date.today().isoformat(), argv=argv, options=args.options or None,
                   kind="time" if args.time else "processes")
    results["rows"] = time_modes(args) if args.time else compare(spawn_children(args, argv))
    return finish(args.out, "repro", results, markdown(results))
