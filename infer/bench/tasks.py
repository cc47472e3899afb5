"""Long-context tasks: every method on the same samples in one run, by task, length bucket, temperature and batch.

    python -m infer.bench tasks --out DIR --target DIR --drafts ours=DIR,ref=DIR --repo-docs corpus/dev.jsonl
    python -m infer.bench tasks ... --longbench DIR --tasks gov_report,qmsum,lcc   # DIR/{task}.jsonl, yours
    python -m infer.bench tasks ... --reasoning FILE.jsonl                        # {"prompt", "answer"} rows
    python -m infer.bench tasks --out DIR --smoke                                 # tiny random pair on the CPU

Samples: the built-in repo-level completion task (``--repo-docs``: a corpus split's repositories, cut after a
``def``), LongBench-format tasks with the reference's templates, long-reasoning prompts; kept when
``1200 < length <= --max-tokens`` and in ``--buckets``, at most ``--per-bucket`` per (task, bucket). Each bucket
compiles once per method and batch size (prompts padded to the bucket's top, so prefill covers it). A progress bar
counts the rows (one per task, bucket, temperature, batch size and method).

Methods (``--methods``; plain first, the baseline of every speedup): ``plain``; ``tree`` (the first draft of
``--drafts`` with each shape of ``--tree-shapes``, the sweep; every other draft with the first shape: the draft's
top-k beams); ``chain`` (each draft, ``--chain``, the draft's argmax); ``schain`` (T > 0 only: each draft's chain
sampled from the draft, ``generate(draft_sampling=True)``); ``stree`` (T > 0 only: the first draft's trees of
``--sampled-shapes`` sampled from it, kind ``--sampling-kind``); ``auto`` (each draft, ``generate()`` choosing
the tree and the sampling itself; the row records its choice); ``pld`` (prompt lookup on our verify path,
``--pld-tokens``); ``hf`` and ``hf_pld`` (Hugging Face ``generate`` in PyTorch on the target's directory, plain
at every batch size (left-padded) and with ``prompt_lookup_num_tokens`` at batch 1, the only one transformers runs
it at). Decode tokens/s exclude prefill: they are timed between a probe call and the full call (our methods: the
probe generates just over half the tokens, so it runs the same compiled program; HF: one token); ``speedup``
compares them with plain's, ``call_speedup`` (the "whole call" column) the full calls' times, prefill and every
token: a long output's whole generation (e.g. ``--buckets 1536-2048 --min-tokens 0 --new-tokens 16384
--ignore-eos``: 2k prompts, 16k generated tokens). At T=0 each output is compared with plain's: where it parts,
the float32 top-2 logit gap there says whether that is a near-tie, where bf16 paths may part (docs/architecture.md,
"Numerics and testing"), or a lossless failure (``--reference32``: the target's function in float32; with
``--pad-script`` the small fixture, whose function the padded pair computes).

Peak memory per row: the compiled program's peak device bytes (XLA's memory analysis of the whole call:
weights, prompts, caches, temporaries, outputs); HF rows: torch's peak over their calls. With HF methods, JAX's GPU
pool grows as it needs instead of taking 75% of the device at start (unless ``XLA_PYTHON_CLIENT_*`` is set). A
method that raises (out of device memory, say) gets a failed row with its error, and the run goes on; where plain
fails, the rest of its group is skipped.

``--pad-script pad_model.py --work DIR``: the target and drafts are first padded to 8B-like cost (reused when
already in DIR); every method, HF included, then runs on the padded pair. ``--rope-parameters JSON`` first gives
target and drafts other RoPE parameters (config only; with a ``factor`` and ``original_max_position_embeddings``
the window becomes their product), e.g. llama3-style scaling for a target trained on shorter windows than the
buckets: the code-LM fixture, trained on 16k windows, stays sound to 30k with
``{"rope_type": "llama3", "factor": 2, "low_freq_factor": 1, "high_freq_factor": 4,
"original_max_position_embeddings": 16384}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from infer.bench.drafts import repeat_4gram_share
from infer.bench.harness import (arg_parser, backend_compiles, json_object_arg, log, median_call, record_failure,
                                 write_report)
from infer.bench.near_tie import float32_reference, partings
from infer.bench.spec_inputs import load_target_and_drafts, with_rope_parameters
from infer.bench.task_data import (Sample, bucket_bounds, bucket_name, load_longbench, load_reasoning,
                                   repo_completion, select)
from infer.bench.task_hf import leave_gpu_memory_to_torch
from infer.bench.task_report import best_tree_shapes, failed_row, markdown, plot, summarize_runs
from infer.generate import generate, plan_shapes, recording_program_memory
from infer.main import temperature_arg, tree_shape_arg
from infer.lookup import PromptLookup
from longspec_jax.tree import SAMPLING_KINDS


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    draft: str | None = None            # a name of --drafts
    tree: tuple[int, ...] | None = None
    lookup: PromptLookup | None = None
    hf_lookup: int | None = None        # HF methods: prompt_lookup_num_tokens (0: plain)
    draft_sampling: bool | str | None = None  # generate(draft_sampling=...); None with a draft: auto
    auto: bool = False                  # generate() chooses tree_shape and draft_sampling

    @property
    def sampled(self) -> bool:
        """A tree sampled from the draft: T > 0 only."""
        return bool(self.draft_sampling)


def parse_methods(names: list[str], drafts: list[str], shapes: list[tuple], chain: tuple, pld_tokens: int,
                  sampled_shapes: list[tuple] = (), sampling_kind: str = "without_replacement"):
    if names[0] != "plain":
        raise ValueError("--methods must start with plain (the baseline of every speedup)")
    methods = []
    for name in names:
        if name == "plain":
            methods.append(Method("plain"))
        elif name == "tree":
            methods += [Method(f"tree[{d}]{','.join(map(str, s))}", draft=d, tree=s, draft_sampling=False)
                        for i, d in enumerate(drafts) for s in (shapes if i == 0 else shapes[:1])]
        elif name == "chain":
            methods += [Method(f"chain[{d}]{len(chain)}", draft=d, tree=chain, draft_sampling=False) for d in drafts]
        elif name == "schain":
            methods += [Method(f"schain[{d}]{len(chain)}", draft=d, tree=chain, draft_sampling=True) for d in drafts]
        elif name == "stree":
            tag = "" if sampling_kind == "without_replacement" else "+1"
            methods += [Method(f"stree{tag}[{drafts[0]}]{','.join(map(str, s))}", draft=drafts[0], tree=s,
                               draft_sampling=sampling_kind) for s in sampled_shapes]
        elif name == "auto":
            methods += [Method(f"auto[{d}]", draft=d, auto=True) for d in drafts]
        elif name == "pld":
            methods.append(Method(f"pld{pld_tokens}", lookup=PromptLookup(num_tokens=pld_tokens)))
        elif name in ("hf", "hf_pld"):
            methods.append(Method(name, hf_lookup=pld_tokens if name == "hf_pld" else 0))
        else:
            raise ValueError(f"unknown method {name!r}; choose from plain, tree, chain, schain, stree, auto, pld, hf, "
                             f"hf_pld")
    return methods


def probe_tokens(new_tokens: int) -> int:
    """New tokens of the timing probe: just over half the output buffer (a power of two), so the probe plans the
    same shapes as a call for ``new_tokens`` and reuses its compiled program; 1 (a compile of its own) where that
    would leave under a quarter of ``new_tokens`` to time."""
    out_len = plan_shapes(1, new_tokens, 0, 1)[2]
    shared = out_len // 2 + 1
    return shared if plan_shapes(1, shared, 0, 1)[2] == out_len and new_tokens - shared >= new_tokens / 4 else 1


class Runner:
    """Runs one method on one batch of samples, compiling (untimed) the first time a shape comes up."""

    def __init__(self, target, drafts: dict, hf, args):
        self.target, self.drafts, self.hf, self.args = target, drafts, hf, args
        self.probe = probe_tokens(args.new_tokens)
        # calls that compile every program a measurement times: a probe of over one token runs the full call's
        # (so a long output is not generated a third time to compile it)
        self.warmup_tokens = (self.probe,) if self.probe > 1 else tuple(dict.fromkeys((args.new_tokens, 1)))
        self.peak_bytes: dict[tuple, int | None] = {}  # per compiled program: XLA's peak bytes of the whole call

    def _median(self, call):
        return median_call(call, self.args.reps)

    def __call__(self, method: Method, batch: list[Sample], temperature: float, pad_to: int) -> dict:
        a = self.args
        if method.hf_lookup is not None:
            eos_ids = [] if a.ignore_eos else list(self.target.config.eos_token_ids)
            return dict(self.hf.run([s.tokens for s in batch], a.new_tokens, temperature, method.hf_lookup, a.seed,
                                    eos_ids, a.reps), prompt_tokens=[len(s.tokens) for s in batch])
        eos = [] if a.ignore_eos else None
        key = (method, len(batch), temperature, pad_to)
        draft = self.drafts[method.draft] if method.draft else method.lookup
        kwargs = dict(draft=draft, temperature=temperature, eos_token_id=eos, seed=a.seed, pad_prompts_to=pad_to,
                      **({"tree_shape": method.tree} if method.tree else {}),
                      **({"draft_sampling": method.draft_sampling} if method.draft_sampling is not None else {}))
        prompts = [s.tokens for s in batch]
        if key not in self.peak_bytes:  # compile (untimed) and record the programs' memory
            with recording_program_memory() as peaks:
                for n in self.warmup_tokens:
                    generate(self.target, prompts, max_new_tokens=n, **kwargs)
            self.peak_bytes[key] = max((p for p in peaks if p is not None), default=None)
        def call(new_tokens: int, **choice):
            return lambda: generate(self.target, prompts, max_new_tokens=new_tokens, **{**kwargs, **choice})

        probe_s, short = self._median(call(self.probe))
        compiled = backend_compiles()
        total_s, out = self._median(call(a.new_tokens))
        if backend_compiles() > compiled:  # auto chose another shape for the full call's longer context: both
            choice = chosen(out.speculation)  # calls again with that one, whose program is now compiled
            probe_s, short = self._median(call(self.probe, **choice))
            total_s, out = self._median(call(a.new_tokens, **choice))
        return dict(generated=out.num_generated.tolist(), rounds=out.num_rounds.tolist(), total_s=total_s,
                    probe_generated=short.num_generated.tolist(), probe_rounds=short.num_rounds.tolist(),
                    probe_s=probe_s, peak_bytes=self.peak_bytes[key], prompt_tokens=[len(p) for p in prompts],
                    accept_counts=None if out.accept_counts is None else out.accept_counts.tolist(),
                    tokens=[out.tokens[b, :n].tolist() for b, n in enumerate(out.num_generated)],
                    speculation=speculation_record(out.speculation))


def gather_samples(args, tokenizer) -> list[Sample]:
    samples = []
    if args.repo_docs:
        with open(args.repo_docs) as f:
            docs = [json.loads(line) for line in f if line.strip()]
        samples += repo_completion(docs, tokenizer, args.buckets, args.per_bucket, args.seed)
    for task in args.tasks:
        samples += load_longbench(os.path.join(args.longbench, f"{task}.jsonl"), task, tokenizer)
    if args.reasoning:
        samples += load_reasoning(args.reasoning, tokenizer)
    return samples


def smoke_inputs():
    """A tiny random target and draft, and synthetic samples of repeated motifs."""
    from longspec_jax.testing import random_draft, tiny_target

    target = tiny_target(0)
    rng = np.random.default_rng(0)
    samples = []
    for i, n in enumerate((24, 28, 40, 56)):
        motif = rng.integers(0, target.config.vocab_size, 7).tolist()
        samples.append(Sample("synthetic", str(i), "", [], (motif * 10)[:n]))
    return target, {"a": random_draft(1)}, samples


def load_inputs(args):
    """The target, drafts and samples of a real run, and the directories of the target's function in float32
    (the small fixture) and of the target that runs (padded or not)."""
    small_dir, draft_dirs, work = args.target, dict(args.drafts), args.work
    if args.rope_parameters:
        tag = hashlib.sha1(json.dumps(args.rope_parameters, sort_keys=True).encode()).hexdigest()[:8]
        work = os.path.join(args.work, f"rope_{tag}")
        small_dir, draft_dirs = with_rope_parameters(small_dir, draft_dirs, args.rope_parameters,
                                                     os.path.join(work, "small"))
    target, drafts, target_dir = load_target_and_drafts(small_dir, draft_dirs, args.pad_script, work,
                                                        getattr(jnp, args.dtype))
    return target, drafts, gather_samples(args, target.tokenizer), small_dir, target_dir


def batches_of(group: list[Sample], size: int) -> list[list[Sample]]:
    """The group's samples in batches of ``size``; a last, smaller batch is left out."""
    return [group[i:i + size] for i in range(0, len(group) - size + 1, size)]


