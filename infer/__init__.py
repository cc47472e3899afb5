"""Inference: jit-compiled ``generate()`` (plain and speculative), CLI and benchmarks."""

from infer.generate import GenerateOutput, generate

__all__ = ["GenerateOutput", "generate"]
