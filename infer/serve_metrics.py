"""The server's Prometheus metrics (``GET /metrics``), named like vLLM's with the prefix ``longspec:``.

Latencies are histograms observed per request (time to first token, the gap between streamed chunks, end to end,
time queued before a slot); the load gauges and the token counters are read from ``engine.stats()`` at each
scrape by a collector, so they are exactly the engine's own counts.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
# (metric name, help, EngineStats field)
GAUGES = (("longspec:num_requests_running", "Requests holding a slot.", "running"),
          ("longspec:num_requests_waiting", "Requests queued for a slot.", "waiting"))
COUNTERS = (("longspec:prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens"),
            ("longspec:generation_tokens", "Tokens generated and streamed to requests.", "generation_tokens"),
            ("longspec:plain_decode_steps", "Plain decode steps, counted per request.", "plain_steps"),
            ("longspec:spec_decode_num_drafts", "Speculative rounds, counted per request.", "spec_rounds"),
            ("longspec:spec_decode_num_draft_tokens", "Draft tokens proposed to verification.", "drafted_tokens"),
            ("longspec:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.",
             "accepted_tokens"))


class EngineCollector:
    """The engine's load and counters, read from ``engine.stats()`` when scraped."""

    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        stats = self._engine.stats()
        for name, doc, field in GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
        for name, doc, field in COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))


class ServeMetrics:
    """A registry of the engine's collector and the per-request histograms."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.time_to_first_token = histogram("longspec:time_to_first_token_seconds",
                                             "Time from the request's submission to its first token.")
        self.inter_token_latency = histogram("longspec:inter_token_latency_seconds",
                                             "Time between a request's successive chunks of tokens.")
        self.e2e_latency = histogram("longspec:e2e_request_latency_seconds",
                                     "Time from the request's submission to its end.")
        self.queue_time = histogram("longspec:request_queue_time_seconds",
                                    "Time from the request's submission to its admission into a slot.")
        self.finished = Counter("longspec:request_success", "Requests ended, by finish reason.",
                                ["finished_reason"], registry=self.registry)

    def request_ended(self, timings, finish_reason: str) -> None:
        """Observes a request's latencies from its :class:`infer.engine.Timings`."""
        end = timings.finished if timings.finished is not None else time.monotonic()
        self.e2e_latency.observe(end - timings.submitted)
        if timings.admitted is not None:
            self.queue_time.observe(timings.admitted - timings.submitted)
        if timings.first_token is not None:
            self.time_to_first_token.observe(timings.first_token - timings.submitted)
        self.finished.labels(finished_reason=finish_reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
