"""What the engine decides on the host: request checks, the static plan of an engine (slot shapes, and the
speculation for each load), and which compiled step the current slots run."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from infer.decoding import DecodeSettings
from infer.generate import CAPACITY_ALIGN, plan_speculative
from infer.slots import SlotShapes
from infer.speculation import choose, sampling_kind
from infer.speculative import SpecSettings
from longspec_jax.attention import resolve_impl
from longspec_jax.draft import Draft
from longspec_jax.mesh import DATA
from longspec_jax.sampling import MIN_TEMPERATURE, SamplingConfig
from longspec_jax.tensor_parallel import shard_draft
from pallas.sizes import next_pow2, round_up

MAX_STOP_TOKENS = 8        # stop token ids a request may give, besides the target's EOS ids
SAMPLED_TEMPERATURE = 1.0  # the temperature the speculation of batches with sampled rows is chosen for


class RequestError(ValueError):
    """A request the engine refuses; ``param`` names the offending field (``prompt``, ``max_tokens``, ...)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_request(prompt_ids, params, vocab_size: int, max_context: int, max_stop_tokens: int) -> tuple[int, ...]:
    """The prompt as a tuple of ints, or a :class:`RequestError` naming what is wrong with it or with ``params``."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__") or len(prompt_ids) == 0:
        raise RequestError("the prompt must be a non-empty list of token ids", "prompt")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt_ids):
        raise RequestError("the prompt's token ids must be integers", "prompt")
    prompt = tuple(int(t) for t in prompt_ids)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    p = params
    if isinstance(p.max_tokens, bool) or not isinstance(p.max_tokens, (int, np.integer)) or p.max_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer, got {p.max_tokens!r}", "max_tokens")
    if not (isinstance(p.temperature, (int, float)) and math.isfinite(p.temperature) and p.temperature >= 0):
        raise RequestError(f"temperature must be a finite number >= 0, got {p.temperature!r}", "temperature")
    if not (isinstance(p.top_p, (int, float)) and 0 < p.top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p!r}", "top_p")
    if p.seed is not None and (isinstance(p.seed, bool) or not isinstance(p.seed, (int, np.integer))
                               or not 0 <= p.seed < 2 ** 32):
        raise RequestError(f"seed must be an integer in [0, 2**32) or None, got {p.seed!r}", "seed")
    if len(p.stop_token_ids) > max_stop_tokens:
        raise RequestError(f"at most {max_stop_tokens} stop token ids, got {len(p.stop_token_ids)}",
                           "stop_token_ids")
    bad = [t for t in p.stop_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size)]
    if bad:
        raise RequestError(f"stop token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})",
                           "stop_token_ids")
    if len(prompt) > max_context:
        raise RequestError(f"the prompt has {len(prompt)} tokens, more than the context capacity of {max_context}",
                           "prompt")
    if len(prompt) + p.max_tokens > max_context:
        raise RequestError(f"the prompt's {len(prompt)} tokens + max_tokens {p.max_tokens} exceed the context "
                           f"capacity of {max_context} tokens", "max_tokens")
    return prompt


def step_sampling(greedy: bool) -> SamplingConfig:
    """Greedy, or the temperature the speculation of batches with sampled rows is chosen for."""
    return SamplingConfig(0.0 if greedy else SAMPLED_TEMPERATURE)


def batch_buckets(slots: int, multiple: int = 1) -> tuple[int, ...]:
    """The numbers of slots a decode step runs over: powers of two below ``slots``, and ``slots``, each rounded up
    to a ``multiple`` (a mesh's data axis)."""
    return tuple(sorted({round_up(min(next_pow2(n), slots), multiple) for n in range(1, slots + 1)}))


@dataclasses.dataclass(frozen=True)
class Step:
    """A compiled decode step: ``rounds`` speculative rounds in one device loop (``settings``) or a plain step
    (``settings`` None, one round), greedy for every row or per-row sampling (with the top-p filter compiled in or
    not)."""

    greedy: bool
    use_top_p: bool
    settings: SpecSettings | None
    rounds: int = 1

    @property
    def sampling(self) -> SamplingConfig:
        """The static sampling of its programs: greedy, or the temperature that marks per-row sampling."""
        return step_sampling(self.greedy)

    @property
    def drafted_per_row(self) -> int:
        return 0 if self.settings is None else self.settings.tree.num_nodes - 1


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The static plan of an engine: its slot shapes and, for every batch bucket and for all-greedy or sampled
    rows, the speculation :func:`infer.speculation.choose` predicts fastest at half the context capacity."""

    shapes: SlotShapes
    draft: Draft | None
    eos_ids: tuple[int, ...]
    buckets: tuple[int, ...]
    speculations: dict  # (bucket, greedy) -> Speculation: what was chosen, and why
    settings: dict      # (bucket, greedy) -> SpecSettings | None
    rounds_per_step: int  # speculative rounds in one compiled step
    max_stop_tokens: int = MAX_STOP_TOKENS

    @classmethod
    def make(cls, target, draft, config) -> "EnginePlan":
        if config.max_batch < 1 or config.max_queue < 0 or config.max_context < 2 or config.rounds_per_step < 1:
            raise ValueError(f"max_batch and rounds_per_step must be >= 1, max_queue >= 0 and max_context >= 2; "
                             f"got {config}")
        chunk = config.prefill_chunk
        if chunk <= 0 or chunk & (chunk - 1):
            raise ValueError(f"prefill_chunk must be a positive power of two, got {chunk}")
        tc = target.config
        if config.max_context > tc.max_position_embeddings:
            raise ValueError(f"max_context {config.max_context} is beyond the target's "
                             f"{tc.max_position_embeddings} positions")
        if target.mesh is not None and config.max_batch % target.mesh.shape[DATA]:
            raise ValueError(f"max_batch {config.max_batch} does not split over the mesh's data axis of "
                             f"{target.mesh.shape[DATA]} devices")
        if draft is not None and target.mesh is not None:
            draft = shard_draft(draft, target.mesh)
        impl = resolve_impl(config.attention)
        param_bytes = jnp.dtype(target.dtype).itemsize
        data = 1 if target.mesh is None else target.mesh.shape[DATA]
        buckets = batch_buckets(config.max_batch, data)
        speculations, settings = {}, {}
        for bucket in buckets:
            for greedy in (True, False):
                sampling = step_sampling(greedy)
                if draft is None:
                    speculations[bucket, greedy], settings[bucket, greedy] = None, None
                    continue
                spec = choose(tc, draft.profile, sampling, bucket, config.max_context // 2, config.tree_shape,
                              None if greedy else sampling_kind(config.draft_sampling), param_bytes=param_bytes,
                              draft_vocab_size=draft.vocab_size(tc.vocab_size))
                speculations[bucket, greedy] = spec
                # the tree and the draft's settings; the shapes of its base are the engine's (below)
                settings[bucket, greedy] = None if spec.tree_shape is None else plan_speculative(
                    target, draft, 1, 1, sampling, spec.tree_shape, chunk, impl, spec.draft_sampling or False)
        pending = max([s.tree.max_accept for s in settings.values() if s is not None], default=1)
        capacity = round_up(config.max_context + pending + 1, max(CAPACITY_ALIGN, chunk))
        eos_ids = tuple(tc.eos_token_ids)
        base = DecodeSettings(config=tc, sampling=SamplingConfig(), capacity=capacity, prefill_chunk=chunk,
                              out_len=1, prompt_len=chunk, impl=impl)
        settings = {k: s and dataclasses.replace(s, base=dataclasses.replace(base, sampling=s.base.sampling))
                    for k, s in settings.items()}
        shapes = SlotShapes(base=base, draft=None if draft is None else draft.settings(impl), slots=config.max_batch,
                            pending=pending, stop_width=len(eos_ids) + MAX_STOP_TOKENS,
                            prefill_rows=data)
        return cls(shapes=shapes, draft=draft, eos_ids=eos_ids, buckets=buckets, speculations=speculations,
                   settings=settings, rounds_per_step=config.rounds_per_step)

    def stop_ids(self, params) -> tuple[int, ...]:
        """The tokens that end a request: the target's EOS (unless ``ignore_eos``) and its stop token ids."""
        return (() if params.ignore_eos else self.eos_ids) + tuple(int(t) for t in params.stop_token_ids)

    def bucket(self, used: int) -> int:
        """The smallest batch bucket holding ``used`` slots."""
        return next(b for b in self.buckets if b >= used)

    def step_for(self, handles, rows: int, prefilling: bool) -> Step:
        """The step for these running requests in a state of ``rows`` slots: the speculation of that bucket,
        greedy when every request is; ``rounds_per_step`` rounds, or one while a prompt waits to be prefilled (so
        that its pieces come between short steps)."""
        greedy = all(h.params.temperature < MIN_TEMPERATURE for h in handles)
        use_top_p = any(h.params.top_p < 1 for h in handles if h.params.temperature >= MIN_TEMPERATURE)
        settings = self.settings[rows, greedy]
        rounds = 1 if prefilling or settings is None else self.rounds_per_step
        return Step(greedy=greedy, use_top_p=use_top_p and not greedy, settings=settings, rounds=rounds)

    def steps(self, rows: int) -> list[Step]:
        """Every step a state of ``rows`` slots may run: greedy, and sampled with and without the top-p filter;
        speculative ones of one round and of ``rounds_per_step``."""
        return [Step(greedy=greedy, use_top_p=use_top_p, settings=settings, rounds=rounds)
                for greedy, use_top_p in ((True, False), (False, False), (False, True))
                for settings in (self.settings[rows, greedy],)
                for rounds in ((1,) if settings is None else sorted({1, self.rounds_per_step}))]
