"""A ``generate()`` call timed by phase, as ``python -m infer.main`` reports it: compiling its program, prefill
(the program run to its first token only) and decoding (the rest of the full run)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time

import jax
import jax.numpy as jnp

from infer.decoding import StopCriteria


@dataclasses.dataclass(frozen=True)
class CallPhases:
    """Seconds of one compiled ``generate()`` call (:func:`timing_phases`)."""

    compile_s: float  # tracing, lowering and compiling its program
    prefill_s: float  # the program run to its first token only: prefill and the first token
    run_s: float      # the program run in full: prefill and decoding

    @property
    def decode_s(self) -> float:
        """The decoding after the first token: the full run less the first-token-only run."""
        return self.run_s - self.prefill_s


_records: contextvars.ContextVar[list | None] = contextvars.ContextVar("phase_records", default=None)


@contextlib.contextmanager
def timing_phases():
    """Within it, each ``generate()`` call appends its :class:`CallPhases` to the yielded list: it compiles its
    program ahead of time (later calls reuse it), runs it twice with the stop limit set to one token, streaming
    nothing (the first run is not timed: it loads the program), then runs it as asked (the call's output and
    stream)."""
    with collecting(_records) as records:
        yield records


@contextlib.contextmanager
def collecting(records_var: contextvars.ContextVar):
    """Sets ``records_var`` to a new list for the duration, and yields it (the recording contexts of
    ``generate()``)."""
    records: list = []
    token = records_var.set(records)
    try:
        yield records
    finally:
        records_var.reset(token)


def phase_records() -> list[CallPhases] | None:
    """The list :func:`timing_phases` yields, where a call is inside it."""
    return _records.get()


def first_token_only(args: tuple) -> tuple:
    """A loop's arguments with its :class:`StopCriteria` stopping after one token: prefill, and no decode step."""
    return tuple(a.replace(max_new=jnp.ones_like(a.max_new)) if isinstance(a, StopCriteria) else a for a in args)


def timed(program, args: tuple):
    """Runs the compiled ``program`` on ``args`` to completion, its host callbacks included: (seconds, output)."""
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    jax.effects_barrier()
    return time.perf_counter() - start, out
