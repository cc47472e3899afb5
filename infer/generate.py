"""The public ``generate()``: input checks, shape planning, padding, one jit-compiled call per shape bucket (plain
or speculative), and the outputs."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.decoding import DecodeSettings, StopCriteria
from infer.lookup import LookupSettings, PromptLookup, lookup_generate
from infer.phases import CallPhases, collecting, first_token_only, phase_records, timed
from infer.plain import plain_generate
from infer.speculation import Speculation, choose, sampling_kind
from infer.speculative import SPECULATIVE_OPTIONS, SpecSettings, sampled_tree_acceptance, speculative_generate
from longspec_jax.attention import resolve_impl
from longspec_jax.draft import Draft
from longspec_jax.mesh import DATA
from longspec_jax.sampling import SamplingConfig
from longspec_jax.speculation_profile import DEFAULT_PROFILE, MAX_CHILDREN, allocate_branching
from longspec_jax.target import Target
from longspec_jax.tensor_parallel import shard_draft
from longspec_jax.tree import TreeSpec
from pallas.sizes import next_pow2, round_up

DEFAULT_PREFILL_CHUNK = 512
CAPACITY_ALIGN = 512


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray         # int32 [B, max_new_tokens]; -1 after a sequence's end
    num_generated: np.ndarray  # int32 [B]
    num_rounds: np.ndarray     # int32 [B]: target forward passes after prefill
    mean_accepted: float       # tau = tokens generated / (rounds + 1), over the batch
    accept_counts: np.ndarray | None = None  # speculative: [B, depth + 1] rounds that emitted j + 1 tokens
    speculation: Speculation | None = None   # with a draft: the tree and sampling used, and why
    rank_tried: np.ndarray | None = None     # speculative: [depth, ranks] children tried, by depth and sibling rank
    rank_accepted: np.ndarray | None = None  # speculative: [depth, ranks] children accepted

    def texts(self, tokenizer) -> list[str]:
        return [tokenizer.decode(row[:n].tolist()) for row, n in zip(self.tokens, self.num_generated)]


def normalize_prompts(input_ids, vocab_size: int) -> list[np.ndarray]:
    """Accepts ``[B, T]`` arrays, a list of token lists (ragged), or one flat token list."""
    if isinstance(input_ids, (np.ndarray, jax.Array)):
        array = np.asarray(input_ids)
        if array.ndim == 1:
            array = array[None]
        if array.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {array.shape}")
        rows = list(array)
    elif isinstance(input_ids, Sequence) and input_ids and all(isinstance(t, (int, np.integer)) for t in input_ids):
        rows = [np.asarray(input_ids)]
    elif isinstance(input_ids, Sequence) and input_ids:
        rows = [np.asarray(r) for r in input_ids]
    else:
        raise ValueError("input_ids must be a non-empty [B, T] int array or a non-empty list of token lists")
    prompts = []
    for b, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"prompt {b} must be a non-empty 1-D list of token ids")
        if not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {b} has non-integer token ids (dtype {row.dtype})")
        bad = row[(row < 0) | (row >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {b} has token id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
        prompts.append(row.astype(np.int32))
    return prompts


def plan_shapes(max_prompt: int, max_new_tokens: int, slack: int, prefill_chunk: int) -> tuple[int, int, int, int]:
    """Bucketed (padded prompt length, prefill chunk, output length, cache capacity)."""
    if max_prompt <= prefill_chunk:
        padded = max(16, next_pow2(max_prompt))
        chunk = padded
    else:
        padded, chunk = round_up(max_prompt, prefill_chunk), prefill_chunk
    out_len = max(16, next_pow2(max_new_tokens))
    capacity = round_up(max(padded, max_prompt + out_len + slack), CAPACITY_ALIGN)
    return padded, chunk, out_len, capacity


# XLA options of a reproducible compile: no autotuning, whose timing-based kernel choices differ between processes
# and with them the bf16 rounding; and GEMMs on cuBLAS's fixed heuristics, since an untuned Triton GEMM takes its
# default tiles (10x slower prefill, 2.5x slower decode on the padded 8B pair). The cost:
# docs/results.md, "The same tokens in every process".
REPRODUCIBLE_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def _plain_loop(params, tokens, lengths, stop, key, settings, on_tokens=None):
    return plain_generate(params, settings, tokens, lengths, stop, key, on_tokens)


def _speculative(target_params, weights, tokens, lengths, stop, key, settings):
    return speculative_generate(settings, target_params, weights, tokens, lengths, stop, key)


def _lookup(target_params, tokens, lengths, stop, key, settings):
    return lookup_generate(settings, target_params, tokens, lengths, stop, key)


_LOOPS = {"plain": (_plain_loop, ("settings", "on_tokens")), "speculative": (_speculative, ("settings",)),
          "lookup": (_lookup, ("settings",))}


@functools.cache
def _compiled(loop: str, options: tuple) -> callable:
    """The jitted plain, speculative or prompt-lookup loop, compiled with XLA ``options`` (``(name, value)``
    pairs)."""
    fun, static = _LOOPS[loop]
    return jax.jit(fun, static_argnames=static, compiler_options=dict(options) or None)


def compile_options(loop: str, reproducible: bool) -> dict:
    """The XLA options ``generate()`` compiles a ``loop`` (plain, speculative or lookup) with."""
    return {**(REPRODUCIBLE_OPTIONS if reproducible else {}),
            **(SPECULATIVE_OPTIONS if loop == "speculative" else {})}


_memory_records: contextvars.ContextVar[list | None] = contextvars.ContextVar("memory_records", default=None)


@contextlib.contextmanager
def recording_program_memory():
    """Within it, each ``generate()`` call also appends its compiled program's peak device bytes to the yielded
    list (None where the backend gives no analysis): XLA's memory analysis of the whole call (weights, prompts,
    caches, temporaries, outputs). Unlike the device's peak counter, it is per program and needs no reset."""
    with collecting(_memory_records) as records:
        yield records


