"""Inference: jit-compiled ``generate()`` (plain and speculative), CLI and benchmarks."""

from infer.generate import GenerateOutput, generate
from infer.lookup import PromptLookup

__all__ = ["GenerateOutput", "PromptLookup", "generate"]
