"""The engine's compiled programs and the device state they update in place (donated), called from the engine's
loop thread: a prefill chunk, an insertion, a decode step (one per :class:`infer.schedule.Step`), a deactivation."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np

from infer.generate import compile_options, on_mesh
from infer.schedule import EnginePlan, Step
from infer.slots import (Admission, StepOutput, empty_prefill_cache, empty_state, insert, pin, plain_step,
                         prefill_chunk, retire, speculative_step)


@dataclasses.dataclass
class Admitting:
    """A request being prefilled one piece per call: its prompt right-padded to its pieces (:func:`prefill_pieces`),
    the pieces' sizes, and how many are done."""

    handle: object
    tokens: np.ndarray
    sizes: tuple[int, ...]
    done: int = 0

    @classmethod
    def start_for(cls, handle, chunk: int) -> "Admitting":
        sizes = prefill_pieces(len(handle.prompt_ids), chunk)
        return cls(handle=handle, tokens=padded_prompt(handle.prompt_ids, sum(sizes)), sizes=sizes)

    def next_piece(self) -> tuple[np.ndarray, int]:
        """The next piece's tokens and where it starts; counts it done."""
        start = sum(self.sizes[:self.done])
        self.done += 1
        return self.tokens[start:start + self.sizes[self.done - 1]], start

    @property
    def finished(self) -> bool:
        return self.done == len(self.sizes)


PIECE_HALVINGS = 2  # a prompt's last prefill piece may be the chunk halved up to this often: less padding


def piece_sizes(chunk: int) -> tuple[int, ...]:
    """Every size a prefill piece may have: the chunk and its halves, smallest first."""
    return tuple(sorted({max(chunk >> k, 1) for k in range(PIECE_HALVINGS + 1)}))


def prefill_pieces(prompt_len: int, chunk: int) -> tuple[int, ...]:
    """A prompt's prefill pieces: whole chunks, then the rest padded to the smallest piece size that holds it."""
    whole, rest = divmod(prompt_len, chunk)
    return (chunk,) * whole + ((next(s for s in piece_sizes(chunk) if s >= rest),) if rest else ())


def padded_prompt(prompt_ids, length: int) -> np.ndarray:
    """The prompt right-padded with zeros to ``length`` tokens."""
    tokens = np.zeros(length, np.int32)
    tokens[:len(prompt_ids)] = prompt_ids
    return tokens