def _call_loop(loop: str, reproducible: bool, *args, **static):
    """Runs a compiled loop (its peak bytes recorded inside :func:`recording_program_memory`, its phases timed
    inside :func:`infer.phases.timing_phases`)."""
    jitted = _compiled(loop, tuple(sorted(compile_options(loop, reproducible).items())))
    records, phases = _memory_records.get(), phase_records()
    if records is None and phases is None:
        return jitted(*args, **static)
    start = time.perf_counter()
    program = jitted.lower(*args, **static).compile()  # cached by jax: the jitted calls after it reuse it
    compile_s = time.perf_counter() - start
    if records is not None:
        peak = getattr(program.memory_analysis(), "peak_memory_in_bytes", None)  # None where a backend gives none
        records.append(None if peak is None else int(peak))
    if phases is None:
        return program(*args)
    _stream_sinks.append(lambda tokens_B, emitted_B: None)  # the first-token-only runs stream nothing
    try:
        timed(program, first_token_only(args))  # loads the program: its first run's costs are neither phase's
        prefill_s = timed(program, first_token_only(args))[0]
    finally:
        _stream_sinks.pop()
    run_s, out = timed(program, args)
    phases.append(CallPhases(compile_s=compile_s, prefill_s=prefill_s, run_s=run_s))
    return out


_stream_sinks: list = []  # the on_tokens callbacks of the generate calls in progress (innermost last)


def _stream_to_sink(tokens_B, emitted_B) -> None:
    """The one host callback compiled into streaming loops; forwards to the current call's ``on_tokens`` (so
    a new callback does not recompile)."""
    _stream_sinks[-1](np.asarray(tokens_B), np.asarray(emitted_B))