def methods_at(methods: list[Method], batch_size: int, temperature: float) -> list[Method]:
    """The methods that run at a batch size and temperature: HF's prompt lookup at batch 1 only, trees sampled
    from the draft at T > 0 only."""
    return [m for m in methods if not (m.hf_lookup and batch_size > 1) and not (m.sampled and temperature == 0)]


def chosen(speculation) -> dict:
    """``generate()`` arguments that repeat what a call speculated with (``GenerateOutput.speculation``): none for a
    call that made no choice (plain, prompt lookup), no draft where auto chose plain decoding."""
    if speculation is None:
        return {}
    if speculation.tree_shape is None:
        return dict(draft=None)
    return dict(tree_shape=speculation.tree_shape, draft_sampling=speculation.draft_sampling or False)


def speculation_record(speculation) -> dict | None:
    """What a generate call speculated with (``GenerateOutput.speculation``), for the report."""
    if speculation is None:
        return None
    return dict(tree_shape=None if speculation.tree_shape is None else list(speculation.tree_shape),
                draft_sampling=speculation.draft_sampling, reason=speculation.reason,
                expected_tokens=speculation.expected_tokens, predicted_speedup=speculation.predicted_speedup)


def group_rows(runner: Runner, methods: list[Method], batches: list[list[Sample]], pad_to: int, reference32,
               where: dict):
    """Each method's row for one (task, bucket, temperature, batch) group (``methods``: those of
    :func:`methods_at`, plain first), as it is measured. A method that raises (out of device memory, say) yields a
    failed row; where plain fails, the group ends there."""
    temperature, plain = where["temperature"], None
    prompts = [s.tokens for b in batches for s in b]
    for method in methods:
        row = dict(where, method=method.name)
        label = " ".join(str(v) for v in (where["task"], where["bucket"], f"T={temperature}", f"B={where['batch']}",
                                           method.name))
        try:
            runs = [runner(method, b, temperature, pad_to) for b in batches]
        except Exception as e:  # the row says so, and the run goes on
            record_failure(row, label, e)
            yield failed_row(row)
            if plain is None:
                log(f"  no plain baseline: the rest of {label.rsplit(' ', 1)[0]} is skipped")
                return
            continue
        peaks = [r["peak_bytes"] for r in runs if r["peak_bytes"] is not None]  # None: not reported
        row.update(**summarize_runs(runs), peak_bytes=max(peaks, default=None))
        if runs[0].get("speculation") is not None:
            row["speculation"] = runs[0]["speculation"]
        outputs = [t for r in runs for t in r["tokens"]]
        if plain is None:
            plain = dict(tps=row["tokens_per_s"], call_s=row["call_s"], pass_ms=row["pass_ms"], outputs=outputs)
            row["repeat_4gram_share"] = float(np.mean([repeat_4gram_share(p, o) for p, o in zip(prompts, outputs)]))
        row["speedup"] = row["tokens_per_s"] / plain["tps"]
        row["call_speedup"] = plain["call_s"] / row["call_s"]
        row["pass_steps"] = row["pass_ms"] / plain["pass_ms"]  # a round's cost in plain decoding steps
        if temperature == 0 and method.name != "plain":
            row["partings"] = partings(reference32, prompts, outputs, plain["outputs"])
        log(f"{label}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x)")
        yield row


