"""The engine's device side: slots with preallocated caches, and the jitted programs over them (a prefill chunk
of one prompt, its insertion into a slot, one decode step of every slot, the retirement of a slot).

Each slot carries its own sampling (temperature, top-p), stop rules (token ids, most tokens) and random stream,
as arrays, so one compiled program serves any mix of requests. A decode step is a speculative round
(:func:`infer.speculative.spec_round`) or a plain step over all slots; the used slots are rows ``[0, n)``, the
others ride along inactive with empty caches. Between steps a slot's state is what
:func:`infer.speculative.speculative_start` leaves: the target cache holds every token but the pending root, the
draft's ring every token but the pending ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from infer.decoding import DecodeSettings, Progress, StopCriteria
from infer.plain import decode_step
from infer.speculative import SpecSettings, SpecState, spec_round
from longspec_jax.draft import DraftSettings, DraftWeights, draft_prefill_window, pending_kv
from longspec_jax.kv_cache import KVCache, RingCache, init_cache
from longspec_jax.mesh import HEADS, ROWS, constrain
from longspec_jax.sampling import RowSampling, select_tokens, split
from longspec_jax.target import forward, lm_head_logits
from longspec_jax.tree import RANK_SLOTS


@struct.dataclass
class SlotState:
    """Everything the slots hold on the device, ``S`` slots."""

    cache: KVCache             # target KV cache [S, capacity]
    ring: RingCache | None     # the draft's ring cache [S, R] (None without a draft)
    pending: jax.Array         # [S, A] int32: the last step's emitted tokens, the root last
    num_pending: jax.Array     # [S] int32
    active: jax.Array          # [S] bool: decoding (not free, not finished)
    generated: jax.Array       # [S] int32: tokens emitted so far (the first included)
    max_new: jax.Array         # [S] int32: most tokens to emit
    stop_ids: jax.Array        # [S, E] int32: tokens that end the request (-1: none)
    temperature: jax.Array     # [S] float32 (0: greedy)
    top_p: jax.Array           # [S] float32
    keys: jax.Array            # [S, 2] uint32: each slot's random stream

    def row_sampling(self, use_top_p: bool) -> RowSampling:
        return RowSampling(temperature=self.temperature, top_p=self.top_p, use_top_p=use_top_p)


@dataclasses.dataclass(frozen=True)
class SlotShapes:
    """The static shapes of an engine: slots, cache capacity, pending width (1 + the deepest tree), stop ids per
    slot, prefill chunk and the draft's ring window fed at insertion."""

    base: DecodeSettings        # config, capacity, prefill chunk, impl (its sampling is unused)
    draft: DraftSettings | None
    slots: int
    pending: int
    stop_width: int
    prefill_rows: int = 1       # rows of the prefill cache: the mesh's data axis (each computes the same prompt)

    @property
    def window(self) -> int:
        return self.draft.config.ring_capacity


def empty_state(shapes: SlotShapes, dtype, rows: int) -> SlotState:
    """``rows`` empty slots."""
    config, S = shapes.base.config, rows
    ring = None
    if shapes.draft is not None:
        c = shapes.draft.config
        ring = RingCache.empty(S, c.ring_capacity, c.num_kv_heads, c.head_dim, shapes.draft.dtype)
    return pinned(SlotState(cache=init_cache(config.num_layers, S, shapes.base.capacity, config.num_kv_heads,
                                             config.head_dim, dtype),
                            ring=ring, pending=jnp.zeros((S, shapes.pending), jnp.int32),
                            num_pending=jnp.ones((S,), jnp.int32), active=jnp.zeros((S,), bool),
                            generated=jnp.zeros((S,), jnp.int32), max_new=jnp.zeros((S,), jnp.int32),
                            stop_ids=jnp.full((S, shapes.stop_width), -1, jnp.int32),
                            temperature=jnp.zeros((S,), jnp.float32), top_p=jnp.ones((S,), jnp.float32),
                            keys=jnp.zeros((S, 2), jnp.uint32)))


def pin(x_Sx: jax.Array) -> jax.Array:
    """A state array laid out as every program takes it, on a mesh: rows over the data axis (and K/V heads over
    the model axis), so that a compiled program's output is its next call's input."""
    return constrain(x_Sx, HEADS if x_Sx.ndim == 4 else ROWS)


def pinned(state: SlotState) -> SlotState:
    return jax.tree.map(pin, state)


def empty_prefill_cache(shapes: SlotShapes, dtype) -> KVCache:
    """The cache a prompt is prefilled into before its insertion (its row 0; one row per data shard)."""
    config = shapes.base.config
    return init_cache(config.num_layers, shapes.prefill_rows, shapes.base.capacity, config.num_kv_heads,
                      config.head_dim, dtype)


