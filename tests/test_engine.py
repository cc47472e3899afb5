"""The continuous-batching engine (infer.engine): requests that join and leave a running batch decode exactly as
``generate()`` decodes them alone; each row samples as its request says; seeds reproduce; cancellation, queue
limits, bad requests and a dead loop behave."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from infer.engine import Engine, EngineConfig, EngineDead, QueueFull, RequestParams
from infer.generate import generate
from infer.schedule import batch_buckets
from infer.slot_programs import piece_sizes, prefill_pieces
from longspec_jax.testing import TINY, random_draft, tiny_target

RNG = np.random.default_rng(7)
PROMPTS = [list(map(int, RNG.integers(0, TINY.vocab_size, size=int(n)))) for n in (3, 40, 17, 9, 33, 5, 21, 12)]
CONFIG = EngineConfig(max_batch=4, max_context=128, max_queue=16, prefill_chunk=16, tree_shape=(2, 2, 2),
                      draft_sampling=True, compile_ahead=False)  # each test compiles what it runs


def _solo(target, prompt, max_tokens, **kwargs):
    out = generate(target, [prompt], max_new_tokens=max_tokens, eos_token_id=[], **kwargs)
    return out.tokens[0, :out.num_generated[0]].tolist()


@pytest.fixture(scope="module")
def engine():
    target, draft = tiny_target(0), random_draft(1, window=16)
    engine = Engine(target, draft, CONFIG)
    engine.start()
    yield engine
    engine.shutdown()


def test_bad_requests_are_named_before_anything_runs():
    engine = Engine(tiny_target(0), None, EngineConfig(max_batch=2, max_context=64, prefill_chunk=16))
    cases = {"non-empty list": ([], RequestParams()), "outside the vocabulary": ([1, 64], RequestParams()),
             "integers": ([1.5], RequestParams()), "max_tokens": ([1], RequestParams(max_tokens=0)),
             "temperature": ([1], RequestParams(temperature=-1.0)), "top_p": ([1], RequestParams(top_p=0.0)),
             "seed": ([1], RequestParams(seed=-3)), "context capacity": ([1] * 60, RequestParams(max_tokens=8)),
             "more than the context": ([1] * 65, RequestParams(max_tokens=1)),
             "stop token id": ([1], RequestParams(stop_token_ids=(99,)))}
    for words, (prompt, params) in cases.items():
        with pytest.raises(ValueError, match=words):
            engine.submit(prompt, params)
    with pytest.raises(EngineDead):  # a good request to an engine that was never started
        engine.submit([1, 2], RequestParams())
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(tiny_target(0), None, EngineConfig(prefill_chunk=12))
    with pytest.raises(ValueError, match="max_context"):
        Engine(tiny_target(0), None, EngineConfig(max_context=10 ** 6))


def test_batch_buckets_cover_every_load():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)


@pytest.mark.slow
def test_greedy_requests_equal_generate_alone_while_others_join_and_leave(engine):
    target = engine.target
    lengths = [5, 30, 12, 24, 7, 40, 3, 18]
    handles = [engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS[:4], lengths)]
    first = handles[0].result()   # a short request leaves; more join the running batch
    handles += [engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(PROMPTS[4:], lengths[4:])]
    outputs = [first] + [h.result() for h in handles[1:]]
    for prompt, n, out, handle in zip(PROMPTS, lengths, outputs, handles):
        assert out == _solo(target, prompt, n), prompt
        assert handle.finish_reason == "length" and handle.num_generated == n
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.spec_rounds > 0
    assert stats.drafted_tokens == 6 * stats.spec_rounds   # tree (2, 2, 2): 14 nodes beyond the root per row
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens


@pytest.mark.slow
def test_a_long_prompt_is_prefilled_between_decode_steps_and_the_state_shrinks_after_load(engine):
    running = engine.submit(PROMPTS[0], RequestParams(max_tokens=100, ignore_eos=True))
    next(iter(running))  # decoding
    long_prompt = [int(t) for t in RNG.integers(0, TINY.vocab_size, size=CONFIG.max_context - 8)]  # 8 chunks
    seen_before = running.num_generated
    late = engine.submit(long_prompt, RequestParams(max_tokens=2, ignore_eos=True))
    late.result()
    # one decode step after every prefill chunk: the running stream went on while the prompt was prefilled
    assert running.num_generated - seen_before >= len(long_prompt) // CONFIG.prefill_chunk
    assert running.result()[-1] >= 0 and running.finish_reason == "length"
    assert engine.programs.rows == 1  # alone for more than the shrink delay: back to the one-row bucket


@pytest.mark.slow
def test_greedy_rows_stay_exact_beside_sampled_rows_and_stop_tokens_end_them(engine):
    target = engine.target
    solo = _solo(target, PROMPTS[1], 20)
    stop = solo[9]  # the tenth greedy token ends the stopped request, emitted
    greedy = engine.submit(PROMPTS[1], RequestParams(max_tokens=20, ignore_eos=True))
    stopped = engine.submit(PROMPTS[1], RequestParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))
    sampled = [engine.submit(p, RequestParams(max_tokens=25, temperature=t, top_p=tp, seed=s, ignore_eos=True))
               for p, t, tp, s in ((PROMPTS[2], 1.0, 1.0, 1), (PROMPTS[3], 0.6, 0.8, 2))]
    assert greedy.result() == solo
    cut = stopped.result()
    assert cut == solo[:solo.index(stop) + 1] and stopped.finish_reason == "stop"
    for h in sampled:
        tokens = h.result()
        assert len(tokens) == 25 and all(0 <= t < TINY.vocab_size for t in tokens) and h.finish_reason == "length"


@pytest.mark.slow
def test_a_seed_reproduces_its_request_and_other_seeds_differ(engine):
    params = RequestParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    a = engine.submit(PROMPTS[0], params).result()
    b = engine.submit(PROMPTS[0], params).result()
    others = [engine.submit(PROMPTS[0], RequestParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True))
              for s in (12, 13)]
    assert a == b
    assert any(h.result() != a for h in others)


@pytest.mark.slow
def test_rounds_per_step_change_no_token_and_every_round_is_counted(engine):
    """The module's engine runs several rounds per step; one round per step gives every request the same tokens
    (each row's random stream advances once per round), and both count their rounds and drafted tokens."""
    assert engine.plan.rounds_per_step > 1
    one = Engine(engine.target, engine.plan.draft, dataclasses.replace(CONFIG, rounds_per_step=1))
    one.start()
    try:
        params = [RequestParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
                  for n, t, s in ((30, 1.0, 3), (7, 0.0, 0), (19, 0.8, 5), (26, 1.0, 6))]
        outputs = []
        for eng in (engine, one):
            before = eng.stats()
            handles = [eng.submit(p, q) for p, q in zip(PROMPTS[:4], params)]
            outputs.append([h.result() for h in handles])
            after = eng.stats()
            rounds = after.spec_rounds - before.spec_rounds
            assert rounds > 0 and after.drafted_tokens - before.drafted_tokens == 6 * rounds
            # every token after a request's first comes from a round: an accepted draft token or one per round
            # (a request's last round may verify up to the tree's depth (3) more than max_tokens keeps)
            generated = after.generation_tokens - before.generation_tokens - len(handles)
            accepted = after.accepted_tokens - before.accepted_tokens
            assert generated - rounds <= accepted <= generated - rounds + 3 * len(handles)
        assert outputs[0] == outputs[1]
        assert [len(o) for o in outputs[0]] == [30, 7, 19, 26]
    finally:
        one.shutdown()


@pytest.mark.slow
def test_speculative_steps_loop_a_known_number_of_rounds(engine):
    """A speculative step of one round and one of ``rounds_per_step`` are compiled ahead, the rounds' loop of known
    trip count (which a GPU runs without reading the loop's predicate back to the host after every round)."""
    rows = engine.programs.rows
    steps = [step for step in engine.plan.steps(rows) if step.settings is not None]
    assert {step.rounds for step in steps} == {1, engine.plan.rounds_per_step}
    for step in steps:
        hlo = engine.programs.compiled(step).as_text().splitlines()
        rounds_loops = [line for line in hlo if " while(" in line and 'op_name="jit(speculative_step)/while"' in line]
        if step.rounds == 1:
            assert not rounds_loops  # no loop at all
        else:
            assert len(rounds_loops) == 1 and f'"known_trip_count":{{"n":"{step.rounds}"}}' in rounds_loops[0]


@pytest.mark.slow
def test_a_step_runs_one_round_while_a_prompt_is_prefilled(engine, monkeypatch):
    """A running request decodes ``rounds_per_step`` rounds per step, and one round per step while another's
    prompt is prefilled piece by piece between the steps; both requests get their solo greedy tokens."""
    steps = []  # (speculative, rounds, a prompt being prefilled), in the loop thread
    decode = engine.programs.decode

    def recorded(step):
        steps.append((step.settings is not None, step.rounds, engine._admitting is not None))
        return decode(step)

    monkeypatch.setattr(engine.programs, "decode", recorded)
    running = engine.submit(PROMPTS[3], RequestParams(max_tokens=90, ignore_eos=True))
    while not steps:
        time.sleep(0.005)
    long_prompt = PROMPTS[1] * 2  # 80 tokens: five pieces of 16
    joining = engine.submit(long_prompt, RequestParams(max_tokens=8, ignore_eos=True))
    assert running.result() == _solo(engine.target, PROMPTS[3], 90)
    assert joining.result() == _solo(engine.target, long_prompt, 8)
    during = [rounds for speculative, rounds, prefilling in steps if speculative and prefilling]
    assert len(during) >= 4 and set(during) == {1}  # a step between each two of the five pieces
    assert engine.plan.rounds_per_step in {rounds for speculative, rounds, _ in steps if speculative}


@pytest.mark.slow
def test_cancel_frees_the_slot_and_a_full_queue_refuses_at_once(engine):
    long = [engine.submit(PROMPTS[1], RequestParams(max_tokens=80, ignore_eos=True)) for _ in range(CONFIG.max_batch)]
    while engine.stats().running < CONFIG.max_batch:
        time.sleep(0.01)
    queued = [engine.submit([1, 2, 3], RequestParams(max_tokens=2)) for _ in range(CONFIG.max_queue)]
    started = time.monotonic()
    with pytest.raises(QueueFull):
        engine.submit([1, 2, 3], RequestParams(max_tokens=2))
    assert time.monotonic() - started < 0.5
    for h in long:
        h.cancel()
    for h in long:
        assert list(h)[-1].finish_reason == "abort"
        assert h.num_generated < 80
    for h in queued:   # the freed slots serve the queue
        assert len(h.result()) >= 1 and h.finish_reason in ("stop", "length")
    queued[0].cancel()  # cancelling a finished request changes nothing
    assert queued[0].finish_reason in ("stop", "length")
    assert engine.stats().running == 0


@pytest.mark.slow
def test_async_iteration_streams_every_chunk(engine):
    import asyncio

    async def collect():
        handle = engine.submit(PROMPTS[4], RequestParams(max_tokens=16, ignore_eos=True))
        return [chunk async for chunk in handle]

    chunks = asyncio.run(collect())
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == _solo(engine.target, PROMPTS[4], 16)


@pytest.mark.slow
def test_plain_engine_equals_generate_and_a_dead_loop_refuses_requests():
    target = tiny_target(3)
    config = EngineConfig(max_batch=2, max_context=96, prefill_chunk=32)
    lazy = Engine(target, None, dataclasses.replace(config, compile_ahead=False))
    lazy.start()
    assert not lazy.programs._executables  # nothing compiled before a step needs it
    lazy.shutdown()
    engine = Engine(target, None, config)
    engine.start()
    ahead = set(engine.programs._executables)  # every program of every bucket, compiled in start()
    assert {(step, rows) for rows in engine.plan.buckets for step in engine.plan.steps(rows)} <= ahead
    assert {("insert", rows) for rows in engine.plan.buckets} <= ahead
    handles = [engine.submit(p, RequestParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS[:5]]
    for prompt, h in zip(PROMPTS, handles):
        assert h.result() == _solo(target, prompt, 12)
    assert set(engine.programs._executables) == ahead  # and none while serving
    stats = engine.stats()
    assert stats.spec_rounds == 0 and stats.generation_tokens == 60
    assert stats.plain_steps == 5 * 11  # every token after a request's first comes from a plain step

    def broken(step):
        raise RuntimeError("device lost")

    engine.programs.decode = broken
    victim = engine.submit(PROMPTS[0], RequestParams(max_tokens=12))
    assert list(victim)[-1].finish_reason == "error"
    deadline = time.monotonic() + 5
    while engine.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.alive and "device lost" in repr(engine.error)
    with pytest.raises(EngineDead, match="device lost"):
        engine.submit(PROMPTS[0], RequestParams())
    assert threading.active_count() >= 1


def test_a_prompt_is_prefilled_in_whole_chunks_then_one_smaller_piece():
    assert piece_sizes(512) == (128, 256, 512) and piece_sizes(2) == (1, 2)
    assert prefill_pieces(1024, 512) == (512, 512)
    assert prefill_pieces(1025, 512) == (512, 512, 128)
    assert prefill_pieces(1200, 512) == (512, 512, 256)
    assert prefill_pieces(1300, 512) == (512, 512, 512)
    assert prefill_pieces(5, 16) == (8,)
