"""``infer.generate`` without a draft: EOS, lengths, prompt formats, batching, sampling, chunking, input errors."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import random_prompt, tiny_target
from infer import generate

VOCAB = 512


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=VOCAB, max_position_embeddings=256)


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(11, VOCAB, seed=1), random_prompt(6, VOCAB, seed=2)]


@pytest.fixture(scope="module")
def free_run(target, prompts):
    """Greedy 24 tokens per prompt, no EOS."""
    return generate(target, prompts, max_new_tokens=24, eos_token_id=[])


def first_new_token_position(row: np.ndarray, lo: int) -> int:
    """Smallest step s >= lo whose token does not occur earlier in the row."""
    return next(s for s in range(lo, len(row)) if row[s] not in row[:s])


def test_free_run_shapes(free_run):
    assert free_run.tokens.shape == (2, 24) and free_run.tokens.dtype == np.int32
    assert free_run.num_generated.tolist() == [24, 24]
    assert free_run.num_rounds.tolist() == [23, 23]
    assert free_run.mean_accepted == pytest.approx(1.0)
    assert ((free_run.tokens >= 0) & (free_run.tokens < VOCAB)).all()


def eos_stops(rows: np.ndarray, eos) -> list:
    """The step at which each row's greedy run first emits one of ``eos`` (None if never)."""
    return [next((s for s in range(len(row)) if row[s] in eos), None) for row in rows]


def test_eos_stops_each_row_at_its_own_step(target, prompts, free_run):
    rows = free_run.tokens
    eos, stops = None, None
    for a in rows[0, 2:12]:
        for b in rows[1, 2:20]:
            st = eos_stops(rows, {int(a), int(b)})
            if None not in st and min(st) >= 2 and st[0] != st[1]:
                eos, stops = [int(a), int(b)], st
                break
        if eos:
            break
    assert eos is not None, "no EOS pair makes the rows stop at different steps"
    out = generate(target, prompts, max_new_tokens=24, eos_token_id=eos)
    for b, stop in enumerate(stops):
        np.testing.assert_array_equal(out.tokens[b, :stop + 1], rows[b, :stop + 1])
        assert out.tokens[b, stop] in eos
        assert (out.tokens[b, stop + 1:] == -1).all()
        assert out.num_generated[b] == stop + 1
        assert out.num_rounds[b] == stop


def test_single_eos_id_as_int(target, prompts, free_run):
    row = free_run.tokens[0]
    s = first_new_token_position(row, 5)
    out = generate(target, [prompts[0]], max_new_tokens=24, eos_token_id=int(row[s]))
    assert out.num_generated.tolist() == [s + 1]
    np.testing.assert_array_equal(out.tokens[0, :s + 1], row[:s + 1])
    assert (out.tokens[0, s + 1:] == -1).all()


def test_eos_as_first_token(target, prompts, free_run):
    out = generate(target, prompts, max_new_tokens=24, eos_token_id=int(free_run.tokens[0, 0]))
    assert out.num_generated[0] == 1 and out.num_rounds[0] == 0
    assert (out.tokens[0, 1:] == -1).all()


def test_default_eos_comes_from_config(prompts):
    base = tiny_target(vocab_size=VOCAB, max_position_embeddings=256)
    row = generate(base, [prompts[0]], max_new_tokens=24, eos_token_id=[]).tokens[0]
    s = first_new_token_position(row, 4)
    with_eos = tiny_target(vocab_size=VOCAB, max_position_embeddings=256, eos_token_ids=(int(row[s]),))
    out = generate(with_eos, [prompts[0]], max_new_tokens=24)
    assert out.num_generated.tolist() == [s + 1]


@pytest.mark.parametrize("n", [1, 2, 7, 13, 24])
def test_max_new_tokens_exact(target, prompts, free_run, n):
    out = generate(target, prompts, max_new_tokens=n, eos_token_id=[])
    assert out.tokens.shape == (2, n)
    assert out.num_generated.tolist() == [n, n]
    assert out.num_rounds.tolist() == [n - 1, n - 1]
    np.testing.assert_array_equal(out.tokens, free_run.tokens[:, :n])