class Programs:
    """The slots' device state and the compiled programs over it. The state holds ``rows`` slots, a batch bucket
    (:meth:`resize`): the used slots are rows ``[0, n)`` with ``n <= rows``, so a step computes no more rows than
    its bucket. The insertion, retirement and decode steps are compiled once per bucket (:meth:`warm_up` compiles
    them all ahead), with the XLA options of ``generate()`` (``reproducible``: the same tokens in every process)."""

    def __init__(self, plan: EnginePlan, target, draft, reproducible: bool = True):
        self.plan, self.params, self.mesh = plan, target.params, target.mesh
        self._options = {loop: compile_options(loop, reproducible) or None for loop in ("plain", "speculative")}
        self.weights = None if draft is None else draft.weights
        shapes = plan.shapes
        dtype = target.params["embed"].dtype
        self.rows = plan.buckets[0]
        with on_mesh(self.mesh):
            self.state = jax.jit(functools.partial(empty_state, shapes, dtype, self.rows))()
            self.prefill_cache = jax.jit(functools.partial(empty_prefill_cache, shapes, dtype))()
        one = jax.jit(functools.partial(empty_state, shapes, dtype, 1))()
        self._fill = [np.asarray(x).ravel()[0].item() for x in jax.tree.leaves(one)]  # an empty slot's values
        self._prefill = self._jit(functools.partial(prefill_chunk, shapes), donate_argnums=(1,))
        self._resize = self._jit(_resize_rows, static_argnums=(1, 2))
        self._jitted = {"insert": self._jit(functools.partial(insert, shapes), donate_argnums=(2,)),
                        "retire": self._jit(retire, donate_argnums=(0,))}
        self._executables: dict = {}  # (program, rows) -> compiled
        self._logits = None

    def _jit(self, fun, loop: str = "plain", **kwargs):
        """``fun`` jitted with the XLA options ``generate()`` compiles its ``loop`` with."""
        return jax.jit(fun, compiler_options=self._options[loop], **kwargs)

    def _lower(self, program, state, *args):
        """Program ``program`` (``insert``, ``retire`` or a :class:`Step`) lowered for ``state`` (arrays or their
        shapes) and the rest of its arguments."""
        if program == "insert":
            return self._jitted[program].lower(self.params, self.weights, state, *args)
        if program == "retire":
            return self._jitted[program].lower(state, *args)
        return self._step(program).lower(self.params, self.weights, state)

    def _executable(self, key, lower):
        """The executable of ``key``, compiled from ``lower()`` the first time it is asked for."""
        if key not in self._executables:
            self._executables[key] = lower().compile()
        return self._executables[key]

    def compiled(self, program, *args):
        """The executable of ``program`` (see :meth:`_lower`) for the state's rows, compiled the first time."""
        with on_mesh(self.mesh):
            return self._executable((program, self.rows), lambda: self._lower(program, self.state, *args))

    def _run(self, program, *args):
        """Runs ``program`` on the current state, compiling it for the state's rows the first time."""
        run = self.compiled(program, *args)
        with on_mesh(self.mesh):
            if program == "retire":
                return run(self.state, *args)
            return run(self.params, self.weights, self.state, *args)

    def prefill(self, tokens_C: np.ndarray, start: int, prompt_len: int) -> None:
        """Prefills a piece of a padded prompt, its tokens ``[start, start + C)``, into the prefill cache (``C``: a
        size of :func:`piece_sizes`)."""
        args = self._prefill_args(tokens_C, start, prompt_len)
        with on_mesh(self.mesh):
            run = self._executable(("prefill", len(tokens_C)), lambda: self._prefill.lower(*args))
            self._logits, self.prefill_cache = run(*args)

    def _prefill_args(self, tokens_C, start: int, prompt_len: int) -> tuple:
        return (self.params, self.prefill_cache, jnp.asarray(tokens_C[None]), np.int32(start),
                np.int32(prompt_len - 1))

    def insert(self, slot: int, prompt_ids, params, seed: int, stop_ids) -> tuple[int, bool]:
        """Moves the prefilled prompt into ``slot`` with its request's settings (``params``: ``max_tokens``,
        ``temperature``, ``top_p``); the first token, and whether the slot goes on decoding."""
        self.state, first = self._run("insert", self.prefill_cache, self._logits,
                                      self._admission(slot, prompt_ids, params, seed, stop_ids))
        return int(first), bool(self.state.active[slot])

    def _admission(self, slot: int, prompt_ids, params, seed: int, stop_ids) -> Admission:
        shapes = self.plan.shapes
        width = shapes.window if shapes.draft is not None else 1
        window = np.zeros((1, width), np.int32)
        tail = np.asarray(prompt_ids[-width:], np.int32)
        window[0, width - len(tail):] = tail
        stops = np.full(shapes.stop_width, -1, np.int32)
        stops[:len(stop_ids)] = stop_ids
        return Admission(slot=np.int32(slot), prompt_len=np.int32(len(prompt_ids)), window_1xW=jnp.asarray(window),
                         max_new=np.int32(params.max_tokens), stop_ids_E=jnp.asarray(stops),
                         temperature=np.float32(params.temperature), top_p=np.float32(params.top_p),
                         seed=np.uint32(seed))

    def retire(self, row: int, last: int) -> None:
        """Frees ``row``, moving row ``last`` (the last used one) into it."""
        self.state = self._run("retire", np.int32(row), np.int32(last))

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
        """Runs one decode step of every slot: a plain step, or ``step.rounds`` speculative rounds."""
        self.state, out = self._run(step)
        return out

    def _step(self, step: Step):
        """The jitted decode step."""
        if step.settings is None:
            base = dataclasses.replace(self.plan.shapes.base, sampling=step.sampling)
            fun, loop = functools.partial(plain_step, base, self.plan.shapes.draft, step.use_top_p), "plain"
        else:
            fun, loop = functools.partial(speculative_step, step.settings, step.use_top_p, step.rounds), "speculative"
        return self._jit(fun, loop, donate_argnums=(2,))

    def warm_up(self, progress=None, threads: int | None = None) -> None:
        """Compiles every program of every batch bucket, ``threads`` compilations at a time (default: one per CPU
        core), then runs each once on empty slots (leaving them empty), which loads them. ``progress(message)``,
        where given, hears how it goes."""
        threads = threads or os.cpu_count() or 1
        sizes = piece_sizes(self.plan.shapes.base.prefill_chunk)
        with on_mesh(self.mesh):  # first the prefill pieces: a prefill's logits are an insertion's argument
            lowered = {("prefill", c): self._prefill.lower(*self._prefill_args(np.zeros(c, np.int32), 0, 1))
                       for c in sizes}
        self._compile(lowered, progress, threads)
        for c in sizes:
            self.prefill(np.zeros(c, np.int32), 0, 1)
        probe = types.SimpleNamespace(max_tokens=2, temperature=1.0, top_p=1.0)
        self._compile_ahead(probe, progress, threads)
        if progress is not None:
            progress("loading the programs")
        for rows in self.plan.buckets:
            self.resize(rows)
            self.insert(0, [0], probe, 0, [])
            self.retire(0, 0)
            for step in self.plan.steps(rows):
                jax.block_until_ready(self.decode(step))
        self.resize(self.plan.buckets[0])

    def _compile_ahead(self, probe, progress, threads: int) -> None:
        """Lowers the insertion, retirement and decode steps of every bucket on the shapes of a state of its rows,
        and compiles them."""
        lowered = {}
        row = np.int32(0)
        with on_mesh(self.mesh):
            for rows in self.plan.buckets:
                state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype,
                                                                    sharding=x.sharding), self.state)
                lowered["insert", rows] = self._lower("insert", state, self.prefill_cache, self._logits,
                                                      self._admission(0, [0], probe, 0, []))
                lowered["retire", rows] = self._lower("retire", state, row, row)
                for step in self.plan.steps(rows):
                    lowered[step, rows] = self._lower(step, state)
        self._compile(lowered, progress, threads)

    def _compile(self, lowered: dict, progress, threads: int) -> None:
        """Compiles ``lowered`` programs side by side (XLA compiles outside Python's lock) into the executables."""
        if progress is not None:
            progress(f"compiling {len(lowered)} programs, {min(threads, len(lowered))} at a time")
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            self._executables.update(zip(lowered, pool.map(lambda program: program.compile(), lowered.values())))


def _resize_rows(x_Sx, rows: int, fill):
    if rows <= x_Sx.shape[0]:
        return pin(x_Sx[:rows])
    return pin(jnp.concatenate([x_Sx, jnp.full((rows - x_Sx.shape[0],) + x_Sx.shape[1:], fill, x_Sx.dtype)]))
