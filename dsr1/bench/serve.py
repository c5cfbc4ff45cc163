"""The `serve` benchmark: one workload of requests through the serving engine (continuous batching)
and through static batches of `dsr1.generate`, same model, same run.

The workload (`make_workload`, seeded): N requests with Poisson arrivals (`rate` requests per
second), prompt lengths uniform in a range, a share of the prompts beginning with one common
prefix (a system prompt), and mixed output lengths: by default exponential (many short answers,
a few long ones, as in chat logs), clipped to a range; or uniform. Greedy sampling.

- **continuous**: `dsr1.serving.Engine` (warmed up first, so nothing compiles while timed);
  requests are submitted when their arrival time has passed, and the loop steps while there is
  work.
- **static**: the requests in arrival order, in batches of `max_seqs`; a batch starts when its
  last request has arrived and the previous batch is done, and runs `dsr1.generate` to the end of
  its longest output. The same batches run once untimed first: `generate` compiles a program per
  (prompt bucket, output budget), which would otherwise be timed.

Per request: time to first token (TTFT) = first token on the host − arrival; inter-token latency
(ITL) = (last token − first token) / (tokens − 1). For static batches a row's first token is
counted when its batch's prefill returns, and its later tokens at the batch's decode step time,
as if streamed (kinder than the real API, which returns when the whole batch is done).
Throughput = generated tokens / (last token − first arrival).

`prefix_ttft`: a request with a long prompt, then a second one sharing all but its last few
tokens: the second one's TTFT against the first's (the prefix cache at work).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..api import Model
from ..generation.batch import generate
from ..generation.sampling import Sampling
from ..serving import Engine

__all__ = ["EngineShape", "RequestTiming", "Workload", "WorkloadSpec", "arrival_bound", "make_workload", "prefix_ttft",
           "run_engine", "run_static", "summarize"]

OUTPUT_DISTRIBUTIONS = ("exponential", "uniform")


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What `make_workload` draws: counts, lengths (inclusive ranges) and the shared prefix."""

    requests: int = 64
    rate: float = 100.0  # requests per second (Poisson arrivals); inf: all at once
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (4, 256)
    output_dist: str = "exponential"
    output_mean: float = 48.0  # of the exponential, before clipping
    shared_prefix: int = 128  # tokens of the common prefix
    shared_fraction: float = 0.5  # requests whose prompt begins with it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.output_dist not in OUTPUT_DISTRIBUTIONS:
            raise ValueError(f"output_dist={self.output_dist!r}; choose one of {OUTPUT_DISTRIBUTIONS}")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}={getattr(self, name)}: need 1 <= min <= max")
        if self.requests < 1 or self.rate <= 0 or not 0 <= self.shared_fraction <= 1:
            raise ValueError("need requests >= 1, rate > 0 and shared_fraction in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Workload:
    arrivals: tuple[float, ...]  # seconds after the start, ascending
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]
    shared: tuple[bool, ...]  # the prompt begins with the common prefix

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def longest(self) -> int:
        """The longest prompt + output of any request."""
        return max(len(p) + n for p, n in zip(self.prompts, self.max_new_tokens))


def make_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    """Draw the workload of `spec` (deterministic in `spec.seed`); token ids avoid 0 and 1 (BOS, EOS)."""
    rng = np.random.default_rng(spec.seed)
    n = spec.requests
    gaps = rng.exponential(1 / spec.rate, n) if np.isfinite(spec.rate) else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
    prefix = rng.integers(2, vocab_size, spec.shared_prefix).tolist()
    shared = rng.random(n) < spec.shared_fraction
    lengths = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, n)
    prompts = []
    for length, with_prefix in zip(lengths, shared):
        head = prefix if with_prefix else []
        prompts.append(tuple(head + rng.integers(2, vocab_size, max(int(length) - len(head), 1)).tolist()))
    low, high = spec.output_len
    if spec.output_dist == "exponential":
        outputs = np.clip(np.rint(rng.exponential(spec.output_mean, n)), low, high)
    else:
        outputs = rng.integers(low, high + 1, n)
    return Workload(tuple(arrivals.tolist()), tuple(prompts), tuple(int(o) for o in outputs),
                    tuple(bool(s) for s in shared))


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The serving engine's sizes (`dsr1.serving.Engine` arguments)."""

    max_seqs: int = 8
    page_size: int = 16
    num_pages: int = 1024
    prefill_chunk: int = 64
    prefill_rows: int = 4
    host_cache_bytes: int = 0
    decode_steps: int = 4
    disaggregate: tuple[int, int] | None = None  # (prefill, decode) devices; None: one mixed engine

    def engine(self, model: Model, max_seq_len: int) -> Engine:
        return Engine(model, **dataclasses.asdict(self), max_seq_len=max_seq_len)


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """One request's times in seconds after the start of its run."""

    arrival: float
    first_token: float
    last_token: float
    tokens: int


