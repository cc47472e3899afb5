"""Load on the OpenAI-compatible server: ``python -m infer.serve`` with the draft and with ``--no-draft``, each
started in turn, sent the same bounded load, and stopped; one report of both.

    python -m infer.bench serve --out DIR --target DIR --draft DIR --repo-docs corpus/dev.jsonl \\
        --concurrency 1,4,8,16 --request-rates 2,8 --num-requests 64 --max-tokens 256 --baseline
    python -m infer.bench serve --out DIR --smoke      # the embedded default model on the CPU, a few requests

Prompts: the tasks benchmark's repo-level completion prompts (``--repo-docs``, cut after a ``def``, the prompt a
window of the ``--bucket`` length range; ``--smoke``: the standard library's ``json`` package), sent as token ids;
request i carries prompt ``i mod prompts`` and seed ``--seed + i``. Without ``--target`` the embedded default
model and its draft run. Each server listens on 127.0.0.1 (a free port); the run waits for its ready line, sends
``--warmup`` requests at once (untimed), then each level: ``--concurrency`` N (N clients, each sending its next
request when the last ends) and ``--request-rates`` R (Poisson arrivals, seeded), ``--num-requests`` per level,
each level cut at ``--deadline`` seconds. Its output goes to ``DIR/server_{draft,plain}.log``.

Per level (``infer.bench.serve_load``): completed requests, request and output-token throughput, TTFT, TPOT
(E2E - TTFT over output tokens - 1), ITL (between chunks) and E2E as mean, p50 and p99, output tokens from the
usage chunk, and tau (tokens per target pass) from the server's ``/metrics`` counters before and after.

``--servers`` picks the servers (default both). ``--baseline``: first, in a process of its own (so it never shares
the accelerator with a server), ``generate()`` on the same prompts with the draft and without (``--baseline draft``:
with the draft only): one prompt at a time (time per output token: the call less a
one-token call, over tokens - 1) and in static batches of ``--baseline-batch`` (a batch starts once its requests
have arrived under a rate's Poisson arrivals and the previous batch has ended; the batches run one after another,
so their measured times give every request's E2E). Prompts are padded to the bucket's top (one compiled program).
The report holds the ratios: draft over plain server throughput and TTFT p50 per level, the server's TPOT p50 at
concurrency 1 over ``generate``'s time per token, and its mean E2E at each rate over the static batches'.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from infer.bench.harness import (add_sized_args, arg_parser, finish, log, median_call, parse_sized, record_failure,
                                 run_header, write_report)
from infer.bench.serve_load import Level, loopback_url, poisson_arrivals, request_bodies, run_levels, static_batch_e2e
from infer.bench.serve_report import SERVERS, comparisons, markdown, plot
from infer.bench.task_data import read_jsonl, repo_completion
from infer.engine import ROUNDS_PER_STEP
from infer.generate import DEFAULT_PREFILL_CHUNK
from infer.main import DEFAULT_MODEL, DTYPES, positive_ints_arg, temperature_arg

READY = re.compile(r"\[infer\.serve\] ready: (http://\S+)")
DEFAULTS = dict(concurrency=(1, 4, 8, 16), num_requests=64, max_tokens=256, bucket="2048-4096", dtype="bfloat16",
                max_batch=16)
SMOKE = dict(concurrency=(1, 2), num_requests=4, max_tokens=8, bucket="32-64", dtype="float32", max_batch=2)


def rates_arg(text: str) -> tuple[float, ...]:
    """Comma-separated request rates > 0 (``inf``: every request at once); empty for none."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def servers_arg(text: str) -> tuple[str, ...]:
    """Comma-separated servers among ``draft`` and ``plain``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names among {', '.join(SERVERS)}, got {text!r}")
    return names


def counts_arg(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers, or empty for none."""
    return positive_ints_arg(text) if text else ()


