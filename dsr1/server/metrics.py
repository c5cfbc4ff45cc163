"""Prometheus metrics of one server (a `CollectorRegistry` per app, nothing global), served as text
on `GET /metrics`.

Counted by the server: HTTP requests by endpoint and status; requests accepted (by endpoint) and
finished (one per choice, by finish reason); rejected ones by reason; prompt tokens (once per
prompt, as `usage` counts them) and generated tokens; histograms of time to first token,
inter-token latency and request duration. Read from the engine's statistics snapshot at scrape
time: running and waiting requests, pages used, free and held by the prefix cache, prefix-cache
hits, pages offloaded to and reloaded from host memory, steps and throughput.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..serving import EngineStats
from .runner import Update

__all__ = ["HTTPMetricsMiddleware", "Metrics", "RequestClock"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the runner's statistics snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]):
        self._stats = stats
        self._in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        gauges = {
            "dsr1_requests_running": ("requests holding a batch slot", s.running),
            "dsr1_requests_waiting": ("requests waiting for a slot or pages", s.waiting),
            "dsr1_requests_in_flight": ("requests submitted and not finished (the queue cap's count)",
                                        self._in_flight()),
            "dsr1_pages_used": ("device pages of the latent cache in use (running requests and prefix cache)",
                                s.pages_used),
            "dsr1_pages_free": ("device pages free", s.pages_free),
            "dsr1_pages_cached": ("device pages held by the prefix cache", s.pages_cached),
            "dsr1_host_cache_pages": ("prefix-cache pages held in host memory", s.host_pages),
            "dsr1_tokens_per_second": ("generated tokens per second of stepping", s.tokens_per_second),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "dsr1_prefix_hit_tokens": ("prompt tokens served from the prefix cache", s.prefix_hit_tokens),
            "dsr1_engine_prompt_tokens": ("prompt tokens of requests admitted by the engine", s.prompt_tokens),
            "dsr1_engine_generated_tokens": ("tokens sampled by the engine", s.generated_tokens),
            "dsr1_offloaded_pages": ("prefix-cache pages copied to host memory", s.offloaded_pages),
            "dsr1_reloaded_pages": ("prefix-cache pages brought back from host memory", s.reloaded_pages),
            "dsr1_engine_steps": ("engine steps", s.steps),
            "dsr1_spec_decode_draft_tokens": ("MTP draft tokens verified (--draft-tokens)", s.drafted_tokens),
            "dsr1_spec_decode_accepted_tokens": ("MTP draft tokens accepted", s.accepted_drafts),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class RequestClock:
    """Per-request timing for the latency histograms: when the last token came (engine thread only)."""

    def __init__(self) -> None:
        self.last_token_at: float | None = None
        self.tokens = 0


class Metrics:
    """The server's metrics; `render()` is the Prometheus text."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("dsr1_http_requests", "HTTP requests answered, by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.accepted = Counter("dsr1_requests_accepted", "completion requests accepted, by endpoint",
                                ["endpoint"], registry=r)
        self.rejected = Counter("dsr1_requests_rejected", "completion requests refused, by reason",
                                ["reason"], registry=r)
        self.finished = Counter("dsr1_requests_finished",
                                "engine requests (one per choice) finished, by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("dsr1_prompt_tokens", "prompt tokens of accepted requests (once per prompt)",
                                     ["endpoint"], registry=r)
        self.generation_tokens = Counter("dsr1_generation_tokens", "output tokens of finished requests",
                                         ["endpoint"], registry=r)
        self.ttft = Histogram("dsr1_time_to_first_token_seconds", "submission to first output token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("dsr1_inter_token_latency_seconds",
                             "time between a request's output tokens (one sample per token after the first)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.duration = Histogram("dsr1_request_duration_seconds", "submission to finish of an engine request",
                                  buckets=_DURATION_BUCKETS, registry=r)
        r.register(_EngineCollector(stats, in_flight))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, endpoint: str, update: Update, clock: RequestClock) -> None:
        """Latencies and counts from one request's update (called on the engine thread)."""
        request = update.request
        new = update.tokens - clock.tokens
        if new > 0:
            if clock.last_token_at is None:
                if request.time_to_first_token is not None:
                    self.ttft.observe(request.time_to_first_token)
                # The step of the last prompt chunk also decodes: the tokens after the first came with it.
                gaps = [0.0] * (new - 1)
            else:
                gaps = [(update.at - clock.last_token_at) / new] * new
            for gap in gaps:
                self.itl.observe(gap)
            clock.last_token_at, clock.tokens = update.at, update.tokens
        if update.done:
            self.finished.labels(endpoint, request.finish_reason or "unknown").inc()
            self.generation_tokens.labels(endpoint).inc(update.tokens)
            self.duration.observe(update.at - request.submitted_at)


class HTTPMetricsMiddleware:
    """Count every HTTP request by endpoint (the known routes, else "other") and response status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: Callable[[], set[str]]):
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app fails before it starts a response

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope["path"] if scope["path"] in self.endpoints() else "other"
            self.metrics.http_requests.labels(path, str(status)).inc()