def prefill_chunk(shapes: SlotShapes, params, cache: KVCache, tokens_1xC, start, last_index):
    """Runs prompt tokens ``[start, start + C)`` (right-padded past the prompt) in every row of the prefill cache
    and writes their K/V; returns the float32 logits after the prompt's token ``last_index`` (meaningful in the
    chunk holding it) and the cache."""
    R, C = shapes.prefill_rows, tokens_1xC.shape[1]
    tokens_RxC = jnp.broadcast_to(tokens_1xC, (R, C))
    positions_RxC = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (R, C))
    cache = cache.replace(lengths=jnp.full((R,), start, jnp.int32))
    mask_RxCxC = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)), (R, C, C))
    hidden_RxCxd, cache = forward(params, shapes.base.config, tokens_RxC, positions_RxC, cache, mask_RxCxC,
                                  impl=shapes.base.impl)
    local = jnp.clip(last_index - start, 0, C - 1)
    hidden_Rx1xd = jax.lax.dynamic_slice_in_dim(hidden_RxCxd, local, 1, axis=1)
    return lm_head_logits(params, hidden_Rx1xd)[:, 0], cache


@struct.dataclass
class Admission:
    """A request entering a slot (traced): its prompt length, the prompt's last ring-window tokens, sampling,
    stop rules and seed."""

    slot: jax.Array            # int32 scalar
    prompt_len: jax.Array      # int32 scalar
    window_1xW: jax.Array      # int32: prompt tokens ending at the prompt's last (left-padded)
    max_new: jax.Array         # int32 scalar
    stop_ids_E: jax.Array      # int32 [E]
    temperature: jax.Array     # float32 scalar
    top_p: jax.Array           # float32 scalar
    seed: jax.Array            # uint32 scalar


def insert(shapes: SlotShapes, params, weights: DraftWeights | None, state: SlotState, prefilled: KVCache,
           logits_1xV, new: Admission) -> tuple[SlotState, jax.Array]:
    """Copies a prefilled one-row cache into slot ``new.slot``, fills the slot's ring from the prompt's last
    tokens, picks the first token with the request's sampling and activates the slot (unless that token already
    ends it). Returns the state and the first token."""
    s, R = new.slot, shapes.prefill_rows
    sampling = RowSampling(temperature=new.temperature[None], top_p=new.top_p[None], use_top_p=True)
    key, sub = split(jax.random.PRNGKey(new.seed))
    first = select_tokens(logits_1xV[:1], sub[None], sampling)[0]

    def put(buffer_SxLxKxD, row_1xLxKxD):
        return jax.lax.dynamic_update_slice_in_dim(buffer_SxLxKxD, row_1xLxKxD, s, axis=0)

    cache = state.cache.replace(k=tuple(put(k, p[:1]) for k, p in zip(state.cache.k, prefilled.k)),
                                v=tuple(put(v, p[:1]) for v, p in zip(state.cache.v, prefilled.v)),
                                lengths=state.cache.lengths.at[s].set(new.prompt_len))
    ring = state.ring
    if shapes.draft is not None:
        window_RxW = jnp.broadcast_to(new.window_1xW, (R, new.window_1xW.shape[1]))
        row = draft_prefill_window(shapes.draft, weights, params, window_RxW, jnp.full((R,), new.prompt_len))
        ring = RingCache(k=put(ring.k, row.k[:1]), v=put(ring.v, row.v[:1]), pos=put(ring.pos, row.pos[:1]))
    stop = StopCriteria(max_new=new.max_new, eos_ids=new.stop_ids_E)
    done = stop.is_eos(first) | (new.max_new <= 1)
    state = state.replace(cache=cache, ring=ring, pending=state.pending.at[s].set(0).at[s, 0].set(first),
                          num_pending=state.num_pending.at[s].set(1), active=state.active.at[s].set(~done),
                          generated=state.generated.at[s].set(1), max_new=state.max_new.at[s].set(new.max_new),
                          stop_ids=state.stop_ids.at[s].set(new.stop_ids_E),
                          temperature=state.temperature.at[s].set(new.temperature),
                          top_p=state.top_p.at[s].set(new.top_p), keys=state.keys.at[s].set(key))
    return pinned(state), first


def retire(state: SlotState, row, last) -> SlotState:
    """Frees ``row`` and keeps the used rows contiguous: row ``last`` (the last used one) moves into it, in every
    array, and is left inactive with an empty cache (so attention skips it)."""
    moved = jax.tree.map(lambda x_Sx: x_Sx.at[row].set(x_Sx[last]), state)
    return pinned(moved.replace(active=moved.active.at[last].set(False),
                                cache=moved.cache.replace(lengths=moved.cache.lengths.at[last].set(0))))


@struct.dataclass
class StepOutput:
    """What a decode step gave each slot: ``tokens[s, :emitted[s]]`` are its new tokens; ``active``: still
    decoding after the step; ``passes``: the target passes (rounds) it decoded the slot in; ``verified``: the
    tokens those passes' verifications gave it (accepted + 1 each)."""

    tokens: jax.Array     # [S, X] int32
    emitted: jax.Array    # [S] int32
    active: jax.Array     # [S] bool
    passes: jax.Array     # [S] int32 (0 for rows not decoding)
    verified: jax.Array   # [S] int32


