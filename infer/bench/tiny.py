"""The tiny models' former import path; they live in :mod:`longspec_jax.testing`."""

from longspec_jax.testing import TINY, random_draft, tiny_target

__all__ = ["TINY", "random_draft", "tiny_target"]