def run(args) -> dict:
    if args.smoke:
        (target, drafts, samples), small_dir, target_dir = smoke_inputs(), None, None
        args.max_tokens = None
    else:
        target, drafts, samples, small_dir, target_dir = load_inputs(args)
        if args.max_tokens is None:
            args.max_tokens = target.config.max_position_embeddings - 2000
    methods = parse_methods(args.methods, list(drafts), args.tree_shapes, args.chain, args.pld_tokens,
                            args.sampled_shapes, args.sampling_kind)
    reference32 = float32_reference(None if args.smoke else args.reference32 or small_dir, target)

    hf = None
    if any(m.hf_lookup is not None for m in methods):
        from infer.bench.task_hf import HFRunner
        hf = HFRunner(target_dir)
    names = [bucket_name(hi, args.buckets) for _, hi in args.buckets]
    groups: dict[tuple, list[Sample]] = {}
    for s in select(samples, args.min_tokens, args.max_tokens, args.buckets, args.per_bucket):
        groups.setdefault((s.task, bucket_name(s.length, args.buckets)), []).append(s)
    runner = Runner(target, drafts, hf, args)
    results = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                   jax=jax.__version__, new_tokens=args.new_tokens, methods=[m.name for m in methods],
                   samples={f"{t}/{b}": len(g) for (t, b), g in groups.items()}, rows=[])
    plan = [(dict(task=task, bucket=bucket, temperature=temperature, batch=batch_size), batches_of(group, batch_size),
             methods_at(methods, batch_size, temperature))
            for temperature in args.temperatures for batch_size in args.batch_sizes
            for (task, bucket), group in groups.items()]
    plan = [group for group in plan if group[1]]
    with tqdm(total=sum(len(group_methods) for *_, group_methods in plan), unit="row", desc="tasks",
              dynamic_ncols=True) as bar:
        for where, batches, group_methods in plan:
            planned = bar.n + len(group_methods)
            for row in group_rows(runner, group_methods, batches, bucket_bounds(where["bucket"], args.buckets)[1],
                                  reference32, where):
                results["rows"].append(row)
                write_report(args.out, "bench_tasks", results, markdown(results["rows"]))
                bar.set_postfix_str(f"{where['bucket']} T={where['temperature']} B={where['batch']} {row['method']}")
                bar.update()
            bar.update(planned - bar.n)  # a group whose plain failed skipped the rest
    if results["rows"]:
        results["best_tree_shapes"] = best_tree_shapes(results["rows"])
        results["plots"] = plot(results["rows"], args.out, names)
        write_report(args.out, "bench_tasks", results, markdown(results["rows"]))
    return results