def _step_progress(state: SlotState, width: int) -> tuple[Progress, StopCriteria]:
    """A step's own output buffer of ``width`` tokens per slot and its stop rule, both counted from the step's
    start (so the step's new tokens land at ``[0, emitted)``)."""
    S = state.active.shape[0]
    progress = Progress(tokens=jnp.full((S, width), -1, jnp.int32), num_generated=jnp.zeros((S,), jnp.int32),
                        num_rounds=jnp.zeros((S,), jnp.int32), done=~state.active)
    return progress, StopCriteria(max_new=state.max_new - state.generated, eos_ids=state.stop_ids)


def _per_row(base: DecodeSettings, state: SlotState, use_top_p: bool) -> DecodeSettings:
    """``base`` with the slots' per-row sampling (traced) in place of its static one, unless it is greedy (every row
    greedy: the static argmax path)."""
    if base.sampling.greedy:
        return base
    return dataclasses.replace(base, sampling=state.row_sampling(use_top_p))


def speculative_step(settings: SpecSettings, use_top_p: bool, rounds: int, params, weights: DraftWeights,
                     state: SlotState) -> tuple[SlotState, StepOutput]:
    """``rounds`` speculative rounds of every active slot, in one device loop (``settings.base.sampling`` greedy:
    every row greedy, beams allowed; otherwise each row samples as its slot says). A slot that finishes in one of
    them rides along inactive in the rest. ``rounds`` is static: a loop of known trip count runs its rounds back
    to back on a GPU, where a traced count makes the host read the loop's predicate after every round."""
    settings = dataclasses.replace(settings, base=_per_row(settings.base, state, use_top_p))
    depth, A = settings.tree.depth, settings.tree.max_accept
    progress, stop = _step_progress(state, rounds * A)
    spec = SpecState(cache=state.cache, ring=state.ring, pending=state.pending, num_pending=state.num_pending,
                     progress=progress, accept_counts=jnp.zeros((state.active.shape[0], A), jnp.int32),
                     rank_tried=jnp.zeros((depth, RANK_SLOTS), jnp.int32),
                     rank_accepted=jnp.zeros((depth, RANK_SLOTS), jnp.int32), key=state.keys)
    spec = jax.lax.fori_loop(0, rounds, lambda _, s: spec_round(settings, params, weights, stop, s), spec)
    verified_S = jnp.sum(spec.accept_counts * jnp.arange(1, A + 1), axis=1)
    return _finish(state, spec.cache, spec.ring, spec.pending, spec.num_pending, spec.progress, spec.key,
                   verified_S)


def plain_step(base: DecodeSettings, draft: DraftSettings | None, use_top_p: bool, params,
               weights: DraftWeights | None, state: SlotState) -> tuple[SlotState, StepOutput]:
    """One target step of every active slot; with a draft, the pending tokens also enter its ring, so that a
    later speculative round finds the ring complete."""
    base = _per_row(base, state, use_top_p)
    active = state.active
    root_S = jnp.take_along_axis(state.pending, state.num_pending[:, None] - 1, axis=1)[:, 0]
    keys, sub = split(state.keys)
    token_S, cache = decode_step(params, base, state.cache, root_S, sub)
    cache = cache.replace(lengths=cache.lengths + active.astype(jnp.int32))
    ring = state.ring
    if draft is not None:
        k, v, positions, valid = pending_kv(draft, weights, params, state.cache.lengths, state.pending,
                                            state.num_pending)
        ring = ring.write(k, v, positions, valid & active[:, None])
    progress, stop = _step_progress(state, 1)
    progress = progress.emit(token_S[:, None], jnp.ones_like(token_S), stop)
    pending = jnp.where(active[:, None], state.pending.at[:, 0].set(token_S), state.pending)
    num_pending = jnp.where(active, 1, state.num_pending)
    return _finish(state, cache, ring, pending, num_pending, progress, keys, progress.num_rounds)


def _finish(state: SlotState, cache, ring, pending, num_pending, progress: Progress, keys, verified_S):
    """The state after a step whose ``progress`` (:func:`_step_progress`) holds its new tokens, and the step's
    output (``verified_S``: the tokens its verifications gave each slot)."""
    out = StepOutput(tokens=progress.tokens, emitted=progress.num_generated, active=~progress.done,
                     passes=progress.num_rounds, verified=verified_S)
    cache = cache.replace(lengths=jnp.where(progress.done, 0, cache.lengths))  # finished rows: nothing to attend
    return pinned(state.replace(cache=cache, ring=ring, pending=pending, num_pending=num_pending,
                                active=~progress.done, generated=state.generated + progress.num_generated,
                                keys=keys)), out

