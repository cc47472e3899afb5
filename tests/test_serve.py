"""The OpenAI-compatible server (``python -m infer.serve``).

Fast tests: incremental detokenization and stop strings, request parsing, the metrics exposition. Slow tests drive
a real server process (``--port 0``, float32) with the ``openai`` client and httpx: a tiny random target with a BPE
tokenizer and a chat template and its random draft, and the embedded default model.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.detokenize import IncrementalDetokenizer
from infer.engine import EngineStats
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
