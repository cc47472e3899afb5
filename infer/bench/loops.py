"""The generation loops a benchmark times, jitted from the post-prefill state with the XLA options ``generate()``
compiles them with (:func:`infer.generate.compile_options`), so that a benchmark times ``generate()``'s loops."""

from __future__ import annotations

import jax

from infer.decoding import DecodeSettings, StopCriteria, prefill_and_first_token
from infer.generate import compile_options
from infer.plain import plain_loop
from infer.speculative import SpecSettings, speculative_loop, speculative_start

COMPILES = ("autotuned", "reproducible")  # generate(reproducible=False), generate()'s default


def add_compile_arg(parser) -> None:
    """``--compile {autotuned,reproducible}``: the compile every timed loop gets (default autotuned)."""
    parser.add_argument("--compile", default=COMPILES[0], choices=COMPILES,
                        help="XLA options of every loop: autotuned kernels (generate(reproducible=False)), or "
                             "generate()'s default reproducible compile (infer.generate.REPRODUCIBLE_OPTIONS)")


def loop_options(loop: str, compile_mode: str, extra_options=None) -> dict:
    """generate()'s XLA options of ``loop`` (plain, speculative or lookup) for ``compile_mode``, with
    ``extra_options`` added."""
    return {**compile_options(loop, compile_mode == "reproducible"), **(extra_options or {})}


def plain_fns(base: DecodeSettings, stop: StopCriteria, compile_mode: str):
    """``start(params, tokens, lengths, key) -> (first, cache, key)`` and ``run(params, progress, cache, last,
    key) -> progress`` (the cache donated) of plain decoding."""
    options = loop_options("plain", compile_mode) or None
    start = jax.jit(lambda p, t, l, k: prefill_and_first_token(p, base, t, l, k), compiler_options=options)
    run = jax.jit(lambda p, pr, c, last, k: plain_loop(p, base, stop, pr, c, last, k), donate_argnums=2,
                  compiler_options=options)
    return start, run


def speculative_fns(settings: SpecSettings, stop: StopCriteria, compile_mode: str, extra_options=None):
    """``start(params, draft_weights, tokens, lengths, key) -> state`` and ``run(params, draft_weights, state) ->
    state`` (the state donated) of speculative decoding, ``extra_options`` added to generate()'s."""
    options = loop_options("speculative", compile_mode, extra_options)
    start = jax.jit(lambda p, d, t, l, k: speculative_start(settings, p, d, t, l, stop, k), compiler_options=options)
    run = jax.jit(lambda p, d, st: speculative_loop(settings, p, d, stop, st), donate_argnums=2,
                  compiler_options=options)
    return start, run