def on_mesh(mesh):
    """The context a compiled loop runs in: the target's mesh (sharded decoding, :mod:`longspec_jax.mesh`), or
    none on one device."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _replay(out: "GenerateOutput", on_tokens) -> None:
    for step in range(int(out.num_generated.max(initial=0))):
        on_tokens(out.tokens[:, step], step < out.num_generated)


def generate(target: Target, input_ids, draft=None, max_new_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, tree_shape: tuple[int, ...] | None = None, eos_token_id=None,
             seed: int = 0, *, max_context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             attention: str = "auto", on_tokens=None, reproducible: bool = True,
             pad_prompts_to: int | None = None, draft_sampling: bool | str | None = None) -> GenerateOutput:
    """Generates up to ``max_new_tokens`` per prompt; speculative when a ``draft`` is given: a LongSpec
    :class:`~longspec_jax.draft.Draft` or :class:`infer.lookup.PromptLookup` (n-gram chains from prompt +
    output; ``tree_shape`` unused).

    With a LongSpec draft, ``generate`` chooses how to speculate unless told: the tree's shape and whether the
    draft samples it, from the temperature, the batch, the context length and the draft's measured acceptance
    (its ``speculation_profile.json``), or plain decoding where no tree is predicted to pay;
    ``out.speculation`` says what it chose and why (:mod:`infer.speculation`). Overrides: ``tree_shape``
    (level widths, e.g. ``(4, 16, 16, 16, 16)`` or the chain ``(1, 1, 1, 1)``) and ``draft_sampling``:
    ``False`` for the draft's top-k beams (children verified against the target's own choice at each node),
    ``True`` (or ``"without_replacement"``) for children sampled from the draft without replacement, or
    ``"top_plus_one"`` for its top tokens and one sampled child, at T > 0 verified by recursive rejection
    sampling (:mod:`longspec_jax.multidraft`). Every choice is lossless: greedy output equals plain decoding,
    and sampled output follows the target's own distribution.

    ``eos_token_id``: an id or list of ids; ``None`` uses the target's own (from its config), ``[]`` disables
    stopping. ``max_context`` bounds prompt + new tokens (default: the target's max_position_embeddings).
    ``on_tokens(tokens_B, emitted_B)``: called on the host with every step's tokens ``[B]`` and a mask of the
    rows that emitted one, in order, while plain decoding runs (speculative decoding: after the call, one step
    per token).
    ``attention``: ``auto`` (on a GPU: for verification, prefill and the draft's cross-attention the Mosaic GPU
    cache half on Hopper and cuDNN's on other GPUs, Pallas kernels otherwise; XLA elsewhere), ``gpu``,
    ``pallas``, ``cudnn``, ``mosaic``, ``xla`` or ``naive`` (see
    :func:`longspec_jax.attention.resolve_impl`).
    ``pad_prompts_to``: plan shapes as if the longest prompt had this many tokens (at least), so calls with
    prompts of different lengths up to it share one compiled program (prefill then also runs over the padding).
    ``reproducible``: compile with :data:`REPRODUCIBLE_OPTIONS`, so that every process gives the same tokens on
    the same GPU model and software stack; ``False`` lets XLA autotune kernels by timing them. The speculative
    loop adds :data:`infer.speculative.SPECULATIVE_OPTIONS` either way.
    A target with a ``mesh`` (``load_target(path, mesh=...)``) decodes sharded over it, the draft placed the
    same way; the batch must split over the mesh's ``data`` axis.
    """
    config = target.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p))
    if prefill_chunk <= 0 or prefill_chunk & (prefill_chunk - 1):
        raise ValueError(f"prefill_chunk must be a positive power of two, got {prefill_chunk}")
    prompts = normalize_prompts(input_ids, config.vocab_size)
    eos_ids = config.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).astype(int))
    stop = StopCriteria.make(max_new_tokens, eos_ids)
    max_context = config.max_position_embeddings if max_context is None else max_context
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_context:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the context "
                         f"capacity of {max_context} tokens")
    if pad_prompts_to is not None:
        if isinstance(pad_prompts_to, bool) or not isinstance(pad_prompts_to, (int, np.integer)) or pad_prompts_to < 1:
            raise ValueError(f"pad_prompts_to must be a positive integer or None, got {pad_prompts_to!r}")
        longest = max(longest, int(pad_prompts_to))
    if on_tokens is not None and not callable(on_tokens):
        raise ValueError(f"on_tokens must be callable or None, got {type(on_tokens).__name__}")
    draft_sampling = sampling_kind(draft_sampling)
    if draft_sampling and not isinstance(draft, Draft):
        raise ValueError(f"draft_sampling needs a LongSpec Draft to sample the tree from, got "
                         f"{'no draft' if draft is None else type(draft).__name__}")
    if target.mesh is not None:
        if len(prompts) % target.mesh.shape[DATA]:
            raise ValueError(f"a batch of {len(prompts)} prompts does not split over the mesh's data axis of "
                             f"{target.mesh.shape[DATA]} devices")
        if isinstance(draft, Draft):
            draft = shard_draft(draft, target.mesh)
    speculation = None
    if isinstance(draft, PromptLookup):
        settings = plan_lookup(target, draft, longest, max_new_tokens, sampling, prefill_chunk,
                               resolve_impl(attention))
        out = run_lookup(settings, target, prompts, max_new_tokens, stop, seed, reproducible)
    elif draft is not None:
        if not isinstance(draft, Draft):
            raise ValueError(f"draft must be a longspec_jax Draft (see load_draft) or an infer.PromptLookup, "
                             f"got {type(draft).__name__}")
        speculation = choose(config, draft.profile, sampling, len(prompts), longest + max_new_tokens // 2,
                             tree_shape, draft_sampling, param_bytes=jnp.dtype(target.dtype).itemsize,
                             draft_vocab_size=draft.vocab_size(config.vocab_size))
        if speculation.tree_shape is None:
            draft = None
        else:
            settings = plan_speculative(target, draft, longest, max_new_tokens, sampling, speculation.tree_shape,
                                        prefill_chunk, resolve_impl(attention), speculation.draft_sampling or False)
            out = run_speculative(settings, target, draft, prompts, max_new_tokens, stop, seed, reproducible)
            out.speculation = dataclasses.replace(speculation, branching=settings.tree.branching)
    if draft is not None:
        if on_tokens is not None:
            _replay(out, on_tokens)
        return out
    out = _plain(target, prompts, longest, max_new_tokens, sampling, stop, seed, prefill_chunk, attention,
                 on_tokens, reproducible)
    out.speculation = speculation
    return out


def _plain(target, prompts, longest: int, max_new_tokens: int, sampling, stop, seed: int, prefill_chunk: int,
           attention: str, on_tokens, reproducible: bool) -> GenerateOutput:
    """Plain decoding: one compiled loop, streaming to ``on_tokens`` where given."""
    padded, chunk, out_len, capacity = plan_shapes(longest, max_new_tokens, 1, prefill_chunk)
    settings = DecodeSettings(config=target.config, sampling=sampling, capacity=capacity, prefill_chunk=chunk,
                              out_len=out_len, prompt_len=padded, impl=resolve_impl(attention))
    tokens, lengths = pad_prompts(prompts, padded)
    if on_tokens is None:
        with on_mesh(target.mesh):
            progress = _call_loop("plain", reproducible, target.params, tokens, lengths, stop,
                                  jax.random.PRNGKey(seed), settings=settings)
        return to_output(progress, max_new_tokens)
    _stream_sinks.append(on_tokens)
    try:
        with on_mesh(target.mesh):
            progress = _call_loop("plain", reproducible, target.params, tokens, lengths, stop,
                                  jax.random.PRNGKey(seed), settings=settings, on_tokens=_stream_to_sink)
        out = to_output(progress, max_new_tokens)
        jax.effects_barrier()
    finally:
        _stream_sinks.pop()
    return out


def pad_prompts(prompts: list[np.ndarray], padded: int) -> tuple[jax.Array, jax.Array]:
    tokens = np.zeros((len(prompts), padded), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def to_output(progress, max_new_tokens: int) -> GenerateOutput:
    tokens = np.asarray(progress.tokens)[:, :max_new_tokens]
    num_generated = np.asarray(progress.num_generated)
    num_rounds = np.asarray(progress.num_rounds)
    return GenerateOutput(tokens=tokens, num_generated=num_generated, num_rounds=num_rounds,
                          mean_accepted=float(num_generated.sum() / (num_rounds + 1).sum()))


def plan_speculative(target, draft: Draft, longest_prompt: int, max_new_tokens: int, sampling, tree_shape,
                     prefill_chunk: int, impl: str, draft_sampling: bool | str = False) -> SpecSettings:
    """Checks that the draft fits the target and plans the static shapes of one speculative generate call: a tree
    of level widths ``tree_shape``, beams (``draft_sampling`` false) or sampled from the draft (``True`` or a
    kind), its topology then shared among parents by :func:`allocate_branching` under the draft's profile."""
    if not isinstance(draft, Draft):
        raise ValueError(f"draft must be a longspec_jax Draft (see load_draft) or an infer.PromptLookup, "
                         f"got {type(draft).__name__}")
    config = target.config
    dc = draft.config
    if (dc.hidden_size, dc.num_heads, dc.num_kv_heads, dc.head_dim) != (
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim):
        raise ValueError(f"draft (hidden {dc.hidden_size}, heads {dc.num_heads}/{dc.num_kv_heads}, head_dim "
                         f"{dc.head_dim}) does not match the target (hidden {config.hidden_size}, heads "
                         f"{config.num_heads}/{config.num_kv_heads}, head_dim {config.head_dim})")
    proposals = draft.vocab_size(config.vocab_size)
    spec = TreeSpec.parse(tree_shape, proposals)
    kind = sampling_kind(draft_sampling) or None
    if kind:
        if sampling.greedy:
            raise ValueError("draft_sampling needs temperature > 0 (greedy decoding verifies the draft's top-k "
                             "beams)")
        table = (draft.profile or DEFAULT_PROFILE).table(kind, sampling.temperature)
        spec = spec.with_branching(allocate_branching(spec.shape, table, min(MAX_CHILDREN, proposals)))
    padded, chunk, out_len, capacity = plan_shapes(longest_prompt, max_new_tokens,
                                                   spec.num_nodes + spec.max_accept, prefill_chunk)
    base = DecodeSettings(config=config, sampling=sampling, capacity=capacity, prefill_chunk=chunk,
                          out_len=out_len, prompt_len=padded, impl=impl)
    settings = SpecSettings(base=base, tree=spec, draft=draft.settings(impl))
    if not kind:
        return settings
    return dataclasses.replace(settings, acceptance=sampled_tree_acceptance, draft_sampling=kind)


def run_speculative(settings: SpecSettings, target, draft: Draft, prompts, max_new_tokens: int, stop,
                    seed: int, reproducible: bool = True) -> GenerateOutput:
    """Runs the compiled speculative loop and converts its state to a ``GenerateOutput``."""
    return _run_rounds("speculative", settings, target, (draft.weights,), prompts, max_new_tokens, stop, seed,
                       reproducible)


def _run_rounds(loop: str, settings, target, extra: tuple, prompts, max_new_tokens: int, stop, seed: int,
                reproducible: bool) -> GenerateOutput:
    """Pads the prompts, runs the compiled speculative or prompt-lookup ``loop`` on the target's parameters (and
    ``extra`` inputs) on its mesh, and returns its output with the acceptance counts."""
    tokens, lengths = pad_prompts(prompts, settings.base.prompt_len)
    with on_mesh(target.mesh):
        state = _call_loop(loop, reproducible, target.params, *extra, tokens, lengths, stop,
                           jax.random.PRNGKey(seed), settings=settings)
    out = to_output(state.progress, max_new_tokens)
    out.accept_counts = np.asarray(state.accept_counts)
    if hasattr(state, "rank_tried"):
        out.rank_tried, out.rank_accepted = np.asarray(state.rank_tried), np.asarray(state.rank_accepted)
    return out


def plan_lookup(target, lookup: PromptLookup, longest_prompt: int, max_new_tokens: int, sampling,
                prefill_chunk: int, impl: str) -> LookupSettings:
    """The static shapes of one prompt-lookup generate call: a chain of ``lookup.num_tokens`` nodes."""
    spec = TreeSpec.parse((1,) * lookup.num_tokens, target.config.vocab_size)
    padded, chunk, out_len, capacity = plan_shapes(longest_prompt, max_new_tokens,
                                                   spec.num_nodes + spec.max_accept, prefill_chunk)
    base = DecodeSettings(config=target.config, sampling=sampling, capacity=capacity, prefill_chunk=chunk,
                          out_len=out_len, prompt_len=padded, impl=impl)
    return LookupSettings(base=base, tree=spec, lookup=lookup, history_len=padded + out_len + spec.max_accept)


def run_lookup(settings: LookupSettings, target, prompts, max_new_tokens: int, stop, seed: int,
               reproducible: bool = True) -> GenerateOutput:
    """Runs the compiled prompt-lookup loop and converts its state to a ``GenerateOutput``."""
    return _run_rounds("lookup", settings, target, (), prompts, max_new_tokens, stop, seed, reproducible)