def main(argv=None) -> int:
    p = arg_parser("tasks", __doc__, "tiny random pair and synthetic samples on the CPU")
    p.add_argument("--target", help="HF directory of the target")
    p.add_argument("--drafts", default="", help="name=DIR,... LongSpec drafts")
    p.add_argument("--repo-docs", help="jsonl of repository documents (repo, text): the repo-completion task")
    p.add_argument("--longbench", help="directory of LongBench jsonl files ({task}.jsonl)")
    p.add_argument("--tasks", default="", help="LongBench tasks, comma-separated (with --longbench)")
    p.add_argument("--reasoning", help="jsonl of long-reasoning prompts (prompt, answer)")
    p.add_argument("--buckets", default="2048-4096,4096-8192,8192-16384,16384-32768", help="lo-hi,... tokens")
    p.add_argument("--per-bucket", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=1200)
    p.add_argument("--max-tokens", type=int, default=None, help="default: the target's context - 2000")
    p.add_argument("--methods", default="plain,auto,tree,chain,schain,stree,pld,hf,hf_pld")
    p.add_argument("--tree-shapes", default="4,16,16,16,16;2,8,8,8;4,8,8,8,8,8", help="shapes, ';'-separated")
    p.add_argument("--chain", default="1,1,1,1")
    p.add_argument("--sampled-shapes", default="2,2,2,2;4,4,4,4", help="stree's shapes, ';'-separated")
    p.add_argument("--sampling-kind", default="without_replacement", choices=SAMPLING_KINDS,
                   help="how stree samples its children")
    p.add_argument("--pld-tokens", type=int, default=10)
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens tokens")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="of the target and drafts (float32: tokens per round on a CPU, where bfloat16 is slow)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per measurement (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-script", help="pad_model.py: run on the target and drafts padded to 8B-like cost")
    p.add_argument("--work", default="/tmp/bench_tasks_padded",
                   help="where the padded pair and the --rope-parameters copies are written")
    p.add_argument("--rope-parameters", type=json_object_arg, help="JSON merged into the RoPE parameters of the "
                   "target's and drafts' config.json, e.g. llama3-style scaling to run a target past its trained "
                   "context (copies in --work)")
    p.add_argument("--reference32", help="HF directory of the target's function for the float32 near-tie check "
                                         "(default --target, which with --pad-script is the small fixture)")
    args = p.parse_args(argv)
    if args.smoke:  # one draft, one shape, T=0: a couple of minutes of CPU compiles
        args.buckets, args.min_tokens, args.new_tokens, args.per_bucket = "16-64", 0, 10, 2
        args.batch_sizes, args.temperatures, args.tree_shapes = "1,2", "0", "2,4,4"
        args.methods = "plain,auto,tree,chain,pld"
    elif not (args.target and (args.repo_docs or args.tasks or args.reasoning)):
        p.error("--target and a task source (--repo-docs, --longbench with --tasks, --reasoning) are required")
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.methods = args.methods.split(",")
    args.drafts = [tuple(item.split("=", 1)) for item in args.drafts.split(",") if item]
    for name, convert, sep in (("buckets", lambda b: tuple(int(x) for x in b.split("-")), ","),
                               ("tree_shapes", tree_shape_arg, ";"), ("sampled_shapes", tree_shape_arg, ";"),
                               ("batch_sizes", int, ","),
                               ("temperatures", temperature_arg, ",")):
        try:
            setattr(args, name, [convert(x) for x in str(getattr(args, name)).split(sep)])
        except (ValueError, argparse.ArgumentTypeError) as e:
            p.error(f"--{name.replace('_', '-')}: {e}")
    try:
        args.chain = tree_shape_arg(args.chain)
    except argparse.ArgumentTypeError as e:
        p.error(f"--chain: {e}")
    if any(m.startswith("hf") for m in args.methods) and leave_gpu_memory_to_torch():
        log("HF methods share the GPU: XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX's pool grows as it needs)")
    results = run(args)
    print(markdown(results["rows"]))
    return 0