def bucket_arg(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI prompt tokens, got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI, got {text!r}")
    return lo, hi


# ------------------------------------------------------------------------------------------------ inputs

def model_dirs(args) -> tuple[str, str]:
    """The target and draft directories: ``--target`` / ``--draft``, else the embedded default model's."""
    if args.target:
        return args.target, args.draft
    return os.fspath(DEFAULT_MODEL / "target"), os.fspath(DEFAULT_MODEL / "draft")


def stdlib_docs() -> list[dict]:
    """The standard library's ``json`` package as one repository's documents (the ``--smoke`` prompts)."""
    return [dict(repo="json", text=path.read_text()) for path in sorted(Path(json.__file__).parent.glob("*.py"))]


def load_prompts(args, target_dir: str) -> list[list[int]]:
    """Up to ``--num-requests`` repo-completion prompts (token ids) of the ``--bucket`` length range."""
    from transformers import AutoTokenizer

    docs = read_jsonl(args.repo_docs, ("repo", "text")) if args.repo_docs else stdlib_docs()
    samples = repo_completion(docs, AutoTokenizer.from_pretrained(target_dir), [args.bucket], args.num_requests,
                              args.seed)
    if not samples:
        raise ValueError(f"no prompt of {args.bucket[0]}-{args.bucket[1]} tokens in the documents")
    return [s.tokens for s in samples]


# ------------------------------------------------------------------------------------------------ the baseline

def generate_baseline(target, draft, bodies: list[dict], spec: dict) -> dict:
    """``generate()`` on the requests' prompts: one distinct prompt at a time (time per output token after the
    first), and every request in static batches under each rate's arrivals (module docstring)."""
    from infer.generate import generate

    def call(prompts, max_tokens, seed):
        return generate(target, prompts, draft=draft, max_new_tokens=max_tokens, temperature=spec["temperature"],
                        top_p=spec["top_p"], eos_token_id=[] if spec["ignore_eos"] else None, seed=seed,
                        pad_prompts_to=spec["bucket"][1], prefill_chunk=spec["prefill_chunk"])

    distinct = bodies[:spec["prompts"]]
    call([distinct[0]["prompt"]], 1, 0)  # compiles both programs
    call([distinct[0]["prompt"]], spec["max_tokens"], 0)
    tpots, e2es = [], []
    for body in distinct:
        first_s, _ = median_call(lambda: call([body["prompt"]], 1, body["seed"]), 1)
        e2e_s, out = median_call(lambda: call([body["prompt"]], spec["max_tokens"], body["seed"]), 1)
        e2es.append(e2e_s)
        if out.num_generated[0] > 1:
            tpots.append((e2e_s - first_s) / (int(out.num_generated[0]) - 1))
    size = spec["batch"]
    batches = [[b["prompt"] for b in bodies[k:k + size]] for k in range(0, len(bodies), size)]
    batches = [(batch * size)[:size] for batch in batches]  # a short last batch padded with its own prompts
    call(batches[0], spec["max_tokens"], spec["seed"])  # compiles
    seconds = [median_call(lambda: call(batch, spec["max_tokens"], spec["seed"] + k), 1)[0]
               for k, batch in enumerate(batches)]
    static = {f"{rate:g}": dict(batch=size, e2e_mean_s=float(static_batch_e2e(
        poisson_arrivals(rate, len(bodies), spec["seed"]), seconds, size).mean())) for rate in spec["rates"]}
    return dict(single=dict(prompts=len(distinct), tpot_s=statistics.median(tpots) if tpots else None,
                            e2e_mean_s=sum(e2es) / len(e2es)),
                batch_seconds=seconds, static=static)


def device_and_baseline(spec: dict) -> dict:
    """In a process of its own: the report's header (device, jax) and, with ``spec["baseline"]``, the baseline
    with the draft and without."""
    result = dict(header=run_header())
    if spec["baseline"]:
        import jax.numpy as jnp

        from longspec_jax import load_draft, load_target

        target = load_target(spec["target"], dtype=getattr(jnp, spec["dtype"]), load_tokenizer=False)
        draft = load_draft(spec["draft"], target)
        result["baseline"] = {}
        for server, pair_draft in (("draft", draft), ("plain", None)):
            if server not in spec["baseline"]:
                continue
            log(f"baseline: generate() {'with the draft' if pair_draft else 'without a draft'}")
            result["baseline"][server] = generate_baseline(target, pair_draft, spec["bodies"], spec)
    return result


def in_own_process(function, *args):
    """``function(*args)`` in a fresh (spawned) process, which exits after: the accelerator is free again."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


# ------------------------------------------------------------------------------------------------ the servers

@contextlib.contextmanager
def running_server(argv: list[str], log_path: str, startup_timeout: float):
    """Starts ``argv`` (its output to ``log_path``) and yields its loopback URL once it prints its ready line;
    stops it on exit (SIGTERM, then SIGKILL after 30 s)."""
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + startup_timeout
        while not (ready := READY.search(Path(log_path).read_text(errors="replace"))):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready; "
                                   f"its output: {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready within {startup_timeout:g} s; its output: {log_path}")
            time.sleep(0.2)
        yield loopback_url(ready.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_argv(args, server: str, server_module: str) -> list[str]:
    """The command line of ``python -m infer.serve`` for ``server`` (``draft`` or ``plain``)."""
    models = ["--target", args.target] if args.target else []
    models += ["--no-draft"] if server == "plain" else (["--draft", args.draft] if args.draft else [])
    return [sys.executable, "-m", server_module, *models, "--host", "127.0.0.1", "--port", "0",
            "--max-batch", str(args.max_batch), "--max-context", str(args.max_context),
            "--max-queue", str(args.max_queue), "--prefill-chunk", str(args.prefill_chunk),
            "--rounds-per-step", str(args.rounds_per_step), "--dtype", args.dtype,
            *(["--compile-on-demand"] if args.compile_on_demand else [])]


def run(args, server_module: str = "infer.serve") -> dict:
    """The whole benchmark; ``server_module`` is the server's ``python -m`` module."""
    target_dir, draft_dir = model_dirs(args)
    prompts = load_prompts(args, target_dir)
    count = args.num_requests
    bodies = request_bodies(prompts, count, args.max_tokens, args.temperature, args.top_p, args.seed, args.ignore_eos)
    levels = [Level("concurrency", c) for c in args.concurrency] + [Level("rate", r) for r in args.request_rates]
    config = {k: v for k, v in vars(args).items() if k not in ("out", "smoke")} | dict(prompts=len(prompts))
    spec = dict(baseline=args.baseline, target=target_dir, draft=draft_dir, dtype=args.dtype, bodies=bodies,
                prompts=len(prompts), bucket=args.bucket, max_tokens=args.max_tokens, temperature=args.temperature,
                top_p=args.top_p, ignore_eos=args.ignore_eos, seed=args.seed, rates=args.request_rates,
                batch=args.baseline_batch, prefill_chunk=args.prefill_chunk)
    first = in_own_process(device_and_baseline, spec)
    report = dict(first["header"], config=config,
                  prompt_tokens=[len(p) for p in prompts], baseline=first.get("baseline"), servers={})
    for server in args.servers:
        argv = server_argv(args, server, server_module)
        record = report["servers"][server] = dict(argv=argv, levels=[])
        log(f"server {server}: {' '.join(argv)}")

        def measured(results, record=record):  # the report holds every level measured so far
            record["levels"] = list(results)
            write_report(args.out, "bench_serve", report, markdown(report))

        try:
            start = time.perf_counter()
            with running_server(argv, os.path.join(args.out, f"server_{server}.log"), args.startup_timeout) as url:
                record["startup_s"] = time.perf_counter() - start
                log(f"server {server}: ready at {url} after {record['startup_s']:.1f} s")
                asyncio.run(run_levels(url, levels, bodies, args.seed, args.deadline, args.warmup, log, measured))
        except Exception as e:  # the report says so, and the other server runs
            record_failure(record, f"server {server}", e)
        write_report(args.out, "bench_serve", report, markdown(report))
    report["comparisons"] = comparisons(report)
    report["plots"] = plot(report, args.out)
    return report


def main(argv=None) -> int:
    p = arg_parser("serve", __doc__, "a tiny run: the embedded default model in float32, 2 slots, concurrency 1,2, "
                                     "4 requests of 8 tokens, prompts cut from the standard library's json package")
    p.add_argument("--target", help="HF directory of the target (default: the embedded default model)")
    p.add_argument("--draft", help="LongSpec draft of --target (default: the embedded default model's)")
    p.add_argument("--repo-docs", help="jsonl of repository documents (repo, text) for the prompts")
    add_sized_args(p, (("concurrency", counts_arg, "concurrent clients, one level each; empty for none"),
                       ("num-requests", int, "requests per level"),
                       ("max-tokens", int, "max_tokens of each request"),
                       ("bucket", bucket_arg, "LO-HI: prompt tokens, in (LO, HI]"),
                       ("dtype", str, f"of the server and the baseline: {' or '.join(DTYPES)}"),
                       ("max-batch", int, "the server's slots")),
                   DEFAULTS, SMOKE)
    p.add_argument("--request-rates", type=rates_arg, default=(), help="Poisson arrival rates (requests/s), one "
                   "level each; inf: all at once")
    p.add_argument("--temperature", type=temperature_arg, default=0.0, help="of every request (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default 1.0)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for max_tokens tokens whatever the model emits")
    p.add_argument("--seed", type=int, default=0, help="of the prompts, the arrivals and the requests (default 0)")
    p.add_argument("--max-context", type=int, help="tokens per slot (default: the bucket's top + --max-tokens)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="prompt tokens per prefill "
                   f"call, of the servers and the baseline (default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--rounds-per-step", type=int, default=ROUNDS_PER_STEP, help="the draft server's speculative "
                   f"rounds per engine step (default {ROUNDS_PER_STEP})")
    p.add_argument("--compile-on-demand", action="store_true", help="the servers compile each program when first "
                   "needed (a faster start; the first requests at each batch size wait for compilations)")
    p.add_argument("--max-queue", type=int, default=256, help="the server's waiting requests at most (default 256)")
    p.add_argument("--warmup", type=int, help="untimed requests sent at once first (default: the largest "
                                              "concurrency level, or --max-batch)")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds: a level's hard limit (default 600)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to be ready "
                   "(default 900)")
    p.add_argument("--servers", type=servers_arg, default=SERVERS, help="which servers run, in this order: draft "
                   "(with the draft), plain (--no-draft); default: both")
    p.add_argument("--baseline", type=servers_arg, nargs="?", const=SERVERS, default=(), metavar="SERVERS",
                   help="generate() first, in a process of its own, with the draft and without (or those named: "
                        "draft, plain): one prompt at a time and static batches")
    p.add_argument("--baseline-batch", type=int, default=8, help="the static batches' size (default 8)")
    args = parse_sized(p, argv, DEFAULTS, SMOKE)
    if isinstance(args.bucket, str):
        args.bucket = bucket_arg(args.bucket)
    if args.dtype not in DTYPES:
        p.error(f"--dtype: choose from {', '.join(DTYPES)}")
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together (the benchmark runs the server with the draft and without)")
    if min(args.num_requests, args.max_tokens, args.rounds_per_step) <= 0:
        p.error("--num-requests, --max-tokens and --rounds-per-step must be positive")
    if args.max_context is None:
        args.max_context = args.bucket[1] + args.max_tokens
    if args.warmup is None:
        args.warmup = max(args.concurrency, default=args.max_batch)
    args.request_rates = list(args.request_rates)
    if not (args.concurrency or args.request_rates):
        p.error("no load: give --concurrency or --request-rates")
    os.makedirs(args.out, exist_ok=True)
    report = run(args)
    return finish(args.out, "serve", report, markdown(report))
