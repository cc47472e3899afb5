"""Benchmarks: ``python -m infer.bench {decode,spec,drafts,repro,tasks,shard} [options]`` (see ``__main__``).

One harness (:mod:`infer.bench.harness`: logging, timing, copy bandwidth, the shared command line, JSON +
markdown), one module (or a few) per benchmark, the HF PyTorch baseline and near-tie checks.
"""
