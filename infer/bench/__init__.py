"""Benchmarks and their helpers: ``python -m infer.bench {decode,attention,spec} [options]`` (see ``__main__``).

One harness (:mod:`infer.bench.harness`: logging, in-loop timing, copy bandwidth, JSON + markdown), one module
per benchmark, the HF PyTorch baseline, oracle drafts, near-tie checks and the tiny models of ``--smoke`` runs.
"""
