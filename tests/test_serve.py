"""The OpenAI-compatible server (``python -m infer.serve``).

Fast tests: incremental detokenization and stop strings, request parsing, the metrics exposition. Slow tests drive
a real server process (``--port 0``, float32) with the ``openai`` client and httpx: a tiny random target with a BPE
tokenizer and a chat template and its random draft, and the embedded default model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import time

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.detokenize import IncrementalDetokenizer
from infer.engine import EngineStats
from infer.generate import generate
from infer.main import ByteTokenizer
from infer.openai_api import APIError, ChatCompletionRequest, CompletionRequest
from infer.serve_metrics import ServeMetrics
from tests import serve_helpers as sh

TEXT = "def f_1(x):\n    return x + 1  # é € 😀 naïve\n"


def _pieces(decode, prompt_ids, ids, sizes, stop=()):
    """Pushes ``ids`` in chunks of ``sizes`` (cycled); returns the released pieces and the detokenizer."""
    detok, pieces, i = IncrementalDetokenizer(decode, prompt_ids, stop), [], 0
    for k in range(len(ids)):
        n = sizes[k % len(sizes)]
        pieces.append(detok.push(ids[i:i + n]))
        i += n
        if i >= len(ids) or detok.stopped:
            break
    pieces.append(detok.finish())
    return pieces, detok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return sh.bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_pieces_never_split_a_character_and_join_to_the_text(sizes):
    tok = ByteTokenizer()
    pieces, detok = _pieces(tok.decode, tok.encode("x = "), tok.encode(TEXT), sizes)
    assert "".join(pieces) == detok.text == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_bpe_pieces_join_to_the_decoded_text(bpe):
    ids = bpe.encode(TEXT, add_special_tokens=False)
    for sizes in ([1], [2, 3], [len(ids)]):
        pieces, _ = _pieces(bpe.decode, bpe.encode("x = "), ids, sizes)
        assert "".join(pieces) == TEXT and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("stop, expected", [(["return"], "def f_1(x):\n    "),
                                            (("€", "x +"), "def f_1(x):\n    return "),
                                            (["not there"], TEXT), (["\n"], "def f_1(x):")])
@pytest.mark.parametrize("sizes", [[1], [3, 1], [100]])
def test_stop_strings_cut_the_text_however_tokens_arrive(stop, expected, sizes):
    tok = ByteTokenizer()
    pieces, detok = _pieces(tok.decode, [], tok.encode(TEXT), sizes, stop)
    assert "".join(pieces) == detok.text == expected
    assert detok.stopped == (expected != TEXT)


def test_a_possible_stop_prefix_is_held_back_until_resolved():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok.decode, [], ["abc"])
    assert detok.push(tok.encode("xxab")) == "xx"
    assert detok.push(tok.encode("d")) == "abd"
    assert detok.push(tok.encode("a")) == "" and detok.finish() == "a"


def _params(cls, body, prompt_len=4, max_context=64, default=16):
    request = cls.model_validate(body)
    request.check()
    return request.params(prompt_len, max_context, 256, default)


def test_request_fields_become_engine_params():
    params = _params(CompletionRequest, dict(prompt="hi", max_tokens=8, temperature=0, top_p=0.5, seed=3,
                                             stop_token_ids=[7], ignore_eos=True, user="ignored"))
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (8, 0.0, 0.5, 3)
    assert params.stop_token_ids == (7,) and params.ignore_eos
    assert _params(CompletionRequest, dict(prompt=[1, 2]), prompt_len=60).max_tokens == 4  # 16, cut to what fits
    chat = dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert _params(ChatCompletionRequest, chat, default=None).max_tokens == 60
    assert _params(ChatCompletionRequest, {**chat, "max_completion_tokens": 5}, default=None).max_tokens == 5


@pytest.mark.parametrize("body, param", [
    (dict(prompt="hi", max_tokens=61), "max_tokens"), (dict(prompt="hi", echo=True), "echo"),
    (dict(prompt="hi", stop_token_ids=[256]), "stop_token_ids"), (dict(prompt="hi", logprobs=2), "logprobs"),
    (dict(prompt="hi", stream_options={"include_usage": True}), "stream_options")])
def test_requests_beyond_what_is_served_are_refused(body, param):
    with pytest.raises(APIError) as e:
        _params(CompletionRequest, body)
    assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(APIError, match="no room"):
        _params(CompletionRequest, dict(prompt="hi"), prompt_len=64)


@pytest.mark.parametrize("argv, message", [
    (["--no-draft", "--draft", "."], "either --draft or --no-draft"), (["--port", "70000"], "--port"),
    (["--target", "/no/such/dir"], "not a directory"), (["--max-batch", "0"], "positive integer"),
    (["--rounds-per-step", "0"], "positive integer"),
    (["--tiny-random", "--target", "."], "either --target or --tiny-random")])
def test_command_line_errors(argv, message, capsys):
    from infer.serve import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_limits_the_engine_refuses_are_an_error_at_start(capsys):
    from infer.serve import main

    assert main(["--tiny-random", "--port", "0", "--max-context", "100000"]) == 2
    assert "max_context 100000 is beyond" in capsys.readouterr().err


class _StatsEngine:
    def stats(self):
        return EngineStats(running=2, waiting=1, prompt_tokens=30, generation_tokens=40, spec_rounds=9,
                           drafted_tokens=50, accepted_tokens=21)


def test_metrics_expose_the_engine_counters_and_request_latencies():
    from infer.engine import Timings

    metrics = ServeMetrics(_StatsEngine())
    metrics.request_ended(Timings(submitted=1.0, admitted=1.5, first_token=2.0, finished=4.0), "length")
    values = sh.parse_metrics(metrics.exposition().decode())
    assert values["longspec:num_requests_running"] == 2 and values["longspec:num_requests_waiting"] == 1
    assert values["longspec:prompt_tokens_total"] == 30 and values["longspec:generation_tokens_total"] == 40
    assert values["longspec:spec_decode_num_drafts_total"] == 9
    assert values["longspec:spec_decode_num_draft_tokens_total"] == 50
    assert values["longspec:spec_decode_num_accepted_tokens_total"] == 21
    assert values["longspec:time_to_first_token_seconds_sum"] == 1.0
    assert values["longspec:request_queue_time_seconds_sum"] == 0.5
    assert values["longspec:e2e_request_latency_seconds_sum"] == 3.0
    assert values['longspec:request_success_total{finished_reason="length"}'] == 1
    assert np.isclose(values["longspec:time_to_first_token_seconds_count"], 1)


# ------------------------------------------------------------------------------------------------ a real server

MAX_BATCH, MAX_QUEUE, MAX_CONTEXT = 4, 16, 2048
LONG = 1900  # tokens of a request meant to hold its slot for the length of a test
PROMPTS = [f"def f_{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}\n" * (1 + i % 3) for i in range(16)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A folder shared by the pytest-xdist workers of this run (a worker's base folder is one of its children)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module")
def pair(run_dir):
    return sh.shared_pair(run_dir)


@pytest.fixture(scope="module")
def tiny_server(pair, run_dir):
    args = ["--target", pair.target, "--draft", pair.draft, "--dtype", "float32", "--max-batch", str(MAX_BATCH),
            "--max-queue", str(MAX_QUEUE), "--max-context", str(MAX_CONTEXT), "--log-level", "warning",
            "--compile-on-demand"]
    shared = sh.SharedServer(run_dir / "tiny-server", args)
    yield shared
    shared.close()


@pytest.fixture
def server(tiny_server):
    with tiny_server.exclusive():
        yield tiny_server


@pytest.fixture(scope="module")
def reference(pair):
    """``reference(prompt_ids, n)``: the solo plain greedy text of ``n`` tokens, as the server detokenizes it."""
    return sh.Reference(pair.target)


def _client(server, **kwargs):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kwargs)


def _async_client(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(stream):
    """(text, finish_reason, usage, chunks with text) of an openai completion stream."""
    text, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            chunks += bool(choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return "".join(text), finish, usage, chunks


@pytest.mark.slow
def test_completion_whole_and_streamed_equal_solo_greedy(server, reference):
    client = _client(server)
    ids = reference.encode(PROMPTS[1])
    whole = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=40, temperature=0)
    assert whole.choices[0].text == reference(ids, 40)
    assert whole.choices[0].finish_reason == "length" and whole.object == "text_completion"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        len(ids), 40, len(ids) + 40)
    stream = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage, chunks = _streamed(stream)
    assert (text, finish) == (whole.choices[0].text, "length") and usage == whole.usage and 1 <= chunks <= 40
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=40, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text
    # the raw events: data lines of JSON, then [DONE]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json=dict(prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True)) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


@pytest.mark.slow
def test_sixteen_concurrent_requests_over_four_slots_equal_solo_greedy(server, reference):
    lengths = [8 + 3 * i for i in range(len(PROMPTS))]  # mixed, so that slots free and refill at different steps
    before = server.wait_idle()

    async def one(client, i):
        request = dict(model="m", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0)
        if i % 2:
            response = await client.completions.create(**request)
            return response.choices[0].text, response.choices[0].finish_reason
        text, finish = [], None
        async for chunk in await client.completions.create(**request, stream=True):
            text += [c.text for c in chunk.choices]
            finish = chunk.choices[0].finish_reason or finish
        return "".join(text), finish

    async def main():
        async with _async_client(server) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    results = asyncio.run(main())
    for prompt, n, (text, finish) in zip(PROMPTS, lengths, results):
        assert (text, finish) == (reference(reference.encode(prompt), n), "length"), prompt
    after = server.wait_idle()
    queued = after["longspec:request_queue_time_seconds_count"] - before["longspec:request_queue_time_seconds_count"]
    assert queued == len(PROMPTS)


@pytest.mark.slow
def test_mixed_temperatures_served_together(server, reference):
    temperatures = [0, 0.7, 1.0, 0, 1.5, 0, 0.4, 0]

    async def one(client, i):
        response = await client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=24,
                                                   temperature=temperatures[i], seed=i)
        return response.choices[0], response.usage

    async def main():
        async with _async_client(server) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(temperatures))))

    results = asyncio.run(main())
    sampled = []
    for i, (choice, usage) in enumerate(results):
        assert choice.finish_reason == "length" and usage.completion_tokens == 24
        greedy = reference(reference.encode(PROMPTS[i]), 24)
        if temperatures[i] == 0:
            assert choice.text == greedy
        else:
            sampled.append(choice.text != greedy)
    assert any(sampled)  # at T >= 0.4 over 24 tokens, some output leaves the greedy one


@pytest.mark.slow
def test_stop_strings_end_the_text_before_them(server, reference):
    ids = reference.encode(PROMPTS[2])
    full = reference(ids, 40)
    start = next(i for i in range(10, 37) if "\ufffd" not in full[i:i + 3])
    stop = full[start:start + 3]
    expected = full[:full.index(stop)]
    client = _client(server)
    request = dict(model="m", prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[stop, "never in the text"])
    whole = client.completions.create(**request)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    assert whole.usage.completion_tokens < 40
    text, finish, _, _ = _streamed(client.completions.create(**request, stream=True))
    assert (text, finish) == (expected, "stop")
    server.wait_idle()  # the request was cancelled at the stop string: its slot is free


@pytest.mark.slow
def test_a_client_that_disconnects_frees_its_slot(server):
    client = _client(server, timeout=60)

    def a_batch_of_short_requests():
        with concurrent.futures.ThreadPoolExecutor(MAX_BATCH) as pool:
            return list(pool.map(lambda i: client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=8),
                                 range(MAX_BATCH)))

    a_batch_of_short_requests()  # the server compiles on demand: its programs for these, before the timed batch
    before = server.wait_idle()

    async def first_chunk_then_leave(client):
        body = dict(prompt="y = 2", max_tokens=LONG, temperature=0, stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    return

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await asyncio.gather(*(first_chunk_then_leave(client) for _ in range(MAX_BATCH)))
            with pytest.raises(httpx.ReadTimeout):  # a whole completion whose client gives up waiting
                await client.post("/v1/completions", json=dict(prompt="z", max_tokens=LONG), timeout=1.0)

    asyncio.run(main())
    after = server.wait_idle(timeout=60)
    generated = after["longspec:generation_tokens_total"] - before["longspec:generation_tokens_total"]
    assert generated < (MAX_BATCH + 1) * LONG / 4  # cancelled, not run to their end
    aborted = 'longspec:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == MAX_BATCH + 1
    start = time.monotonic()
    done = a_batch_of_short_requests()
    assert all(r.choices[0].finish_reason == "length" for r in done) and time.monotonic() - start < 30


BAD_BODIES = [
    (dict(prompt="x", max_tokens="ten"), "max_tokens"), (dict(prompt=5), "prompt"), (dict(), "prompt"),
    (dict(prompt=""), "prompt"), (dict(prompt=[]), "prompt"), (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt="x", temperature=-0.5), "temperature"), (dict(prompt="x", top_p=0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"), (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=MAX_CONTEXT), "max_tokens"), (dict(prompt=[5] * (MAX_CONTEXT + 1)), "prompt"),
    (dict(prompt=[5, 10 ** 6]), "prompt"), (dict(prompt="x", n=2), "n"), (dict(prompt="x", stream="yes"), "stream"),
    (dict(prompt="x", stop=3), "stop"), (dict(prompt="x", seed=1.5), "seed")]


@pytest.mark.slow
def test_bad_requests_get_400_with_an_error_body_and_serving_goes_on(server):
    import openai

    def check(response, param):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
        assert error["message"]

    for body, param in BAD_BODIES:
        check(httpx.post(server.url + "/v1/completions", json=body, timeout=30), param)
    check(httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', timeout=30,
                     headers={"content-type": "application/json"}), None)
    check(httpx.post(server.url + "/v1/chat/completions", json=dict(messages=[]), timeout=30), "messages")
    assert "n=1" in httpx.post(server.url + "/v1/completions", json=dict(prompt="x", n=3)).json()["error"]["message"]
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    response = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 4


@pytest.mark.slow
def test_a_full_queue_is_answered_429_at_once_and_serving_resumes(server):
    server.wait_idle()

    async def main():
        limits = httpx.Limits(max_connections=MAX_BATCH + MAX_QUEUE + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client, \
                contextlib.AsyncExitStack() as streams:
            body = dict(prompt="x = 1", max_tokens=LONG, temperature=0, stream=True)

            async def open_until(count: int, gauge: str, value: int):
                opened = await asyncio.gather(*(streams.enter_async_context(
                    client.stream("POST", "/v1/completions", json=body)) for _ in range(count)))
                assert [r.status_code for r in opened] == [200] * count
                while (values := sh.parse_metrics((await client.get("/metrics")).text))[gauge] < value:
                    await asyncio.sleep(0.05)
                return values

            await open_until(MAX_BATCH, "longspec:num_requests_running", MAX_BATCH)  # the slots, then the queue
            values = await open_until(MAX_QUEUE, "longspec:num_requests_waiting", MAX_QUEUE)
            assert values["longspec:num_requests_running"] == MAX_BATCH
            start = time.monotonic()
            refused = await client.post("/v1/completions", json=dict(prompt="x", max_tokens=4))
            assert time.monotonic() - start < 5
            return refused

    refused = asyncio.run(main())
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "RateLimitError" and refused.json()["error"]["code"] == 429
    server.wait_idle(timeout=60)  # the streams closed: their requests were cancelled
    response = _client(server).completions.create(model="m", prompt=PROMPTS[0], max_tokens=4)
    assert response.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_metrics_count_what_was_served(server):
    before = server.wait_idle()
    client = _client(server)
    usages = [client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=5 + i).usage for i in range(3)]
    for i in range(3, 5):
        usages.append(_streamed(client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=5 + i,
                                                          stream=True, stream_options={"include_usage": True}))[2])
    after = server.wait_idle()
    delta = lambda name: after[name] - before.get(name, 0)
    assert delta("longspec:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("longspec:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"longspec:{name}_count") == 5
    assert delta('longspec:request_success_total{finished_reason="length"}') == 5
    assert delta("longspec:inter_token_latency_seconds_count") >= 1
    assert after["longspec:spec_decode_num_accepted_tokens_total"] <= after[
        "longspec:spec_decode_num_draft_tokens_total"]


@pytest.mark.slow
def test_chat_completions_apply_the_chat_template(server, reference):
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def f_1(x):"}]
    tokenizer = reference.target.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    client = _client(server)
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == reference(ids, 20)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 20)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_models_health_and_the_ready_line(server, pair):
    assert re.search(r"ready: http://127\.0\.0\.1:\d+ \(model target .*max-batch 4", server.ready_line)
    assert server.url.rsplit(":", 1)[1] != "0"
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["target"]
    assert httpx.get(server.url + "/health").status_code == 200
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


@pytest.mark.slow
def test_health_is_503_once_the_engine_loop_stops_and_a_failing_request_harms_no_other():
    """In process, with a real engine over a tiny random model and the byte tokenizer: a request whose
    tokenization raises gets a 500 error body while the next is served; chat needs a chat template; after the
    engine's loop stops, /health and requests answer 503."""
    import jax.numpy as jnp

    from infer.engine import Engine, EngineConfig
    from infer.main import tiny_random_target
    from infer.serve_app import Served, build_app

    class FailingTokenizer(ByteTokenizer):
        def encode(self, text):
            if text == "boom":
                raise RuntimeError("tokenizer failure")
            return super().encode(text)

    target, tokenizer = tiny_random_target(jnp.float32)
    engine = Engine(target, None, EngineConfig(max_batch=1, max_context=64, max_queue=2))
    engine.start()
    app = build_app(Served(engine, FailingTokenizer(), tokenizer.decode, "tiny", 64, 256))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            failed = await client.post("/v1/completions", json=dict(prompt="boom"))
            served = await client.post("/v1/completions", json=dict(prompt="ok", max_tokens=3, temperature=0))
            healthy = await client.get("/health")
            no_chat = await client.post("/v1/chat/completions", json=dict(messages=[{"role": "user", "content": "hi"}]))
            engine.shutdown()
            return failed, served, healthy, no_chat, await client.get("/health"), await client.post(
                "/v1/completions", json=dict(prompt="ok", max_tokens=3))

    failed, served, healthy, no_chat, dead, refused = asyncio.run(main())
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    assert healthy.status_code == 200
    assert no_chat.status_code == 400 and "no chat template" in no_chat.json()["error"]["message"]
    assert dead.status_code == 503 and dead.json()["error"]["type"] == "ServiceUnavailableError"
    assert refused.status_code == 503


