"""The load of ``python -m infer.bench serve``: arrival schedules, streamed requests timed from their chunks, the
server's counters, and the statistics of one load level.

A level sends a bounded number of requests to an OpenAI-compatible server on a loopback address, either at Poisson
arrivals of a given rate or from N clients that each send their next request when the last ends, and stops at a
hard deadline (requests still in flight then are cancelled and counted as failed). Each request streams
(``stream_options.include_usage``): TTFT is the time to the first chunk with text, ITL the gaps between such
chunks, E2E the time to the end of the stream, and the output tokens are the usage chunk's ``completion_tokens``
(a chunk may hold several tokens under speculation, so chunks are not counted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import math
import time
import urllib.parse

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from infer import serve_metrics

# The server's counters, by their engine-stats field: the sample names of /metrics (counters end in _total).
COUNTERS = {field: f"{name}_total" for name, _, field in serve_metrics.COUNTERS}
PERCENTILES = (50, 99)
STATS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


# ------------------------------------------------------------------------------------------------ schedules

def poisson_arrivals(rate: float, count: int, seed: int) -> np.ndarray:
    """Send times (seconds from the level's start) of ``count`` requests arriving as a Poisson process of
    ``rate`` requests/s, the first at 0; ``rate`` inf sends them all at once. The same seed gives the same times."""
    if count <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def static_batch_e2e(arrivals, batch_seconds, batch: int) -> np.ndarray:
    """Each request's E2E when requests run in static batches of ``batch`` in arrival order: a batch starts once
    its last request has arrived and the previous batch has ended, and lasts its measured ``batch_seconds``; a
    request's E2E is its batch's end less its arrival."""
    arrivals = np.asarray(arrivals, float)
    e2e, free = np.empty_like(arrivals), 0.0
    for k, seconds in enumerate(batch_seconds):
        rows = slice(k * batch, min((k + 1) * batch, len(arrivals)))
        free = max(free, arrivals[rows].max()) + seconds
        e2e[rows] = free - arrivals[rows]
    return e2e


# ------------------------------------------------------------------------------------------------ one request

@dataclasses.dataclass
class RequestRecord:
    """One request's times (seconds; ``sent`` from the level's start, the rest from its send) and its outcome."""

    index: int
    prompt_tokens: int
    sent: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # each chunk with text, from the send
    output_tokens: int | None = None  # the usage chunk's completion_tokens
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None and self.output_tokens is not None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than 2 tokens."""
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()

    def take(self, event: dict, at: float) -> None:
        """Takes one streamed JSON chunk that arrived ``at`` seconds after the send."""
        if event.get("error"):
            self.error = f"server error: {json.dumps(event['error'])[:300]}"
        for choice in event.get("choices") or ():
            if choice.get("text"):
                self.chunk_times.append(at)
                if self.ttft is None:
                    self.ttft = at
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        usage = event.get("usage")
        if usage:
            self.output_tokens = int(usage["completion_tokens"])

    def as_dict(self) -> dict:
        return dict(index=self.index, prompt_tokens=self.prompt_tokens, sent_s=self.sent, ttft_s=self.ttft,
                    tpot_s=self.tpot, e2e_s=self.e2e, chunks=len(self.chunk_times), output_tokens=self.output_tokens,
                    finish_reason=self.finish_reason, error=self.error)


async def stream_request(client: httpx.AsyncClient, body: dict, record: RequestRecord, level_start: float) -> None:
    """POSTs a streaming completion and fills ``record`` from its SSE ``data:`` lines up to ``[DONE]``; an HTTP
    error, a broken stream or a stream without a usage chunk is the record's error (cancellation too)."""
    start = time.perf_counter()
    record.sent = start - level_start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                record.take(json.loads(data), time.perf_counter() - start)
        record.e2e = time.perf_counter() - start
        if record.output_tokens is None and record.error is None:
            record.error = "no usage chunk in the stream"
    except asyncio.CancelledError:
        record.error = "cancelled at the level's deadline"
        raise
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]


# ------------------------------------------------------------------------------------------------ the server

def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, if its host is a loopback address (else ``ValueError``)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{url}: only loopback addresses are benchmarked")
    return url.rstrip("/")


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, by sample name, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def counter_deltas(before: dict, after: dict) -> dict[str, float]:
    """The change of each of :data:`COUNTERS` between two scrapes (those the server exposes)."""
    return {key: after[name] - before.get(name, 0.0) for key, name in COUNTERS.items() if name in after}


def tau(deltas: dict, requests: int) -> float | None:
    """Generated tokens per target pass, as ``generate`` counts it: the passes are each request's prefill, the
    speculative rounds and the plain steps (both counted per request). 1.0 without a draft; None where the server
    counted no tokens."""
    generated = deltas.get("generation_tokens")
    if not generated:
        return None
    return generated / (requests + deltas.get("spec_rounds", 0.0) + deltas.get("plain_steps", 0.0))


# ------------------------------------------------------------------------------------------------ statistics

