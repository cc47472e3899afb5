"""Kernel-development instruments, run from the repository root (not installed with the package):

    python -m tools.attention    the attention kernels alone: in-loop timed, sweeps, the Mosaic cache half by phase
    python -m tools.profile      per-op GPU time of a round's phases (profiler trace), in-round ablation, variants
    python -m tools.spec_phases  each phase of a round in the in-loop timing, against its bytes / FLOPs floor

Each takes ``--smoke`` (a tiny CPU run) and ``--out DIR``; ``--help`` lists its options.
"""
