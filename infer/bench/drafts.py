"""Trained drafts on held-out prompts: tau and tokens/s of speculative against plain decoding, by context
length and temperature, every draft on the same prompts in one run.

    python -m infer.bench drafts --out DIR --target DIR --drafts ours=DIR,ref=DIR --prompts corpus/dev.jsonl
    python -m infer.bench drafts ... --pad-script pad_model.py   # the same, with target and drafts padded to 8B cost
    python -m infer.bench drafts --out DIR --smoke                # tiny random pair on the CPU

Prompts: ``--num-prompts`` windows of each context length at seeded random offsets of the documents of
``--prompts`` (a jsonl with a ``text`` field, e.g. the fixture's dev split), batch 1. Times exclude prefill (the
reference's convention): a generation's post-prefill loop is timed on its own (median of ``--reps``), compiled
as ``generate()`` compiles it (``--compile``: autotuned, i.e. ``reproducible=False``, or the default reproducible).
tau = tokens generated / (rounds + 1) and tokens/s are summed over the prompts. At T = 0 each speculative output
is compared with the plain one (first divergence; bf16 paths may part at near-ties,
docs/architecture.md, "Numerics and testing").
``repeat_4gram_share``: the share of the plain output's 4-grams already seen earlier in prompt or output (greedy
output of a small model loops, which makes any draft look good).
"""

from __future__ import annotations

import json

import jax
import numpy as np

from infer.bench.harness import (add_sized_args, arg_parser, finish, log, md_header, md_row, nbytes, parse_sized,
                                 run_header, time_runs, write_report)
from infer.bench.loops import add_compile_arg, plain_fns, speculative_fns
from infer.bench.near_tie import float32_reference, lossless_cell, partings
from infer.bench.spec_inputs import load_target_and_drafts
from infer.calibrate import prompt_windows
from infer.decoding import Progress, StopCriteria
from infer.generate import pad_prompts, plan_speculative
from infer.main import positive_ints_arg, tree_shape_arg
from longspec_jax.sampling import SamplingConfig

DEFAULTS = dict(contexts=(4096, 16384), num_prompts=5, new_tokens=256)
SMOKE = dict(contexts=(40, 64), num_prompts=2, new_tokens=12)


def repeat_4gram_share(prompt, output) -> float:
    """Share of the output's 4-grams that occur earlier in prompt + output."""
    seq = [int(t) for t in prompt] + [int(t) for t in output]
    seen, repeats, total = set(), 0, 0
    for i in range(len(seq) - 3):
        gram = tuple(seq[i:i + 4])
        if i + 3 >= len(prompt):
            total += 1
            repeats += gram in seen
        seen.add(gram)
    return repeats / max(total, 1)


class Runner:
    """Compiled plain and speculative generation loops for one (target, draft settings, sampling), timed from
    their post-prefill state; ``compile_mode`` as :mod:`infer.bench.loops`'."""

    def __init__(self, target, draft, longest: int, new_tokens: int, sampling: SamplingConfig, tree, impl: str,
                 reps: int, compile_mode: str):
        self.settings = plan_speculative(target, draft, longest, new_tokens, sampling, tree, 512, impl)
        self.stop, self.reps, self.params, self._warm = StopCriteria.make(new_tokens, []), reps, target.params, set()
        self.plain_start, self.plain_run = plain_fns(self.settings.base, self.stop, compile_mode)
        self.spec_start, self.spec_run = speculative_fns(self.settings, self.stop, compile_mode)

    def _inputs(self, prompt, seed: int):
        tokens, lengths = pad_prompts([np.asarray(prompt, np.int32)], self.settings.base.prompt_len)
        return tokens, lengths, jax.random.PRNGKey(seed)

    def _time(self, name: str, start, run):
        """Median seconds of ``run(start())`` over ``reps`` runs, after one untimed run the first time ``name``
        runs (its compile)."""
        if name not in self._warm:
            self._warm.add(name)
            jax.block_until_ready(run(start()))
        return time_runs(start, run, self.reps, warmup=False)

    def plain(self, prompt, seed: int) -> dict:
        tokens, lengths, key = self._inputs(prompt, seed)
        base = self.settings.base

        def start():
            first, cache, k = self.plain_start(self.params, tokens, lengths, key)
            return Progress.start(first, base.out_len, self.stop), cache, first, k

        sec, progress = self._time("plain", start, lambda st: self.plain_run(self.params, *st))
        n = int(progress.num_generated[0])
        return dict(seconds=sec, generated=n, steps=int(progress.num_rounds[0]),
                    tokens=np.asarray(progress.tokens)[0, :n].tolist())

    def speculative(self, weights, prompt, seed: int) -> dict:
        tokens, lengths, key = self._inputs(prompt, seed)
        sec, state = self._time("speculative", lambda: self.spec_start(self.params, weights, tokens, lengths, key),
                                lambda st: self.spec_run(self.params, weights, st))
        n = int(state.progress.num_generated[0])
        return dict(seconds=sec, generated=n, rounds=int(state.progress.num_rounds[0]),
                    accept_counts=np.asarray(state.accept_counts)[0].tolist(),
                    tokens=np.asarray(state.progress.tokens)[0, :n].tolist())


