"""The GPU measurements of speculation's choices, draft vocabularies and long contexts, as one resumable run.

    python -m tools.evidence --out DIR --pad-script pad_model.py --corpus CORPUS [--steps NAME,...] [--deadline S]
    python -m tools.evidence --out DIR --pad-script pad_model.py --corpus CORPUS --list

CORPUS is the fixture builder's corpus export (``make_code_lm.py --export-corpus CORPUS``): ``dev.jsonl`` gives the
prompts, ``train.jsonl`` the token counts of the draft vocabulary. The target is the embedded default model padded
to 8B cost by ``--pad-script`` (the draft with it), or ``--fixture`` / ``--draft``. Every step is one command of the
project's own benchmarks writing ``DIR/STEP``:

- ``draft_level_llama3``: a draft level at Llama-3-8B shapes, full vocabulary against K = 32,768 and 16,384;
- ``vocab_tokens``: the padded pair's tokens/s with the draft's K = 8,192 most frequent training tokens against
  the full vocabulary (auto, T = 0 and 1, batches 1 and 8);
- ``auto_tT_bB``: auto against plain and the shapes it competes with, at 16k, T = 0 and 1, batches 1 to 16;
- ``long_output`` / ``long_output_t0``: a 2k prompt with 16,384 generated tokens at T = 0.6 / 0;
  ``long_128k``: two 128k prompts (llama3-style RoPE scaling by 8), T = 1 and 0.

Steps run in the order given; one starts only where its estimated time (on an H100) fits in what is left of
``--deadline`` and runs under the rest of it. A step that completed before (``DIR/STEP/step.json`` with rc 0) is not
run again, so the same command resumes a run cut short. ``DIR/evidence.json`` / ``.md`` list every step's command,
exit status and seconds. Subprocesses get ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` unless it is set: batch 4 at 64k
needs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, NamedTuple

from infer.bench.harness import log, md_header, md_row, write_report
from infer.main import DEFAULT_MODEL
from longspec_jax.draft_vocab import VOCAB_NAME

ROPE_128K = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
             "original_max_position_embeddings": 16384}
VOCAB_K = 8192


class Step(NamedTuple):
    name: str
    seconds: int                                  # estimated on an H100
    argv: list[str]                               # after ``python -m``
    prepare: Callable[[], None] | None = None     # run first, in this process


def plan(args) -> list[Step]:
    """Every step, in the default order: the draft vocabulary's cost and gain, auto's cells (batch 1 and 8 at T = 1
    last), long contexts."""
    dev, work = os.path.join(args.corpus, "dev.jsonl"), args.work
    tasks = ["infer.bench", "tasks", "--target", args.fixture, "--pad-script", args.pad_script, "--repo-docs", dev,
             "--work", os.path.join(work, "padded"), "--reps", "1"]
    vocab_draft = os.path.join(work, f"draft_k{VOCAB_K}")

    def out(name):
        return ["--out", os.path.join(args.out, name)]

    def with_vocab():
        if not os.path.isfile(os.path.join(vocab_draft, VOCAB_NAME)):
            shutil.copytree(args.draft, vocab_draft, dirs_exist_ok=True)
            subprocess.run([sys.executable, "-m", "train.vocab", "--target", args.fixture, "--data",
                            os.path.join(args.corpus, "train.jsonl"), "--size", str(VOCAB_K), "--out", vocab_draft],
                           check=True)

    steps = [Step("draft_level_llama3", 240, ["tools.profile", *out("draft_level_llama3"), "--model", "llama3-8b",
                                              "--contexts", "16384", "--reps", "20", "--draft-vocabs", "32768,16384",
                                              "--phases", "draft_step0,tree_level2"]),
             Step("vocab_tokens", 420, [*tasks, *out("vocab_tokens"), "--drafts",
                                        f"ours={args.draft},k{VOCAB_K}={vocab_draft}", "--methods", "plain,auto",
                                        "--buckets", "8192-16384", "--per-bucket", "8", "--batch-sizes", "1,8",
                                        "--temperatures", "0,1", "--new-tokens", "128"], with_vocab)]
    for t, b in [(0, 1), (0, 8), (1, 2), (1, 4), (1, 16), (0, 2), (0, 4), (0, 16), (1, 1), (1, 8)]:
        rivals = ["--methods", "plain,auto,tree,chain", "--tree-shapes", "4,16,16,16,16"] if t == 0 else [
            "--methods", "plain,auto,stree,schain", "--sampled-shapes", "4,7,7,5"]
        steps.append(Step(f"auto_t{t}_b{b}", 260 if b == 16 else 210,
                          [*tasks, *out(f"auto_t{t}_b{b}"), "--drafts", f"ours={args.draft}", *rivals, "--buckets",
                           "8192-16384", "--per-bucket", str(max(b, 4)), "--batch-sizes", str(b),
                           "--temperatures", str(t), "--new-tokens", "128"]))
    long = [*tasks, "--drafts", f"ours={args.draft}", "--methods", "plain,auto", "--batch-sizes", "1", "--ignore-eos"]
    steps += [Step(name, 480, [*long, *out(name), "--buckets", "1536-2048", "--min-tokens", "0", "--per-bucket",
                               "1", "--new-tokens", "16384", "--temperatures", t])
              for name, t in (("long_output", "0.6"), ("long_output_t0", "0"))]
    steps += [Step("long_128k", 360, [*long, *out("long_128k"), "--rope-parameters", json.dumps(ROPE_128K),
                                      "--buckets", "122880-129072", "--per-bucket", "2", "--new-tokens", "256",
                                      "--temperatures", "1,0"])]
    return steps


def run_step(step: Step, out_dir: str, seconds_left: float) -> dict:
    """One step under ``seconds_left``: its command's exit status (``timeout`` where it ran out) and seconds,
    also written to ``out_dir/STEP/step.json``; its output in ``log.txt`` there."""
    step_dir = os.path.join(out_dir, step.name)
    os.makedirs(step_dir, exist_ok=True)
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        if step.prepare:
            step.prepare()
        with open(os.path.join(step_dir, "log.txt"), "w", encoding="utf-8") as f:
            rc = subprocess.run([sys.executable, "-m", *step.argv], stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=seconds_left).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    except (OSError, subprocess.CalledProcessError) as e:
        rc = f"prepare failed: {e}"
    record = dict(step=step.name, command="python -m " + " ".join(step.argv), rc=rc,
                  seconds=round(time.perf_counter() - t0, 1))
    with open(os.path.join(step_dir, "step.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return record


def completed(out_dir: str, name: str) -> dict | None:
    """The record of a step that ran to rc 0 before, or None."""
    path = os.path.join(out_dir, name, "step.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    return record if record.get("rc") == 0 else None


def run(steps: list[Step], out_dir: str, deadline_s: float) -> list[dict]:
    """The steps in order under one deadline: a step done before is kept, one whose estimate does not fit what is
    left is not started (``rc: not started``), the rest run."""
    t0, records = time.perf_counter(), []
    for step in steps:
        left = deadline_s - (time.perf_counter() - t0)
        record = completed(out_dir, step.name)
        if record:
            log(f"{step.name}: done before ({record['seconds']} s)")
        elif step.seconds > left:
            record = dict(step=step.name, command="python -m " + " ".join(step.argv), rc="not started", seconds=0)
            log(f"{step.name}: not started (about {step.seconds} s, {left:.0f} s left)")
        else:
            log(f"{step.name}: running (about {step.seconds} s, {left:.0f} s left)")
            record = run_step(step, out_dir, left)
            log(f"{step.name}: rc {record['rc']} in {record['seconds']} s")
        records.append(record)
    return records


def markdown(records: list[dict]) -> str:
    lines = md_header(["step", "rc", "seconds", "command"])
    return "\n".join(lines + [md_row([r["step"], r["rc"], r["seconds"], f"`{r['command']}`"]) for r in records])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.evidence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="one directory per step, and evidence.json / .md")
    p.add_argument("--pad-script", required=True, help="pad_model.py, beside the project's test fixtures")
    p.add_argument("--corpus", required=True, help="the corpus export's directory (dev.jsonl, train.jsonl)")
    p.add_argument("--fixture", default=str(DEFAULT_MODEL / "target"),
                   help="the small target (default: the embedded model)")
    p.add_argument("--draft", default=str(DEFAULT_MODEL / "draft"), help="its draft (default: the embedded model's)")
    p.add_argument("--work", default="/tmp/evidence_work", help="the padded pair and the vocabulary's draft")
    p.add_argument("--steps", help="names, comma-separated, in the order to run (default: all)")
    p.add_argument("--deadline", type=float, default=float("inf"), help="seconds for the whole run")
    p.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    args = p.parse_args(argv)
    steps = {s.name: s for s in plan(args)}
    names = args.steps.split(",") if args.steps else list(steps)
    unknown = [n for n in names if n not in steps]
    if unknown:
        p.error(f"--steps: unknown {', '.join(unknown)}; the steps are {', '.join(steps)}")
    chosen = [steps[n] for n in names]
    if args.list:
        for s in chosen:
            print(f"{s.name} (about {s.seconds} s): python -m {' '.join(s.argv)}")
        return 0
    records = run(chosen, args.out, args.deadline)
    write_report(args.out, "evidence", dict(steps=records), markdown(records))
    print(markdown(records))
    return 0 if all(r["rc"] == 0 for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