# ------------------------------------------------------------------------------------------------ the default model

@pytest.fixture(scope="module")
def default_server(run_dir):
    """``python -m infer.serve`` without ``--target``: the embedded model and its draft."""
    args = ["--dtype", "float32", "--max-batch", "2", "--max-context", "512", "--log-level", "warning",
            "--compile-on-demand"]
    shared = sh.SharedServer(run_dir / "default-server", args)
    yield shared
    shared.close()


@pytest.mark.slow
def test_the_embedded_default_model_is_served_with_its_draft(default_server):
    from infer.main import DEFAULT_MODEL

    reference = sh.Reference(str(DEFAULT_MODEL / "target"))
    prompts = ["def fibonacci(n):", "import os\n\n\ndef main():\n"]

    async def main():
        async with _async_client(default_server) as client:
            whole = client.completions.create(model="longspec-default", prompt=prompts[0], max_tokens=48,
                                              temperature=0)
            stream = client.completions.create(model="longspec-default", prompt=prompts[1], max_tokens=48,
                                               temperature=0, stream=True)
            whole, stream = await asyncio.gather(whole, stream)
            text, finish = [], None
            async for chunk in stream:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            return [(whole.choices[0].text, whole.choices[0].finish_reason), ("".join(text), finish)]

    with default_server.exclusive():
        before = default_server.wait_idle()
        served = asyncio.run(main())
        after = default_server.wait_idle()
        no_chat = httpx.post(default_server.url + "/v1/chat/completions", timeout=30,
                             json=dict(messages=[{"role": "user", "content": "hi"}]))
    for prompt, got in zip(prompts, served):
        assert got == reference.complete(reference.encode(prompt), 48), prompt
    assert "model longspec-default" in default_server.ready_line
    assert str(DEFAULT_MODEL / "draft") in default_server.ready_line
    delta = lambda name: after[name] - before[name]
    assert delta("longspec:spec_decode_num_drafts_total") > 0
    assert delta("longspec:spec_decode_num_accepted_tokens_total") > 0  # the trained draft is right at times
    assert no_chat.status_code == 400 and "no chat template" in no_chat.json()["error"]["message"]


@pytest.mark.slow
def test_a_target_sharded_over_two_devices_is_served_as_on_one(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from infer.main import tiny_random_target

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    served = sh.SharedServer(tmp_path, ["--tiny-random", "--tensor-parallel", "2", "--dtype", "float32",
                                        "--max-batch", "2", "--max-context", "64", "--prefill-chunk", "16"])
    try:
        assert "tensor-parallel 2" in served.ready_line
        # 2 buckets x (insertion, retirement, 3 decode steps), compiled ahead
        assert "compiling 10 programs" in (tmp_path / "server.log").read_text()
        prompt = [5, 17, 99, 3, 42]
        body = dict(model="tiny-random", prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True)
        text = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        target, tokenizer = tiny_random_target(jnp.float32)
        out = generate(target, [prompt], max_new_tokens=12, eos_token_id=[])
        assert text == tokenizer.decode(out.tokens[0, :out.num_generated[0]].tolist())
    finally:
        served.close()
