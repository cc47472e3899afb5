"""``python -m infer.bench serve``: the schedules, per-request timings and statistics on synthetic data, the counters
and the report; against a fake OpenAI-compatible streaming server (this module, ``python -m tests.test_bench_serve``
runs it): the load generator in-process and the whole benchmark (slow).

The fake server streams ``max_tokens`` tokens of text ``"t"`` in chunks of 1, 3, 2, 1, 3, 2, ... tokens (as a
speculative server does), counts them as the real server's counters say, and finishes with a usage chunk."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from infer.bench import serve
from infer.bench.serve_load import (COUNTERS, Level, RequestRecord, counter_deltas, distribution, loopback_url,
                                    parse_metrics, poisson_arrivals, request_bodies, run_levels, static_batch_e2e,
                                    summarize, tau)
from infer.bench.serve_report import comparisons, markdown, plot
from infer.main import DEFAULT_MODEL

CHUNK_SIZES = (1, 3, 2)


# ------------------------------------------------------------------------------------------------ the fake server

def fake_app(delay_s: float = 0.002):
    """A FastAPI app with ``POST /v1/completions`` (streaming only), ``GET /health`` and ``GET /metrics``."""
    app = FastAPI()
    counts = dict.fromkeys(COUNTERS, 0)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if not body.get("stream") or not isinstance(body.get("prompt"), list):
            return PlainTextResponse("only streamed token-id prompts", status_code=400)

        async def events():
            left, k = body["max_tokens"], 0
            while left:
                n = min(CHUNK_SIZES[k % len(CHUNK_SIZES)], left)
                await asyncio.sleep(delay_s)
                counts["generation_tokens"] += n
                if k:  # the first chunk comes from the prefill; the others from a round each
                    counts["spec_rounds"] += 1
                    counts["drafted_tokens"] += 3
                    counts["accepted_tokens"] += n - 1
                left, k = left - n, k + 1
                choice = dict(index=0, text="t" * n, finish_reason=None if left else "length")
                yield f"data: {json.dumps(dict(object='text_completion', choices=[choice]))}\n\n"
            usage = dict(prompt_tokens=len(body["prompt"]), completion_tokens=body["max_tokens"],
                         total_tokens=len(body["prompt"]) + body["max_tokens"])
            yield f"data: {json.dumps(dict(choices=[], usage=usage))}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        lines = [f"# TYPE {COUNTERS[k].removesuffix('_total')} counter\n{COUNTERS[k]} {v}" for k, v in counts.items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    app.state.counts = counts
    return app


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def fake_server_main(argv) -> None:
    """Serves :func:`fake_app` on 127.0.0.1 (the ``--port``, 0: a free one) and prints the ready line."""
    import contextlib

    import uvicorn

    port = int(argv[argv.index("--port") + 1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    app = fake_app()

    @contextlib.asynccontextmanager
    async def announce(_):
        print(f"[infer.serve] ready: http://127.0.0.1:{sock.getsockname()[1]} (fake)", flush=True)
        yield

    app.router.lifespan_context = announce
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


@pytest.fixture
def fake_server():
    """The fake app served in a thread of this process: (url, its counters)."""
    import uvicorn

    app, sock = fake_app(), bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.counts
    server.should_exit = True
    thread.join(10)


# ------------------------------------------------------------------------------------------------ pure functions

def test_poisson_arrivals_are_seeded_bounded_and_at_the_rate():
    times = poisson_arrivals(4.0, 2000, seed=3)
    assert len(times) == 2000 and times[0] == 0 and np.all(np.diff(times) >= 0)
    np.testing.assert_array_equal(times, poisson_arrivals(4.0, 2000, seed=3))
    assert not np.array_equal(times, poisson_arrivals(4.0, 2000, seed=4))
    assert np.mean(np.diff(times)) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(math.inf, 5, 0).tolist() == [0.0] * 5 and len(poisson_arrivals(2.0, 0, 0)) == 0


def test_static_batches_wait_for_their_last_arrival_and_the_previous_batch():
    arrivals = [0.0, 1.0, 2.0, 2.5, 9.0]
    # batch 0 (requests 0, 1) starts at 1 and ends at 4; batch 1 (2, 3) waits for it: 4 -> 7; batch 2 (4): 9 -> 10
    e2e = static_batch_e2e(arrivals, [3.0, 3.0, 1.0], batch=2)
    np.testing.assert_allclose(e2e, [4.0, 3.0, 5.0, 4.5, 1.0])


def test_a_request_counts_tokens_from_usage_not_chunks():
    record = RequestRecord(index=0, prompt_tokens=10)
    text = lambda t, reason=None: dict(choices=[dict(text=t, finish_reason=reason)])
    record.take(dict(choices=[dict(text="", finish_reason=None)]), 0.05)  # no text yet: not the first token
    record.take(text("a"), 0.1)
    record.take(text("bcd"), 0.3)
    record.take(text("ef", "length"), 0.6)
    record.take(dict(choices=[], usage=dict(prompt_tokens=10, completion_tokens=6, total_tokens=16)), 0.61)
    record.e2e = 0.7
    assert record.ok and record.output_tokens == 6 and record.finish_reason == "length"
    assert record.ttft == 0.1 and record.itl == pytest.approx([0.2, 0.3])
    assert record.tpot == pytest.approx((0.7 - 0.1) / 5)
    single = RequestRecord(1, 3, ttft=0.2, e2e=0.2, output_tokens=1)
    assert single.ok and single.tpot is None and single.itl == []
    assert not RequestRecord(2, 3, ttft=0.1, e2e=0.5).ok  # no usage chunk
    assert not RequestRecord(3, 3, e2e=0.5, output_tokens=4, error="HTTP 503: full").ok


def test_distribution_and_summary():
    assert distribution([3.0, 1.0, 2.0, None]) == dict(mean=2.0, p50=2.0, p99=pytest.approx(2.98))
    assert distribution([]) == dict(mean=None, p50=None, p99=None)
    done = [RequestRecord(i, 5, sent=0.0, ttft=0.1 * (i + 1), e2e=1.0, chunk_times=[0.1 * (i + 1), 0.9],
                          output_tokens=4) for i in range(3)]
    failed = RequestRecord(3, 5, error="HTTP 503: queue full")
    s = summarize(done + [failed], duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"], s["output_tokens"]) == (4, 3, 1, 12)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 6.0
    assert s["ttft_s"]["mean"] == pytest.approx(0.2) and s["tpot_s"]["p50"] == pytest.approx(0.8 / 3)
    assert s["itl_s"]["mean"] == pytest.approx(np.mean([0.8, 0.7, 0.6])) and s["e2e_s"]["p99"] == 1.0
    assert s["errors"] == ["HTTP 503: queue full"]


def test_counters_and_tau():
    name = lambda key: COUNTERS[key].removesuffix("_total")
    text = (f"# TYPE {name('generation_tokens')} counter\n"
            f'{COUNTERS["generation_tokens"]}{{slot="0"}} 30\n{COUNTERS["generation_tokens"]}{{slot="1"}} 10\n'
            f"# TYPE {name('accepted_tokens')} counter\n{COUNTERS['accepted_tokens']} 27\n"
            "# TYPE other gauge\nother 2\n")
    after = parse_metrics(text)
    assert after[COUNTERS["generation_tokens"]] == 40 and after["other"] == 2  # summed over label sets
    deltas = counter_deltas({COUNTERS["generation_tokens"]: 4.0, COUNTERS["accepted_tokens"]: 3.0}, after)
    assert deltas == dict(generation_tokens=36.0, accepted_tokens=24.0)
    counts = lambda generated, rounds, plain: dict(generation_tokens=generated, spec_rounds=rounds, plain_steps=plain)
    assert tau(counts(36.0, 9.0, 0.0), requests=3) == 3.0  # 36 tokens in 3 prefills + 9 rounds
    assert tau(counts(40.0, 9.0, 4.0), requests=3) == 2.5  # and 4 plain steps
    assert tau(dict(generation_tokens=36.0, plain_steps=33.0), 3) == 1.0  # no draft: a prefill and plain steps
    assert tau(counts(0.0, 0.0, 0.0), 0) is None and tau({}, 3) is None


def test_only_loopback_urls():
    for url in ("http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:80", "http://127.0.0.2:9"):
        assert loopback_url(url) == url.rstrip("/")
    for url in ("http://0.0.0.0:8000", "http://10.0.0.1:80", "http://example.com", "http://[::]:1"):
        with pytest.raises(ValueError, match="only loopback"):
            loopback_url(url)


def test_request_bodies_cycle_prompts_and_seeds():
    bodies = request_bodies([[1, 2], [3]], 3, max_tokens=5, temperature=0.5, top_p=0.9, seed=7, ignore_eos=True)
    assert [b["prompt"] for b in bodies] == [[1, 2], [3], [1, 2]] and [b["seed"] for b in bodies] == [7, 8, 9]
    assert bodies[0]["stream_options"] == {"include_usage": True} and bodies[0]["ignore_eos"] is True
    assert "ignore_eos" not in request_bodies([[1]], 1, 5, 0.0, 1.0, 0, False)[0]


def level(kind, value, throughput, ttft, tpot, e2e, tau_value=None):
    dist = lambda v: dict(mean=v, p50=v, p99=v)
    return dict(kind=kind, value=value, requests=4, completed=4, request_throughput=1.0, output_throughput=throughput,
                tau=tau_value, ttft_s=dist(ttft), tpot_s=dist(tpot), itl_s=dist(tpot), e2e_s=dist(e2e))


def test_comparisons_table_and_plots(tmp_path):
    report = dict(device="cpu", config=dict(prompts=2, bucket=(32, 64), max_tokens=8, temperature=0.0),
                  servers=dict(draft=dict(levels=[level("concurrency", 1, 300.0, 0.02, 0.004, 0.05, 2.5),
                                                  level("rate", 2.0, 200.0, 0.03, 0.005, 0.06, 2.4)]),
                               plain=dict(levels=[level("concurrency", 1, 100.0, 0.01, 0.01, 0.1),
                                                  level("rate", 2.0, 100.0, 0.01, 0.01, 0.12)])),
                  baseline=dict(draft=dict(single=dict(prompts=2, tpot_s=0.002, e2e_mean_s=0.02),
                                           static={"2": dict(batch=8, e2e_mean_s=0.3)}),
                                plain=dict(single=dict(prompts=2, tpot_s=0.008, e2e_mean_s=0.07),
                                           static={"2": dict(batch=8, e2e_mean_s=0.4)})))
    rows = {(r["kind"], r["value"]): r for r in comparisons(report)}
    c1, r2 = rows["concurrency", 1], rows["rate", 2.0]
    assert c1["throughput_draft_over_plain"] == 3.0 and c1["ttft_p50_draft_over_plain"] == 2.0
    assert c1["tpot_p50_over_generate_draft"] == 2.0 and c1["tpot_p50_over_generate_plain"] == 1.25
    assert "e2e_mean_over_static_draft" not in c1 and "tpot_p50_over_generate_draft" not in r2
    assert r2["e2e_mean_over_static_draft"] == pytest.approx(0.2) and r2["e2e_mean_over_static_plain"] == 0.3
    report["comparisons"] = list(rows.values())
    table = markdown(report)
    assert "| draft | concurrency 1 | 4/4 | 1.00 | 300.0 | 2.50 | 20.0 / 20.0 / 20.0 |" in table
    assert "| plain | rate 2 | 4/4 | 1.00 | 100.0 |  | 10.0 / 10.0 / 10.0 |" in table
    assert "| concurrency 1 | 3.00 | 2.00 | 2.00 | 1.25 |" in table
    assert "static batches of 8 at rate 2: E2E mean 300.0 ms" in table
    assert plot(report, str(tmp_path)) == [str(tmp_path / "serve_concurrency.png"), str(tmp_path / "serve_rate.png")]


def test_command_line_errors(capsys):
    for argv, message in ((["--target", "t"], "--target and --draft go together"),
                          (["--concurrency", "", "--smoke"], "no load"),
                          (["--request-rates", "2,-1"], "request rates must be > 0"),
                          (["--bucket", "64-32"], "0 <= LO < HI"),
                          (["--smoke", "--dtype", "float16"], "--dtype: choose from"),
                          (["--smoke", "--rounds-per-step", "0"], "--rounds-per-step must be positive")):
        with pytest.raises(SystemExit):
            serve.main(["--out", "unused", *argv])
        assert message in capsys.readouterr().err


def test_server_command_lines():
    from infer.serve import build_parser, engine_config

    ns = type("Args", (), dict(target="T", draft="D", max_batch=4, max_context=96, max_queue=8, prefill_chunk=64,
                               rounds_per_step=3, dtype="float32", compile_on_demand=False))
    tail = ["--host", "127.0.0.1", "--port", "0", "--max-batch", "4", "--max-context", "96", "--max-queue", "8",
            "--prefill-chunk", "64", "--rounds-per-step", "3", "--dtype", "float32"]
    assert serve.server_argv(ns, "draft", "infer.serve") == [sys.executable, "-m", "infer.serve", "--target", "T",
                                                             "--draft", "D", *tail]
    assert serve.server_argv(ns, "plain", "infer.serve")[3:6] == ["--target", "T", "--no-draft"]
    ns.target = ns.draft = None  # the default model
    assert serve.server_argv(ns, "draft", "m")[3:] == tail and serve.server_argv(ns, "plain", "m")[3] == "--no-draft"
    config = engine_config(build_parser().parse_args(tail))  # the server reads every setting the bench passes
    assert (config.max_batch, config.max_context, config.max_queue, config.prefill_chunk,
            config.rounds_per_step, config.compile_ahead) == (4, 96, 8, 64, 3, True)
    ns.compile_on_demand = True
    assert serve.server_argv(ns, "plain", "m")[-1] == "--compile-on-demand"
    assert not engine_config(build_parser().parse_args([*tail, "--compile-on-demand"])).compile_ahead


def test_servers_and_baselines_are_chosen_by_name():
    assert serve.servers_arg("plain") == ("plain",) and serve.servers_arg("draft,plain") == ("draft", "plain")
    for bad in ("", "draft,draft", "hf"):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct names among draft, plain"):
            serve.servers_arg(bad)


def test_the_server_process_is_awaited_and_stopped(tmp_path):
    def python(code):
        return [sys.executable, "-c", code]

    ready = "print('[infer.serve] ready: http://127.0.0.1:5 x', flush=True); import time; time.sleep(60)"
    with serve.running_server(python(ready), str(tmp_path / "a.log"), 20) as url:
        assert url == "http://127.0.0.1:5"
    with pytest.raises(RuntimeError, match="exited with status 3 before it was ready"):
        with serve.running_server(python("import sys; sys.exit(3)"), str(tmp_path / "b.log"), 20):
            pass
    with pytest.raises(TimeoutError, match="not ready within 0.5 s"):
        with serve.running_server(python("import time; time.sleep(60)"), str(tmp_path / "c.log"), 0.5):
            pass
    with pytest.raises(ValueError, match="only loopback"):
        with serve.running_server(python(ready.replace("127.0.0.1", "10.1.2.3")), str(tmp_path / "d.log"), 20):
            pass


# ------------------------------------------------------------------------------------------------ against the fake

@pytest.mark.slow
def test_load_levels_against_the_fake_server(fake_server):
    url, counts = fake_server
    bodies = request_bodies([[1, 2, 3], [4, 5]], 6, max_tokens=7, temperature=0.0, top_p=1.0, seed=0,
                            ignore_eos=False)
    levels = [Level("concurrency", 1), Level("concurrency", 3), Level("rate", 50.0)]
    results = asyncio.run(run_levels(url, levels, bodies, seed=0, deadline_s=30, warmup=2, log=lambda m: None))
    assert counts["generation_tokens"] == 7 * (2 + 3 * 6)  # the warm-up and three levels of 6 requests
    for result in results:
        assert (result["completed"], result["failed"], result["output_tokens"]) == (6, 0, 42)
        assert result["counters"]["generation_tokens"] == 42
        assert result["tau"] == pytest.approx(42 / 24)  # 4 chunks per request (1 + 3 + 2 + 1 tokens)
        assert result["acceptance"] == pytest.approx((2 + 1 + 0) / 9)
        assert all(r["chunks"] == 4 and r["ttft_s"] <= r["e2e_s"] for r in result["records"])
        assert 0 < result["ttft_s"]["p50"] <= result["e2e_s"]["p50"] and not result["timed_out"]
    sent = [r["sent_s"] for r in results[2]["records"]]
    np.testing.assert_allclose(sent, poisson_arrivals(50.0, 6, 0), atol=0.05)  # sent on the schedule
    serial = [r["sent_s"] for r in results[0]["records"]]
    assert all(b >= a + e for a, b, e in zip(serial, serial[1:], [r["e2e_s"] for r in results[0]["records"]]))


@pytest.mark.slow
def test_a_level_stops_at_its_deadline(fake_server):
    url, _ = fake_server
    bodies = request_bodies([[1]], 4, max_tokens=2000, temperature=0.0, top_p=1.0, seed=0, ignore_eos=False)
    start = time.perf_counter()
    (result,) = asyncio.run(run_levels(url, [Level("concurrency", 1)], bodies, 0, deadline_s=0.5, warmup=0,
                                       log=lambda m: None))
    assert time.perf_counter() - start < 5 and result["timed_out"]
    assert result["completed"] == 0 and result["failed"] == 4
    assert set(result["errors"]) == {"cancelled at the level's deadline", "not sent before the level's deadline"}


@pytest.mark.slow
def test_the_benchmark_runs_both_servers(tmp_path, monkeypatch):
    """The whole run against the fake server started as a subprocess (prompts made up, no baseline)."""
    monkeypatch.setattr(serve, "load_prompts", lambda args, target_dir: [[1, 2, 3], [4, 5, 6, 7]])
    argv = ["--out", str(tmp_path), "--smoke", "--concurrency", "1,2", "--request-rates", "20", "--num-requests", "5"]
    monkeypatch.setattr(serve, "run", functools.partial(serve.run, server_module="tests.test_bench_serve"))
    assert serve.main(argv) == 0
    report = json.loads((tmp_path / "bench_serve.json").read_text())
    for server in ("draft", "plain"):
        levels = report["servers"][server]["levels"]
        assert [(lv["kind"], lv["value"], lv["completed"]) for lv in levels] == [
            ("concurrency", 1, 5), ("concurrency", 2, 5), ("rate", 20.0, 5)]
        assert (tmp_path / f"server_{server}.log").read_text().startswith("[infer.serve] ready")
    assert len(report["comparisons"]) == 3 and report["device"] and report["baseline"] is None
    assert report["plots"] == [str(tmp_path / "serve_concurrency.png"), str(tmp_path / "serve_rate.png")]
    assert "| draft | concurrency 2 | 5/5 |" in (tmp_path / "bench_serve.md").read_text()


if __name__ == "__main__":
    fake_server_main(sys.argv[1:])


@pytest.mark.slow
def test_smoke_run_of_the_real_server(tmp_path):
    """``python -m infer.bench serve --smoke`` with the baseline: every field, and the output tokens of each level
    summed over its requests equal to the server's generation-token counter over the level."""
    if not (DEFAULT_MODEL / "target" / "config.json").is_file():
        pytest.skip("the embedded default model is absent")
    argv = ["--out", str(tmp_path), "--smoke", "--baseline", "--baseline-batch", "2", "--ignore-eos",
            "--request-rates", "8", "--num-requests", "3", "--max-tokens", "6", "--compile-on-demand"]
    run = subprocess.run([sys.executable, "-m", "infer.bench", "serve", *argv], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "bench_serve.json").read_text())
    for server in ("draft", "plain"):
        levels = report["servers"][server]["levels"]
        assert [(lv["kind"], lv["value"]) for lv in levels] == [("concurrency", 1), ("concurrency", 2), ("rate", 8)]
        for lv in levels:
            assert (lv["completed"], lv["failed"], lv["timed_out"]) == (3, 0, False)
            assert lv["output_tokens"] == sum(r["output_tokens"] for r in lv["records"]) == 3 * 6
            assert lv["counters"]["generation_tokens"] == lv["output_tokens"]
            for stat in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
                assert set(lv[stat]) == {"mean", "p50", "p99"} and lv[stat]["p50"] > 0
            assert lv["request_throughput"] > 0 and lv["output_throughput"] > 0
        assert all(lv["tau"] == 1.0 for lv in levels) if server == "plain" else all(lv["tau"] >= 1 for lv in levels)
        base = report["baseline"][server]
        assert base["single"]["prompts"] == 3 and base["single"]["tpot_s"] > 0 and len(base["batch_seconds"]) == 2
        assert base["static"]["8"]["e2e_mean_s"] > 0
    rows = {(r["kind"], r["value"]): r for r in report["comparisons"]}
    assert set(rows["concurrency", 1]) >= {"throughput_draft_over_plain", "ttft_p50_draft_over_plain",
                                           "tpot_p50_over_generate_draft", "tpot_p50_over_generate_plain"}
    assert set(rows["rate", 8]) >= {"e2e_mean_over_static_draft", "e2e_mean_over_static_plain"}
    assert report["device"] and len(report["plots"]) == 2