def test_prompt_formats(target, prompts, free_run):
    same_length = [random_prompt(9, VOCAB, seed=5), random_prompt(9, VOCAB, seed=6)]
    as_lists = generate(target, same_length, max_new_tokens=10, eos_token_id=[]).tokens
    as_numpy = generate(target, np.asarray(same_length), max_new_tokens=10, eos_token_id=[]).tokens
    as_jax = generate(target, jnp.asarray(same_length), max_new_tokens=10, eos_token_id=[]).tokens
    as_tuples = generate(target, [tuple(p) for p in same_length], max_new_tokens=10, eos_token_id=[]).tokens
    np.testing.assert_array_equal(as_numpy, as_lists)
    np.testing.assert_array_equal(as_jax, as_lists)
    np.testing.assert_array_equal(as_tuples, as_lists)
    flat = generate(target, prompts[0], max_new_tokens=24, eos_token_id=[])
    assert flat.tokens.shape == (1, 24)
    np.testing.assert_array_equal(flat.tokens[0], free_run.tokens[0])
    flat_np = generate(target, np.asarray(prompts[1], np.int64), max_new_tokens=24, eos_token_id=[])
    np.testing.assert_array_equal(flat_np.tokens[0], free_run.tokens[1])


def test_batch_rows_equal_rows_alone(target, free_run, prompts):
    long_prompt = random_prompt(29, VOCAB, seed=7)
    batch = generate(target, [prompts[1], long_prompt, prompts[0]], max_new_tokens=24, eos_token_id=[])
    alone = generate(target, [long_prompt], max_new_tokens=24, eos_token_id=[])
    np.testing.assert_array_equal(batch.tokens[0], free_run.tokens[1])
    np.testing.assert_array_equal(batch.tokens[1], alone.tokens[0])
    np.testing.assert_array_equal(batch.tokens[2], free_run.tokens[0])


def test_sampling_reproducible_and_seed_dependent(target, prompts, free_run):
    runs = [generate(target, prompts, max_new_tokens=24, temperature=1.0, eos_token_id=[], seed=s).tokens
            for s in (0, 0, 1)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert (runs[0] != runs[2]).any()
    assert (runs[0] != free_run.tokens).any(), "T=1 sampling should not equal greedy on this model"
    assert ((runs[0] >= 0) & (runs[0] < VOCAB)).all()


def test_tiny_top_p_is_greedy(target, prompts, free_run):
    out = generate(target, prompts, max_new_tokens=24, temperature=1.0, top_p=1e-6, eos_token_id=[], seed=3)
    np.testing.assert_array_equal(out.tokens, free_run.tokens)


def test_chunked_prefill_equals_unchunked(target):
    prompts = [random_prompt(100, VOCAB, seed=8), random_prompt(37, VOCAB, seed=9)]
    whole = generate(target, prompts, max_new_tokens=12, eos_token_id=[])
    chunked = generate(target, prompts, max_new_tokens=12, eos_token_id=[], prefill_chunk=32)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)


@pytest.mark.parametrize("kwargs, prompt, words", [
    (dict(max_new_tokens=0), None, "max_new_tokens"),
    (dict(max_new_tokens=-3), None, "max_new_tokens"),
    (dict(max_new_tokens=2.5), None, "max_new_tokens"),
    (dict(temperature=-0.1), None, "temperature"),
    (dict(top_p=0.0), None, "top_p"),
    (dict(top_p=1.5), None, "top_p"),
    (dict(), [[]], "non-empty"),
    (dict(), [], "non-empty"),
    (dict(), [[1, 2], []], "prompt 1"),
    (dict(), [[1, VOCAB]], f"token id {VOCAB}"),
    (dict(), [[-1, 2]], "token id -1"),
    (dict(max_new_tokens=200), None, "context capacity"),
    (dict(max_new_tokens=8, max_context=60), None, "context capacity"),
])
def test_bad_input_raises_value_error(target, kwargs, prompt, words):
    prompt = [random_prompt(60, VOCAB, seed=0)] if prompt is None else prompt
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=words):
        generate(target, prompt, **kwargs)