def mean_and_se(values) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n); 0 for a single value)."""
    v = np.asarray(values, np.float64)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0


def paired_tau_difference(spec_runs: list[dict], baseline_runs: list[dict]) -> tuple[float, float]:
    """Mean and standard error over prompts of (this draft's tau - the baseline draft's tau) on the same prompt:
    pairing removes the prompt-to-prompt spread, which dominates the error of either tau alone."""
    return mean_and_se([a - b for a, b in zip(prompt_taus(spec_runs), prompt_taus(baseline_runs))])


def prompt_taus(spec_runs: list[dict]) -> list[float]:
    return [r["generated"] / (r["rounds"] + 1) for r in spec_runs]


def summarize(plain_runs: list[dict], spec_runs: list[dict] | None = None) -> dict:
    """Totals over prompts: plain tokens/s (decode steps / s), or speculative tau (with the standard error of
    the per-prompt tau), tokens/s and speedup."""
    plain_tps = sum(r["steps"] for r in plain_runs) / sum(r["seconds"] for r in plain_runs)
    if spec_runs is None:
        return dict(tokens_per_s=plain_tps)
    generated = sum(r["generated"] for r in spec_runs)
    tps = sum(r["generated"] - 1 for r in spec_runs) / sum(r["seconds"] for r in spec_runs)
    return dict(tau=generated / sum(r["rounds"] + 1 for r in spec_runs), tau_se=mean_and_se(prompt_taus(spec_runs))[1],
                tokens_per_s=tps, speedup=tps / plain_tps,
                accept_counts=np.sum([r["accept_counts"] for r in spec_runs], axis=0).tolist())


def run(args) -> dict:
    results = run_header(tree_shape=list(args.tree), new_tokens=args.new_tokens, compile=args.compile, rows=[])
    if args.smoke:
        from longspec_jax.testing import random_draft, tiny_target
        target = tiny_target(0)
        drafts = {"a": random_draft(1), "b": random_draft(2)}
        rng = np.random.default_rng(0)
        docs = [rng.integers(0, target.config.vocab_size, 300).tolist() for _ in range(3)]
        impl = "xla"
    else:
        target, drafts, _ = load_target_and_drafts(args.target, dict(args.drafts), args.pad_script, args.work)
        with open(args.prompts) as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        docs = [target.tokenizer(t)["input_ids"] for t in texts]
        impl = "auto"
    # the small fixture also with --pad-script: the padded model computes its function
    reference32 = float32_reference(None if args.smoke else args.target, target)

    results["target_param_bytes"] = nbytes(target.params)
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature)
        runner = Runner(target, next(iter(drafts.values())), max(args.contexts), args.new_tokens, sampling,
                        args.tree, impl, args.reps, args.compile)
        for context in args.contexts:
            prompts = prompt_windows(docs, context, args.num_prompts, args.seed)
            plain = [runner.plain(p, args.seed + i) for i, p in enumerate(prompts)]
            row = dict(context=context, temperature=temperature, plain=summarize(plain),
                       repeat_4gram_share=float(np.mean([repeat_4gram_share(p, r["tokens"])
                                                         for p, r in zip(prompts, plain)])))
            log(f"ctx {context} T={temperature}: plain {row['plain']['tokens_per_s']:.1f} tok/s, "
                f"repeated 4-grams {row['repeat_4gram_share']:.2f}")
            baseline = None
            for name, draft in drafts.items():
                spec = [runner.speculative(draft.weights, p, args.seed + i) for i, p in enumerate(prompts)]
                row[name] = summarize(plain, spec)
                if baseline is None:
                    baseline = spec
                else:
                    row[name]["paired_tau_difference"] = paired_tau_difference(spec, baseline)
                if temperature == 0:
                    row[name]["partings"] = partings(reference32, prompts, [s["tokens"] for s in spec],
                                                     [r["tokens"] for r in plain])
                log(f"ctx {context} T={temperature}: {name} tau {row[name]['tau']:.2f}, "
                    f"{row[name]['tokens_per_s']:.1f} tok/s ({row[name]['speedup']:.2f}x)")
            results["rows"].append(row)
            write_report(args.out, "bench_drafts", results, markdown(results, list(drafts)))
    results["drafts"] = list(drafts)
    return results


def markdown(results: dict, names: list[str]) -> str:
    """One row per (context, T); each draft's tau +- its standard error over prompts, and for every draft after
    the first the paired per-prompt tau difference to the first +- its standard error; at T=0, per draft, the
    outputs equal to plain greedy and whether the others part at near-ties."""
    lines = md_header(["context", "T", "plain tok/s", "repeated 4-grams"] +
                      [f"{n} {what}" for n in names for what in ("tau", "tok/s", "speedup")] +
                      [f"{n} - {names[0]} tau (paired)" for n in names[1:]] +
                      [f"{n} T=0 equal to plain" for n in names])
    for row in results["rows"]:
        cells = [row["context"], row["temperature"], f"{row['plain']['tokens_per_s']:.1f}",
                 f"{row['repeat_4gram_share']:.2f}"]
        for n in names:
            r = row[n]
            cells += [f"{r['tau']:.2f} ± {r['tau_se']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x"]
        cells += ["{:+.3f} ± {:.3f}".format(*row[n]["paired_tau_difference"]) for n in names[1:]]
        cells += [lossless_cell(row[n]["partings"]) if "partings" in row[n] else "" for n in names]
        lines.append(md_row(cells))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = arg_parser("drafts", __doc__, "tiny random target and drafts on the CPU")
    p.add_argument("--target", help="HF directory of the target (the small fixture with --pad-script)")
    p.add_argument("--drafts", default="", help="name=DIR,... LongSpec drafts (HF release format) to compare")
    p.add_argument("--prompts", help="jsonl of prompt documents (a 'text' field each)")
    add_sized_args(p, (("contexts", positive_ints_arg, "prompt lengths"),
                       ("num-prompts", int, "prompt windows per context"),
                       ("new-tokens", int, "tokens per generation")), DEFAULTS, SMOKE)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--tree", type=tree_shape_arg, default=(4, 16, 16, 16, 16), metavar="C0,C1,...")
    p.add_argument("--reps", type=int, default=1, help="timed runs per generation (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-script", help="pad target and drafts to 8B cost with this pad_model.py first")
    p.add_argument("--work", default="/tmp/longspec_drafts", help="where padded models are written (reused)")
    add_compile_arg(p)
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    args.drafts = [tuple(item.split("=", 1)) for item in args.drafts.split(",") if item]
    if not args.smoke and not (args.target and args.drafts and args.prompts):
        p.error("--target, --drafts and --prompts are required (or --smoke)")
    results = run(args)
    return finish(args.out, "drafts", results, markdown(results, results["drafts"]))
