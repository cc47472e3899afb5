"""``python -m infer.bench NAME [options]``: runs one benchmark (``COMMANDS`` names them); ``... NAME --help`` lists
its options. Each writes ``bench_NAME.json`` and ``bench_NAME.md`` under ``--out``; ``--smoke`` is a tiny CPU run.
The kernel-development instruments are in ``tools/`` beside the package."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "decode": "plain decode tokens/s: ours vs HF PyTorch generate vs the memory-bandwidth floor",
    "spec": "speculative decoding on an 8B-cost pair: tokens/s and tau against plain decoding, draft-state bytes",
    "drafts": "trained drafts on held-out prompts: tau and tokens/s against plain decoding, by context and T",
    "repro": "the same greedy generate() in several fresh processes: equal tokens? and the speed cost of the fix",
    "tasks": "long-context tasks: plain, LongSpec trees, chains, prompt lookup, HF; by bucket, T and batch",
    "shard": "tensor parallel: plain and speculative tokens/s on N devices vs one, the longest context that fits",
    "serve": "the OpenAI-compatible server under load, with the draft and without: TTFT, TPOT, ITL, throughput",
}
MOVED = {"attention": "python -m tools.attention", "profile": "python -m tools.profile"}  # run from a checkout


def usage() -> str:
    lines = ["usage: python -m infer.bench {" + ",".join(COMMANDS) + "} [options]", "", "benchmarks:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines + ["", "python -m infer.bench NAME --help lists the options of NAME."])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in MOVED:
        print(f"{argv[0]} is a kernel-development tool now: {MOVED[argv[0]]} (from the repository root)",
              file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    importlib.import_module(f"infer.bench.{argv[0]}").main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