def test_on_tokens_streams_every_emitted_token_in_order(target, prompts, free_run):
    rows = free_run.tokens
    eos = [int(rows[0, 5])]
    stop0 = eos_stops(rows, eos)[0]
    steps = []
    out = generate(target, prompts, max_new_tokens=20, eos_token_id=eos,
                   on_tokens=lambda tokens, emitted: steps.append((tokens.copy(), emitted.copy())))
    assert all(t.shape == (2,) and e.shape == (2,) and e.dtype == bool for t, e in steps)
    for b in range(2):
        streamed = [int(t[b]) for t, e in steps if e[b]]
        assert streamed == out.tokens[b, :out.num_generated[b]].tolist()
    assert out.num_generated[0] == stop0 + 1
    assert len(steps) == max(out.num_generated)
    # A second streaming call with another callback reuses the compiled loop and streams to the new callback.
    again = []
    out2 = generate(target, prompts, max_new_tokens=20, eos_token_id=eos,
                    on_tokens=lambda tokens, emitted: again.append(tokens.copy()))
    np.testing.assert_array_equal(out2.tokens, out.tokens)
    assert len(again) == len(steps)
    with pytest.raises(ValueError, match="on_tokens"):
        generate(target, prompts, max_new_tokens=4, on_tokens=42)


@pytest.mark.slow
def test_pad_prompts_to_shares_one_program_and_keeps_the_tokens():
    from longspec_jax.testing import random_draft, tiny_target

    target, draft = tiny_target(0), random_draft(1)
    for d in (None, draft):
        plain = generate(target, [[1, 2, 3, 4, 5]], draft=d, max_new_tokens=6, eos_token_id=[])
        padded = generate(target, [[1, 2, 3, 4, 5]], draft=d, max_new_tokens=6, eos_token_id=[], pad_prompts_to=40)
        np.testing.assert_array_equal(padded.tokens, plain.tokens)
    plain_jit = importlib.import_module("infer.generate")._compiled("plain", ())
    before = plain_jit._cache_size()
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]):  # two lengths, one padded shape
        generate(target, [prompt], max_new_tokens=6, eos_token_id=[], pad_prompts_to=40, reproducible=False)
    assert plain_jit._cache_size() == before + 1
    with pytest.raises(ValueError, match="pad_prompts_to must be a positive integer"):
        generate(target, [[1]], max_new_tokens=2, pad_prompts_to=0)


def test_recording_program_memory_gives_each_calls_peak(target, prompts, free_run):
    import jax

    gen = importlib.import_module("infer.generate")
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(target.params))
    with gen.recording_program_memory() as peaks:
        again = generate(target, prompts, max_new_tokens=24, eos_token_id=[])
        generate(target, prompts[:1], max_new_tokens=24, eos_token_id=[])
    np.testing.assert_array_equal(again.tokens, free_run.tokens)  # recording still runs the call
    assert len(peaks) == 2 and all(p > param_bytes for p in peaks)
    assert peaks[1] < peaks[0]  # the cache and buffers of one row fewer
    assert gen._memory_records.get() is None  # off again after the block


def test_a_finished_row_attends_to_none_of_its_cache(target, prompts):
    """A plain step with a finished row: the running row's token and K/V are the full step's; the finished row's
    V are those of a row attending to itself only (its cache is not read; a lone key's softmax is 1, whatever its
    position), written at its own length, and its committed slots stay as they were."""
    from infer.decoding import DecodeSettings
    from infer.generate import pad_prompts
    from infer.plain import decode_step
    from longspec_jax.kv_cache import init_cache
    from longspec_jax.sampling import SamplingConfig
    from longspec_jax.target import prefill

    c = target.config
    settings = DecodeSettings(config=c, sampling=SamplingConfig(), capacity=64, prefill_chunk=16, out_len=8,
                              prompt_len=16, impl="xla")
    tokens, lengths = pad_prompts(prompts, 16)
    cache = init_cache(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim, target.params["embed"].dtype)
    _, cache = prefill(target.params, c, tokens, lengths, cache, chunk=16, impl="xla")
    last, key = jnp.asarray([3, 5]), jnp.zeros((2,), jnp.uint32)
    full_token, full = decode_step(target.params, settings, cache, last, key)
    token, out = decode_step(target.params, settings, cache, last, key, jnp.asarray([True, False]))
    _, alone = decode_step(target.params, settings, cache.replace(lengths=cache.lengths.at[1].set(0)), last, key)
    L1 = int(cache.lengths[1])
    assert int(token[0]) == int(full_token[0]) and L1 > 0
    for layer in range(c.num_layers):
        np.testing.assert_array_equal(out.k[layer][0], full.k[layer][0])
        np.testing.assert_allclose(out.v[layer][1, L1], alone.v[layer][1, 0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out.v[layer][1, :L1], cache.v[layer][1, :L1])
    assert np.abs(np.asarray(full.v[-1][1, L1] - out.v[-1][1, L1])).max() > 1e-3  # its cache did matter
