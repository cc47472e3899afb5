"""The engine's compiled programs and the device state they update in place (donated), called from the engine's
loop thread: a prefill chunk, an insertion, a decode step (one per :class:`infer.schedule.Step`), a deactivation."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from infer.generate import on_mesh
from infer.schedule import EnginePlan, Step
from infer.slots import (Admission, StepOutput, empty_prefill_cache, empty_state, insert, plain_step, prefill_chunk,
                         retire, speculative_step)


@dataclasses.dataclass
class Admitting:
    """A request being prefilled, ``chunk`` tokens per call: its prompt right-padded to whole chunks, and where the
    next chunk starts."""

    handle: object
    tokens: np.ndarray
    start: int = 0

    @classmethod
    def start_for(cls, handle, chunk: int) -> "Admitting":
        return cls(handle=handle, tokens=pad_to_chunks(handle.prompt_ids, chunk))


def pad_to_chunks(prompt_ids, chunk: int) -> np.ndarray:
    """The prompt right-padded with zeros to whole prefill chunks."""
    tokens = np.zeros(-(-len(prompt_ids) // chunk) * chunk, np.int32)
    tokens[:len(prompt_ids)] = prompt_ids
    return tokens


class Programs:
    """The slots' device state and the jitted programs over it. The state holds ``rows`` slots, a batch bucket
    (:meth:`resize`): the used slots are rows ``[0, n)`` with ``n <= rows``, so a step computes no more rows than
    its bucket."""

    def __init__(self, plan: EnginePlan, target, draft):
        self.plan, self.params, self.mesh = plan, target.params, target.mesh
        self.weights = None if draft is None else draft.weights
        shapes = plan.shapes
        dtype = target.params["embed"].dtype
        self.rows = plan.buckets[0]
        with on_mesh(self.mesh):
            self.state = jax.jit(functools.partial(empty_state, shapes, dtype, self.rows))()
            self.prefill_cache = jax.jit(functools.partial(empty_prefill_cache, shapes, dtype))()
        one = jax.jit(functools.partial(empty_state, shapes, dtype, 1))()
        self._fill = [np.asarray(x).ravel()[0].item() for x in jax.tree.leaves(one)]  # an empty slot's values
        self._prefill = jax.jit(functools.partial(prefill_chunk, shapes), donate_argnums=(1,))
        self._insert = jax.jit(functools.partial(insert, shapes), donate_argnums=(2,))
        self._retire = jax.jit(retire, donate_argnums=(0,))
        self._resize = jax.jit(_resize_rows, static_argnums=(1, 2))
        self._steps: dict = {}
        self._logits = None

    def prefill(self, tokens: np.ndarray, start: int, prompt_len: int) -> None:
        """Prefills chunk ``[start, start + chunk)`` of a padded prompt into the prefill cache."""
        chunk = self.plan.shapes.base.prefill_chunk
        with on_mesh(self.mesh):
            self._logits, self.prefill_cache = self._prefill(
                self.params, self.prefill_cache, jnp.asarray(tokens[None, start:start + chunk]), np.int32(start),
                np.int32(prompt_len - 1))

    def insert(self, slot: int, prompt_ids, params, seed: int, stop_ids) -> tuple[int, bool]:
        """Moves the prefilled prompt into ``slot`` with its request's settings (``params``: ``max_tokens``,
        ``temperature``, ``top_p``); the first token, and whether the slot goes on decoding."""
        shapes = self.plan.shapes
        width = shapes.window if shapes.draft is not None else 1
        window = np.zeros((1, width), np.int32)
        tail = np.asarray(prompt_ids[-width:], np.int32)
        window[0, width - len(tail):] = tail
        stops = np.full(shapes.stop_width, -1, np.int32)
        stops[:len(stop_ids)] = stop_ids
        new = Admission(slot=np.int32(slot), prompt_len=np.int32(len(prompt_ids)), window_1xW=jnp.asarray(window),
                        max_new=np.int32(params.max_tokens), stop_ids_E=jnp.asarray(stops),
                        temperature=np.float32(params.temperature), top_p=np.float32(params.top_p),
                        seed=np.uint32(seed))
        with on_mesh(self.mesh):
            self.state, first = self._insert(self.params, self.weights, self.state, self.prefill_cache, self._logits,
                                             new)
        return int(first), bool(self.state.active[slot])

    def retire(self, row: int, last: int) -> None:
        """Frees ``row``, moving row ``last`` (the last used one) into it."""
        with on_mesh(self.mesh):
            self.state = self._retire(self.state, np.int32(row), np.int32(last))

    def resize(self, rows: int) -> None:
        """Grows or shrinks the state to ``rows`` slots, keeping the first ones: one array at a time, so that the
        device holds at most one array twice."""
        if rows == self.rows:
            return
        leaves, treedef = jax.tree.flatten(self.state)
        self.state = None
        with on_mesh(self.mesh):
            for i, fill in enumerate(self._fill):
                leaves[i] = self._resize(leaves[i], rows, fill)  # the old array is freed here
        self.state, self.rows = jax.tree.unflatten(treedef, leaves), rows

    def decode(self, step: Step) -> StepOutput:
        """Runs one decode step of every slot."""
        with on_mesh(self.mesh):
            self.state, out = self._step(step)(self.params, self.weights, self.state)
        return out

    def _step(self, step: Step):
        key = (step.greedy, step.use_top_p, step.settings)
        if key not in self._steps:
            if step.settings is None:
                base = dataclasses.replace(self.plan.shapes.base, sampling=step.sampling)
                fun = functools.partial(plain_step, base, self.plan.shapes.draft, step.use_top_p)
            else:
                fun = functools.partial(speculative_step, step.settings, step.use_top_p)
            self._steps[key] = jax.jit(fun, donate_argnums=(2,))
        return self._steps[key]

    def warm_up(self, progress=None) -> None:
        """Compiles every program at every batch bucket by running it on empty slots (leaving them empty);
        ``progress(message)``, where given, hears of each bucket as it starts."""
        chunk = self.plan.shapes.base.prefill_chunk
        self.prefill(np.zeros(chunk, np.int32), 0, 1)
        probe = types.SimpleNamespace(max_tokens=2, temperature=1.0, top_p=1.0)
        for i, rows in enumerate(self.plan.buckets):
            if progress is not None:
                progress(f"compiling the programs of {rows} slot(s) (bucket {i + 1} of {len(self.plan.buckets)})")
            self.resize(rows)
            self.insert(0, [0], probe, 0, [])
            self.retire(0, 0)
            for step in self.plan.steps(rows):
                jax.block_until_ready(self.decode(step))
        self.resize(self.plan.buckets[0])


def _resize_rows(x_Sx, rows: int, fill):
    if rows <= x_Sx.shape[0]:
        return x_Sx[:rows]
    return jnp.concatenate([x_Sx, jnp.full((rows - x_Sx.shape[0],) + x_Sx.shape[1:], fill, x_Sx.dtype)])
