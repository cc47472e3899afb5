"""A continuous-batching engine: a fixed number of slots decoded together in short jitted steps (speculative
rounds or plain steps), with requests admitted into free slots between steps and streamed as they decode.

Python users drive it directly; ``python -m infer.serve`` puts an OpenAI-compatible HTTP server in front of it.

    engine = Engine(target, draft, EngineConfig(max_batch=4, max_context=4096))
    engine.start()
    handle = engine.submit(prompt_ids, RequestParams(max_tokens=64, temperature=0.7, seed=1))
    for chunk in handle:            # or: async for chunk in handle
        print(chunk.token_ids, chunk.finish_reason)
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time

import jax
import numpy as np

from infer.schedule import EnginePlan, check_request
from infer.slot_programs import Admitting, Programs

FINISH_REASONS = ("stop", "length", "abort", "error")
SHRINK_AFTER_PASSES = 16  # target passes with the used slots in a smaller bucket before the state shrinks to it
ROUNDS_PER_STEP = 4  # speculative rounds per step while no prompt waits to be prefilled


class QueueFull(RuntimeError):
    """The engine's waiting queue holds ``max_queue`` requests already."""


class EngineDead(RuntimeError):
    """The engine's loop has stopped (an internal error, or ``shutdown``); no request is accepted."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """``max_batch`` slots, each holding up to ``max_context`` tokens (prompt + output); ``max_queue`` waiting
    requests at most; prompts prefilled ``prefill_chunk`` tokens at a time between decode steps. With a draft,
    ``tree_shape`` and ``draft_sampling`` fix the speculation as in ``generate()`` (``None``: chosen per load;
    ``draft_sampling`` applies to batches with sampled rows); a step runs ``rounds_per_step`` speculative rounds
    in one device loop (one while a prompt waits to be prefilled). ``reproducible``: compiled with ``generate()``'s
    reproducible XLA options (the same tokens in every process, as ``generate()``'s default). ``compile_ahead`` False:
    programs compiled when first needed, not in :meth:`Engine.start` (a faster start, slower first steps)."""

    max_batch: int = 4
    max_context: int = 4096
    max_queue: int = 64
    prefill_chunk: int = 512
    attention: str = "auto"
    tree_shape: tuple[int, ...] | None = None
    draft_sampling: bool | str | None = None
    rounds_per_step: int = ROUNDS_PER_STEP
    reproducible: bool = True
    compile_ahead: bool = True


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """Per-request sampling and stopping. ``temperature`` 0 is greedy; ``seed`` None draws one; decoding stops at
    any of ``stop_token_ids`` (emitted, then finish ``stop``), at the target's EOS unless ``ignore_eos``, or after
    ``max_tokens`` (finish ``length``)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What one decode step gave a request: its new tokens (possibly none), on its last chunk why it ended, and
    when the engine handed it over (``time.monotonic()``)."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    emitted_at: float = 0.0


@dataclasses.dataclass
class Timings:
    """``time.monotonic()`` stamps of a request's life (None until reached)."""

    submitted: float
    admitted: float | None = None      # a slot was given and its prefill began
    first_token: float | None = None
    finished: float | None = None


class RequestHandle:
    """A submitted request: iterate it (blocking, or ``async for``) for its :class:`Chunk` s; ``cancel()`` frees its
    slot at the next step boundary (its last chunk then says ``abort``)."""

    def __init__(self, request_id: int, prompt_ids: tuple[int, ...], params: RequestParams, engine):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.timings = Timings(submitted=time.monotonic())
        self.num_generated = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._engine = engine
        self._chunks: collections.deque[Chunk] = collections.deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cancelled = False

    # -------------------------------------------------------------- producer side (the engine's thread)
    def _push(self, chunk: Chunk) -> None:
        chunk = dataclasses.replace(chunk, emitted_at=time.monotonic())
        with self._lock:
            self.num_generated += len(chunk.token_ids)
            if chunk.token_ids and self.timings.first_token is None:
                self.timings.first_token = chunk.emitted_at
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
                self.timings.finished = chunk.emitted_at
            self._chunks.append(chunk)
            self._ready.notify_all()
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    # -------------------------------------------------------------- consumer side
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Asks the engine to stop this request and free its slot (no effect once it has finished)."""
        self.cancelled = True
        self._engine._wake()

    def __iter__(self):
        while True:
            with self._ready:
                while not self._chunks:
                    self._ready.wait()
                chunk = self._chunks.popleft()
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def __aiter__(self):
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._lock:
            self._async_waiters.append((loop, event))
        try:
            while True:
                with self._lock:
                    chunk = self._chunks.popleft() if self._chunks else None
                    if chunk is None:
                        event.clear()
                if chunk is None:
                    await event.wait()
                    continue
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            with self._lock:
                self._async_waiters.remove((loop, event))

    def result(self) -> list[int]:
        """Blocks until the request ends; all its tokens."""
        return [t for chunk in self for t in chunk.token_ids]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started (monotonic) and the current load."""

    running: int = 0            # requests holding a slot
    waiting: int = 0            # requests queued for a slot
    prompt_tokens: int = 0      # prompt tokens of admitted requests
    generation_tokens: int = 0  # tokens streamed to requests
    plain_steps: int = 0        # plain decode steps, counted per request row
    spec_rounds: int = 0        # speculative rounds, counted per request row
    drafted_tokens: int = 0     # tree nodes proposed to those rows (beyond the root)
    accepted_tokens: int = 0    # draft tokens accepted by verification


class Engine:
    """Continuous batching over ``config.max_batch`` slots of ``target``: with ``draft``, speculative rounds whose
    tree (and whether the draft samples it) is chosen for the number of active slots, or plain steps where no tree
    is predicted to pay (:mod:`infer.schedule`); without one, plain steps. Every row stays exact: a greedy request's
    tokens equal ``generate()``'s of its prompt alone, a sampled one's follow the target's distribution."""

    def __init__(self, target, draft=None, config: EngineConfig = EngineConfig(), *, seed: int = 0):
        self.target, self.config = target, config
        self.plan = EnginePlan.make(target, draft, config)
        self._draft = self.plan.draft
        self._rng = np.random.default_rng(seed)
        self._cv = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[RequestHandle] = []   # request of slot row i, rows [0, n) in use
        self._admitting: Admitting | None = None
        self._small_passes = 0                     # consecutive passes with the used rows in a smaller bucket
        self._counters = collections.Counter()
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    # ---------------------------------------------------------------------------------------------- public
    def start(self, progress=None) -> None:
        """Allocates the slots, compiles every program ahead (running each once on empty slots) unless
        ``compile_ahead`` is off, starts the loop thread. ``progress(message)`` hears how the compilation goes."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self.programs = Programs(self.plan, self.target, self._draft, self.config.reproducible)
        if self.config.compile_ahead:
            self.programs.warm_up(progress)
        self._thread = threading.Thread(target=self._loop, name="longspec-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids, params: RequestParams = RequestParams()) -> RequestHandle:
        """Queues a request. :class:`infer.schedule.RequestError` (a ``ValueError`` naming the problem and its
        ``param``) for a bad prompt or parameters, or a prompt + ``max_tokens`` beyond ``max_context``;
        :class:`QueueFull` when ``max_queue`` requests wait beyond the free slots; :class:`EngineDead`."""
        prompt = check_request(prompt_ids, params, self.target.config.vocab_size, self.config.max_context,
                               self.plan.max_stop_tokens)
        with self._cv:
            if not self.alive:
                raise EngineDead(f"the engine is not running{f': {self.error!r}' if self.error else ''}")
            free = self.config.max_batch - len(self._running) - (self._admitting is not None)
            if len(self._waiting) - free >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting for a slot)")
            handle = RequestHandle(self._next_id, prompt, params, self)
            self._next_id += 1
            self._waiting.append(handle)
            self._cv.notify_all()
        return handle

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(running=len(self._running) + (self._admitting is not None),
                               waiting=len(self._waiting), **self._counters)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def shutdown(self) -> None:
        """Stops the loop; requests still queued or running end with ``abort``."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ---------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        try:
            in_flight = None  # the decode step dispatched last, its outputs not read yet
            while not self._stopping:
                self._drop_cancelled()
                prefilled = self._admit_step()
                launched = self._launch_step() if self._running else None
                if in_flight is not None:  # read while the step just launched runs on the device
                    self._finish_step(*in_flight)
                in_flight = launched
                if in_flight is None and not prefilled:
                    with self._cv:
                        if not (self._waiting or self._stopping or self._admitting):
                            self._cv.wait(timeout=0.5)
        except BaseException as e:  # the device state may be lost: every request ends, the engine is dead
            self.error = e
        finally:
            self._stopping = True
            with self._cv:
                doomed = list(self._waiting) + self._running
                if self._admitting is not None:
                    doomed.append(self._admitting.handle)
                self._waiting.clear()
                self._running.clear()
            for handle in doomed:
                handle.error = repr(self.error) if self.error else None
                handle._push(Chunk((), "error" if self.error else "abort"))

    def _drop_cancelled(self) -> None:
        with self._cv:
            waiting = [h for h in self._waiting if h.cancelled]
            for h in waiting:
                self._waiting.remove(h)
        for h in waiting:
            h._push(Chunk((), "abort"))
        for row in reversed(range(len(self._running))):
            if self._running[row].cancelled:
                self._release(row, Chunk((), "abort"))
        if self._admitting is not None and self._admitting.handle.cancelled:
            self._admitting.handle._push(Chunk((), "abort"))
            self._admitting = None

    def _admit_step(self) -> bool:
        """Prefills one piece of the request being admitted (starting the next waiting one where a slot is free);
        after its last piece the request enters the next slot row and streams its first token. Whether it ran a
        piece."""
        if self._admitting is None:
            with self._cv:
                if not (self._waiting and len(self._running) < self.config.max_batch):
                    return False
                handle = self._waiting.popleft()
            handle.timings.admitted = time.monotonic()
            self._admitting = Admitting.start_for(handle, self.plan.shapes.base.prefill_chunk)
        adm = self._admitting
        tokens_C, start = adm.next_piece()
        self.programs.prefill(tokens_C, start, len(adm.handle.prompt_ids))
        if not adm.finished:
            return True
        self._admitting = None
        row = len(self._running)
        if row >= self.programs.rows:
            self.programs.resize(self.plan.bucket(row + 1))
        seed = adm.handle.params.seed
        seed = int(self._rng.integers(2 ** 31)) if seed is None else seed
        first, active = self.programs.insert(row, adm.handle.prompt_ids, adm.handle.params, seed,
                                             self.plan.stop_ids(adm.handle.params))
        with self._cv:
            self._counters["prompt_tokens"] += len(adm.handle.prompt_ids)
            self._counters["generation_tokens"] += 1
            self._running.append(adm.handle)
        if active:
            adm.handle._push(Chunk((first,)))
        else:
            self._release(row, Chunk((first,), self._reason(adm.handle, [first])))
        return True

    def _launch_step(self) -> tuple:
        """Dispatches one decode step of the running requests (asynchronously): the requests of its rows, the step
        and its outputs, read by :meth:`_finish_step` once the next step is dispatched."""
        handles = list(self._running)
        prefilling = self._admitting is not None or bool(self._waiting and len(handles) < self.config.max_batch)
        step = self.plan.step_for(handles, self.programs.rows, prefilling)
        return handles, step, self.programs.decode(step)

    def _finish_step(self, handles: list, step, out) -> None:
        """Streams a decode step's tokens and ends the requests it finished. Rows ended since it was dispatched
        (cancelled, or finished by the step before, riding along inactive) are skipped."""
        n = len(handles)
        tokens_SxX, emitted_S, active_S, passes_S, verified_S = (
            x[:n] for x in jax.device_get((out.tokens, out.emitted, out.active, out.passes, out.verified)))
        with self._cv:
            self._counters["generation_tokens"] += int(emitted_S.sum())
            passes = int(passes_S.sum())  # target passes, counted per row
            if step.settings is None:
                self._counters["plain_steps"] += passes
            else:
                self._counters["spec_rounds"] += passes
                self._counters["drafted_tokens"] += passes * step.drafted_per_row
                self._counters["accepted_tokens"] += int(verified_S.sum()) - passes
        finished = []
        for row, handle in enumerate(handles):
            if handle not in self._running:
                continue
            new = tuple(int(t) for t in tokens_SxX[row, :emitted_S[row]])
            if active_S[row]:
                if new:
                    handle._push(Chunk(new))
            else:
                finished.append((self._running.index(handle), Chunk(new, self._reason(handle, new))))
        for row, chunk in sorted(finished, key=lambda f: -f[0]):  # the last rows first: the moved rows still run
            self._release(row, chunk)
        self._shrink_when_idle(step.rounds)

    def _shrink_when_idle(self, passes: int) -> None:
        """Moves the state to a smaller batch bucket once the used rows have fitted one for a while and nobody
        waits (growing is immediate, at admission); ``passes``: the target passes of the step just read."""
        bucket = self.plan.bucket(max(len(self._running), 1))
        busy = self._waiting or self._admitting is not None
        self._small_passes = 0 if bucket >= self.programs.rows or busy else self._small_passes + passes
        if self._small_passes >= SHRINK_AFTER_PASSES:
            self.programs.resize(bucket)
            self._small_passes = 0

    def _reason(self, handle: RequestHandle, last_tokens) -> str:
        stops = set(self.plan.stop_ids(handle.params))
        return "stop" if last_tokens and last_tokens[-1] in stops else "length"

    def _release(self, row: int, chunk: Chunk) -> None:
        """Ends the request of ``row``; the last used row moves into it."""
        last = len(self._running) - 1
        self.programs.retire(row, last)
        with self._cv:
            handle = self._running[row]
            self._running[row] = self._running[last]
            self._running.pop()
        handle._push(chunk)
