"""Prometheus metrics of one server (a `CollectorRegistry` per app, nothing global), served as text
on `GET /metrics`.

Counted by the server: HTTP requests by endpoint and status; requests accepted (by endpoint) and
finished (one per choice, by finish reason); rejected ones by reason; prompt tokens (once per
prompt, as `usage` counts them) and generated tokens; histograms of time to first token,
inter-token latency and request duration. Read from the engine's statistics snapshot at scrape
time: running and waiting requests, pages used, free and held by the prefix cache, prefix-cache
hits, pages offloaded to and reloaded from host memory, steps and throughput.

The same figures are also served under vLLM's names with a `model_name` label, so dashboards
made for vLLM work unchanged: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (a fraction, as vLLM's), `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:request_success_total` (by `finished_reason`),
`vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (tokens), and the histograms
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`,
`vllm:request_decode_time_seconds`, `vllm:request_inference_time_seconds`,
`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..serving import EngineStats, Request
from .runner import ABORT, Update

__all__ = ["HTTPMetricsMiddleware", "Metrics", "RequestClock"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the runner's statistics snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int], model_name: str):
        self._stats = stats
        self._in_flight = in_flight
        self._model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield from self._vllm(s)
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

    def _vllm(self, s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """vLLM's engine metrics, labelled with the model's name."""
        pages = s.pages_used + s.pages_free
        families = [
            (GaugeMetricFamily, "vllm:num_requests_running", "requests in the batch", s.running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "requests waiting for the batch", s.waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "fraction of the KV-cache pages in use (1 = full)",
             s.pages_used / pages if pages else 0.0),
            (CounterMetricFamily, "vllm:prompt_tokens", "prompt tokens of requests admitted", s.prompt_tokens),
            (CounterMetricFamily, "vllm:generation_tokens", "tokens generated", s.generated_tokens),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
             s.prompt_tokens),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
             s.prefix_hit_tokens),
        ]
        for kind, name, doc, value in families:
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family


class RequestClock:
    """Per-request timing for the latency histograms: when the last token came (engine thread only)."""

    def __init__(self) -> None:
        self.last_token_at: float | None = None
        self.tokens = 0
        self.queued = False  # the queue time was observed


class Metrics:
    """The server's metrics; `render()` is the Prometheus text."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int], model_name: str = ""):
        self.registry = CollectorRegistry()
        self.model_name = model_name
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
        r.register(_EngineCollector(stats, in_flight, model_name))
        self.vllm = _VLLMHistograms(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, endpoint: str, update: Update, clock: RequestClock) -> None:
        """Latencies and counts from one request's update (called on the engine thread)."""
        request, vllm, model = update.request, self.vllm, self.model_name
        if request.scheduled_at is not None and not clock.queued:
            clock.queued = True
            vllm.queue.labels(model).observe(request.scheduled_at - request.submitted_at)
        new = update.tokens - clock.tokens
        if new > 0:
            if clock.last_token_at is None:
                if request.time_to_first_token is not None:
                    self.ttft.observe(request.time_to_first_token)
                    vllm.ttft.labels(model).observe(request.time_to_first_token)
                # The step of the last prompt chunk also decodes: the tokens after the first came with it.
                gaps = [0.0] * (new - 1)
            else:
                gaps = [(update.at - clock.last_token_at) / new] * new
            for gap in gaps:
                self.itl.observe(gap)
                vllm.itl.labels(model).observe(gap)
            clock.last_token_at, clock.tokens = update.at, update.tokens
        if update.done:
            reason = _openai_reason(request.finish_reason)
            self.finished.labels(endpoint, reason).inc()
            self.generation_tokens.labels(endpoint).inc(update.tokens)
            self.duration.observe(update.at - request.submitted_at)
            self._observe_finished(request, update)

    def _observe_finished(self, request: Request, update: Update) -> None:
        """vLLM's per-request histograms and success count, once the request is done."""
        vllm, model = self.vllm, self.model_name
        vllm.success.labels(model, _openai_reason(request.finish_reason)).inc()
        vllm.e2e.labels(model).observe(update.at - request.submitted_at)
        vllm.prompt_tokens.labels(model).observe(len(request.prompt))
        vllm.generation_tokens.labels(model).observe(update.tokens)
        if request.first_token_at is not None:
            decode = update.at - request.first_token_at
            vllm.decode.labels(model).observe(decode)
            if update.tokens > 1:
                vllm.tpot.labels(model).observe(decode / (update.tokens - 1))
            if request.scheduled_at is not None:
                vllm.prefill.labels(model).observe(request.first_token_at - request.scheduled_at)
        if request.scheduled_at is not None:
            vllm.inference.labels(model).observe(update.at - request.scheduled_at)


def _openai_reason(reason: str | None) -> str:
    """The finish reason as the API reports it ("abort" for a cancelled request)."""
    return "abort" if reason == ABORT else reason or "unknown"


class _VLLMHistograms:
    """vLLM's request histograms and counters (label `model_name`)."""

    def __init__(self, r: CollectorRegistry):
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "time to first token", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "time between output tokens", _ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "a request's decode time per output token after the first", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "submission to finish", _DURATION_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "submission to admission into the batch",
                               _QUEUE_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "admission to first token", _DURATION_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "first token to finish", _DURATION_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "admission to finish", _DURATION_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "prompt tokens per request", _LENGTH_BUCKETS)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "output tokens per request",
                                           _LENGTH_BUCKETS)
        self.success = Counter("vllm:request_success", "requests finished, by finish reason",
                               ["model_name", "finished_reason"], registry=r)


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