def distribution(values) -> dict:
    """Mean, p50 and p99 of ``values`` (None for each where there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return dict(mean=None, **{f"p{q}": None for q in PERCENTILES})
    return dict(mean=float(np.mean(values)), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES})


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """A level's counts, throughputs over ``duration_s`` and the distributions of TTFT, TPOT, ITL (every gap of
    every request) and E2E over its completed requests."""
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in records if r.error})
    return dict(requests=len(records), completed=len(done), failed=len(records) - len(done), output_tokens=tokens,
                duration_s=duration_s, request_throughput=len(done) / duration_s if duration_s > 0 else None,
                output_throughput=tokens / duration_s if duration_s > 0 else None,
                ttft_s=distribution(r.ttft for r in done), tpot_s=distribution(r.tpot for r in done),
                itl_s=distribution(gap for r in done for gap in r.itl), e2e_s=distribution(r.e2e for r in done),
                errors=errors[:5])


# ------------------------------------------------------------------------------------------------ one level

@dataclasses.dataclass(frozen=True)
class Level:
    """``kind`` ``"rate"`` (Poisson arrivals of ``value`` requests/s) or ``"concurrency"`` (``value`` clients)."""

    kind: str
    value: float

    @property
    def name(self) -> str:
        return f"{self.kind}={self.value:g}"


async def run_level(client: httpx.AsyncClient, level: Level, bodies: list[dict], prompt_lengths: list[int],
                    seed: int, deadline_s: float) -> dict:
    """Sends ``bodies`` (one request each) at ``level``'s load, stopping at ``deadline_s``; the level's summary,
    tau from the server's counters before and after, and every request's record."""
    records = [RequestRecord(i, n) for i, n in enumerate(prompt_lengths)]
    before = parse_metrics((await client.get("/metrics")).text)
    start = time.perf_counter()
    tasks = []
    if level.kind == "rate":
        async def arrive(i: int, at: float):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            await stream_request(client, bodies[i], records[i], start)
        tasks = [asyncio.create_task(arrive(i, at))
                 for i, at in enumerate(poisson_arrivals(level.value, len(bodies), seed))]
    else:
        queue = iter(range(len(bodies)))

        async def client_loop():
            for i in queue:
                await stream_request(client, bodies[i], records[i], start)
        tasks = [asyncio.create_task(client_loop()) for _ in range(int(level.value))]
    _, late = await asyncio.wait(tasks, timeout=deadline_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    ends = [r.sent + r.e2e for r in records if r.ok]
    for r in records:
        if r.sent is None:
            r.error = "not sent before the level's deadline"
    after = parse_metrics((await client.get("/metrics")).text)
    summary = summarize(records, max(ends, default=0.0))
    deltas = counter_deltas(before, after)
    drafted = deltas.get("drafted_tokens")
    return dict(kind=level.kind, value=level.value, **summary, tau=tau(deltas, summary["completed"]),
                acceptance=deltas.get("accepted_tokens", 0.0) / drafted if drafted else None,
                counters=deltas, deadline_s=deadline_s, timed_out=bool(late),
                records=[r.as_dict() for r in records])


def request_bodies(prompts: list[list[int]], count: int, max_tokens: int, temperature: float, top_p: float,
                   seed: int, ignore_eos: bool) -> list[dict]:
    """``count`` streaming completion requests cycling over ``prompts`` (token ids), request i seeded
    ``seed + i``."""
    extra = {"ignore_eos": True} if ignore_eos else {}
    return [dict(prompt=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                 seed=seed + i, stream=True, stream_options={"include_usage": True}, **extra) for i in range(count)]


async def run_levels(url: str, levels: list[Level], bodies: list[dict], seed: int, deadline_s: float,
                     warmup: int, log=print, on_level=None) -> list[dict]:
    """Every level in turn against the server at ``url`` (loopback only), after ``warmup`` requests sent at once
    (untimed: they compile what the engine compiles on first use); ``on_level(results so far)`` after each."""
    lengths = [len(b["prompt"]) for b in bodies]
    async with httpx.AsyncClient(base_url=loopback_url(url), trust_env=False, timeout=httpx.Timeout(deadline_s),
                                 limits=httpx.Limits(max_connections=None)) as client:
        if warmup:
            records = [RequestRecord(i, n) for i, n in enumerate(lengths[:warmup])]
            await asyncio.wait_for(asyncio.gather(*(stream_request(client, b, r, time.perf_counter())
                                                    for b, r in zip(bodies, records))), deadline_s)
            failed = [r.error for r in records if not r.ok]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")
        results = []
        for level in levels:
            results.append(await run_level(client, level, bodies, lengths, seed, deadline_s))
            s = results[-1]
            log(f"  {level.name}: {s['completed']}/{s['requests']} done, {s['output_throughput'] or 0:.1f} "
                f"tok/s, TTFT p50 {1e3 * (s['ttft_s']['p50'] or math.nan):.1f} ms, tau {s['tau']}")
            if on_level is not None:
                on_level(results)
        return results