def _wait_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _max_seq_len(workload: Workload, page_size: int) -> int:
    """The engine's longest sequence for the workload, rounded up to whole pages."""
    return -(-workload.longest // page_size) * page_size


def run_engine(model: Model, workload: Workload, shape: EngineShape,
               outputs: list[list[int]] | None = None) -> tuple[list[RequestTiming], dict[str, Any]]:
    """The workload through a fresh, warmed-up engine in real time; each request's times, and the
    engine's stats at the end (each request's tokens appended to `outputs` when given)."""
    engine = shape.engine(model, _max_seq_len(workload, shape.page_size))
    engine.warm_up()
    start = time.perf_counter()
    requests, pending = [], 0
    while pending < len(workload) or engine.has_work:
        now = time.perf_counter() - start
        while pending < len(workload) and workload.arrivals[pending] <= now:
            requests.append(engine.submit(list(workload.prompts[pending]),
                                          max_new_tokens=workload.max_new_tokens[pending]))
            pending += 1
        if not engine.step() and pending < len(workload):
            _wait_until(start + workload.arrivals[pending])  # idle until the next arrival
    engine.check()
    if outputs is not None:
        outputs += [r.tokens for r in requests]
    timings = [RequestTiming(arrival, r.first_token_at - start, r.finished_at - start, len(r.tokens))
               for arrival, r in zip(workload.arrivals, requests)]
    return timings, dataclasses.asdict(engine.stats())


def _static_batches(workload: Workload, batch: int) -> list[list[int]]:
    return [list(range(i, min(i + batch, len(workload)))) for i in range(0, len(workload), batch)]


def _generate_batch(model: Model, workload: Workload, rows: Sequence[int]):
    return generate(model, [list(workload.prompts[i]) for i in rows],
                    sampling=[Sampling(max_new_tokens=workload.max_new_tokens[i]) for i in rows])


def run_static(model: Model, workload: Workload, batch: int, compiled: bool = False) -> list[RequestTiming]:
    """The workload through static batches of `dsr1.generate` in real time (after one untimed pass
    of the same batches, which compiles their programs, unless `compiled`); each request's times."""
    batches = _static_batches(workload, batch)
    for rows in batches if not compiled else ():
        _generate_batch(model, workload, rows)
    start = time.perf_counter()
    timings: dict[int, RequestTiming] = {}
    for rows in batches:
        _wait_until(start + workload.arrivals[rows[-1]])
        began = time.perf_counter() - start
        result = _generate_batch(model, workload, rows)
        first = began + result.prefill_seconds
        steps = max(len(c.tokens) for c in result.completions) - 1
        step_s = result.decode_seconds / steps if steps > 0 else 0.0
        for i, completion in zip(rows, result.completions):
            n = len(completion.tokens)
            timings[i] = RequestTiming(workload.arrivals[i], first, first + max(n - 1, 0) * step_s, n)
    return [timings[i] for i in range(len(workload))]


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 99))) if len(values) else (0.0, 0.0)


def summarize(timings: Sequence[RequestTiming]) -> dict[str, float]:
    """Throughput, TTFT and ITL percentiles (milliseconds) of one run, and how long it went on after
    the last arrival (`after_last_arrival_s`; see `arrival_bound`)."""
    tokens = sum(t.tokens for t in timings)
    end = max(t.last_token for t in timings)
    seconds = end - min(t.arrival for t in timings)
    ttft = [1e3 * (t.first_token - t.arrival) for t in timings]
    itl = [1e3 * (t.last_token - t.first_token) / (t.tokens - 1) for t in timings if t.tokens > 1]
    (ttft_p50, ttft_p99), (itl_p50, itl_p99) = _percentiles(ttft), _percentiles(itl)
    return {"requests": len(timings), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ttft_p50_ms": ttft_p50, "ttft_p99_ms": ttft_p99, "itl_p50_ms": itl_p50, "itl_p99_ms": itl_p99,
            "after_last_arrival_s": end - max(t.arrival for t in timings)}


ARRIVAL_BOUND_TAIL = 0.25  # a run that ends within this share of its length after the last arrival


def arrival_bound(row: dict[str, float]) -> bool:
    """Whether a run (a `summarize` row) spent most of its time waiting for requests: it ended within
    `ARRIVAL_BOUND_TAIL` of its length after the last one arrived, so its throughput measures the
    arrival rate rather than the server, and a ratio of two such runs says little. (A faster machine
    turns a saturating rate into such a run: compare capacities with a higher rate, or inf.)"""
    return row["after_last_arrival_s"] < ARRIVAL_BOUND_TAIL * row["seconds"]


def prefix_ttft(model: Model, prefix_len: int, shape: EngineShape, seed: int = 0, suffix: int = 8,
                max_new_tokens: int = 4) -> dict[str, float]:
    """Time to first token of a `prefix_len + suffix`-token prompt on a fresh (warmed-up) engine, then
    of a second prompt with the same first `prefix_len` tokens and another suffix."""
    rng = np.random.default_rng(seed)
    vocab = model.cfg.vocab_size
    prefix = rng.integers(2, vocab, prefix_len).tolist()
    prompts = [prefix + rng.integers(2, vocab, suffix).tolist() for _ in range(2)]
    engine = shape.engine(model, -(-(prefix_len + suffix + max_new_tokens) // shape.page_size) * shape.page_size)
    engine.warm_up()
    ttft, cached = [], []
    for prompt in prompts:
        request = engine.submit(prompt, max_new_tokens=max_new_tokens)
        engine.run()
        ttft.append(request.time_to_first_token)
        cached.append(request.cached_tokens)
    engine.check()
    return {"prefix_len": prefix_len, "prompt_len": prefix_len + suffix, "first_ttft_ms": 1e3 * ttft[0],
            "second_ttft_ms": 1e3 * ttft[1], "second_cached_tokens": cached[1], "ratio": ttft[0] / ttft[1]}
