"""The serving engine: continuous batching over the paged latent cache, driven by an event loop that
leans on JAX's asynchronous dispatch.

Each `step()`:

1. takes the requests submitted since the last step (from any thread);
2. plans the step on the host (`Scheduler.schedule`: cancellations, admissions, prefix-cache hits
   and reloads, prompt chunks, decode rows, pages);
3. dispatches it: `admit_slot` for new requests, then `serve_step` for the prefill lanes and for
   the decode rows. Dispatch returns at once; the device queues the work behind the previous step;
4. reads the *previous* step's sampled tokens — the only place the host waits, while the device
   already runs this step — and hands them to their requests (streaming, stop strings, budgets).

So the host's planning of step n+1 overlaps the device's step n, with no threads for the model.
A decoding row's next input is its slot's last sampled token, kept on device, so planning needs no
token from the step still running. `stats()` reports the host's time per step (planning,
dispatch, reading tokens) next to the device's.

Not here yet (later issues): several JAX processes (process 0 decides each step and broadcasts the
plan's host arrays — the `lane_rows` and page table a step passes to `serve_step` are exactly what
must be broadcast), the HTTP server and the `dsr1.bench serve` workload.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence

import jax
import numpy as np

from .. import programs
from ..api import Model
from ..core.sharding import put_replicated, to_host
from ..generation.output import Prompt, encode_prompt, needs_tokenizer, opens_thinking, request_sampling
from ..generation.sampling import Sampling, SamplingArrays, batch_sampling
from ..generation.tokenizer import Tokenizer, load_tokenizer
from ..programs import StepRows
from .page_pool import PagePool
from .pages import PageAllocator
from .prefix_cache import PrefixCache
from .request import Request, TextCallback
from .scheduler import Lane, Scheduler, SchedulerConfig, StepPlan, lane_rows, reserved_pages

__all__ = ["Engine", "EngineStats"]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. Times are per step, averaged over the steps so far: `host_ms_per_step`
    is the host's own work (planning, dispatch, handing out tokens); `wait_ms_per_step` the time it
    waited for the device; `device_ms_per_step` the device's time per step, measured between the
    moments successive steps' tokens were ready (exact while the host waits; an upper bound when
    the host is the bottleneck, i.e. when `wait_ms_per_step` is about 0)."""

    running: int
    waiting: int
    finished: int
    pages_used: int
    pages_free: int
    pages_cached: int  # device pages held by the prefix cache (some also used by running requests)
    prompt_tokens: int  # of admitted requests
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache instead of recomputed
    offloaded_pages: int  # pages copied to host memory by evictions, in total
    reloaded_pages: int  # pages brought back from host memory, in total
    host_pages: int  # pages held in host memory now
    host_bytes: int
    generated_tokens: int
    steps: int
    tokens_per_second: float  # generated tokens per second of stepping
    host_ms_per_step: float
    wait_ms_per_step: float
    device_ms_per_step: float


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched step whose tokens are not read yet: each call's lanes and sampled tokens."""

    calls: tuple[tuple[tuple[Lane, ...], jax.Array], ...]
    dispatched_at: float


@dataclasses.dataclass
class _Timing:
    steps: int = 0
    busy: float = 0.0  # wall time inside step()
    host: float = 0.0
    wait: float = 0.0
    device: float = 0.0
    last_ready: float = 0.0  # when the previous read step's tokens were ready


class Engine:
    """Serve many requests at once on `model`; see the module docstring.

    Args:
      max_seqs: batch slots (requests running at once).
      page_size: tokens per page of the latent cache.
      num_pages: pages in the device pool (page 0 is scratch); with `page_size`, the cache's size.
      prefill_chunk: prompt tokens a request prefills per step at most.
      prefill_rows: requests prefilling in one step at most (the prefill call is
        `prefill_rows x prefill_chunk` tokens).
      host_cache_bytes: host memory for prefix-cache pages evicted from the device (0: no offload).
      max_seq_len: the longest prompt + output (default: the model's limit, or the pool's size).
      prefix_caching: reuse cached prefixes (False: every prompt is prefilled in full).
      tokenizer: for text and chat prompts and output text (default: loaded on the first text prompt).
    """

    def __init__(self, model: Model, *, max_seqs: int = 8, page_size: int = 16, num_pages: int = 512,
                 prefill_chunk: int = 64, prefill_rows: int = 2, host_cache_bytes: int = 0,
                 max_seq_len: int | None = None, prefix_caching: bool = True, tokenizer: Tokenizer | None = None):
        if max_seq_len is None:
            max_seq_len = min(model.cfg.max_position_embeddings, (num_pages - 1) * page_size)
        if max_seq_len > model.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds max_position_embeddings="
                             f"{model.cfg.max_position_embeddings}")
        self.model = model
        self.config = SchedulerConfig(max_seqs, page_size, num_pages, prefill_chunk, prefill_rows, max_seq_len)
        self.tokenizer = tokenizer
        self._pool = PagePool(programs.paged_cache(cfg=model.cfg, mesh=model.mesh, num_pages=num_pages,
                                                   page_size=page_size, dtype=model.dtype,
                                                   kv_cache_dtype=model.kv_cache_dtype), model.mesh)
        idle = _device_sampling([Sampling(seed=0)] * max_seqs)
        self._state = programs.slot_state(put_replicated(idle, model.mesh), mesh=model.mesh,
                                          vocab_size=model.cfg.vocab_size)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(self.allocator, page_size, store=self._pool, host_bytes=host_cache_bytes,
                                        enabled=prefix_caching)
        self.scheduler = Scheduler(self.config, self.allocator, self.prefix_cache)
        self._submitted: deque[Request] = deque()
        self._submit_lock = threading.Lock()
        self._step_lock = threading.RLock()  # an on_text callback may ask for stats() inside a step
        self._next_id = 0
        self._in_flight: deque[_InFlight] = deque()
        self._timing = _Timing()

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, *, sampling: Sampling | None = None, max_new_tokens: int | None = None,
               chat: bool = False, on_text: TextCallback | None = None) -> Request:
        """Queue a prompt (token ids, text, or chat messages, as `dsr1.generate` takes them) and return its
        `Request`. Thread-safe. `max_new_tokens` overrides `sampling.max_new_tokens`; the model's EOS
        always stops; a request without a seed gets a random one now. `on_text(piece)` receives the
        output text as it streams, on the engine's thread. Raises ValueError for a prompt that could
        never run (bad token, longer than `max_seq_len`, more pages than the pool holds)."""
        tokenizer = self._tokenizer_for(prompt, sampling)
        tokens = encode_prompt(prompt, tokenizer, chat)
        eos = tokenizer.eos_id if tokenizer else self.model.cfg.eos_token_id
        settings = request_sampling(sampling or Sampling(), eos, max_new_tokens)
        if settings.seed is None:
            settings = dataclasses.replace(settings, seed=secrets.randbits(64))
        self._check_fits(tokens, settings.max_new_tokens)
        with self._submit_lock:
            request = Request(self._next_id, tokens, settings, tokenizer, thinking=opens_thinking(tokens, tokenizer),
                              on_text=on_text)
            self._next_id += 1
            self._submitted.append(request)
        return request

    def _tokenizer_for(self, prompt: Prompt, sampling: Sampling | None) -> Tokenizer | None:
        """The engine's tokenizer, loaded on the first text prompt (as `dsr1.generate` does)."""
        if self.tokenizer is None and needs_tokenizer(prompt):
            self.tokenizer = load_tokenizer()
        if self.tokenizer is None and sampling is not None and sampling.stop_strings:
            raise ValueError("stop strings need a tokenizer")
        return self.tokenizer

    def _check_fits(self, tokens: list[int], max_new_tokens: int) -> None:
        vocab = self.model.cfg.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = len(tokens) + max_new_tokens - 1
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) exceeds the engine's "
                             f"max_seq_len={self.config.max_seq_len}")
        pages = reserved_pages(len(tokens), max_new_tokens, self.config.page_size)
        if pages > self.allocator.capacity:
            raise ValueError(f"the request needs {pages} pages of {self.config.page_size} tokens; the pool has "
                             f"{self.allocator.capacity}")

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Requests are waiting, running, or have tokens not read yet."""
        return bool(self._submitted or self.scheduler.waiting or self.scheduler.running or self._in_flight)

    def step(self) -> bool:
        """Plan and dispatch one step, then read the previous step's tokens. Returns `has_work`.
        Call from one thread at a time (submit and cancel may come from any thread)."""
        with self._step_lock:
            start = time.perf_counter()
            with self._submit_lock:
                while self._submitted:
                    self.scheduler.add(self._submitted.popleft())
            self._pool.begin_step()
            plan = self.scheduler.schedule()
            if not plan.empty:
                self._in_flight.append(self._dispatch(plan))
            waited = 0.0
            # Read the step before this one (the device is busy with this one meanwhile); with nothing
            # new dispatched, read everything.
            while len(self._in_flight) > (0 if plan.empty else 1):
                waited += self._read(self._in_flight.popleft())
            self._pool.settle(everything=not self._in_flight)
            self._record(time.perf_counter() - start, waited, counted=not plan.empty or waited > 0)
            return self.has_work

    def run(self) -> None:
        """Step until no work is left."""
        while self.step():
            pass

    def _dispatch(self, plan: StepPlan) -> _InFlight:
        """Queue a step's programs on the device (returns at once): slot admissions, then the prefill
        call and the decode call, each starting its tokens' copy to the host."""
        cfg = self.config
        for seq in plan.admitted:
            self._admit_slot(seq.slot, seq.request.prompt, seq.request.sampling)
        calls = []
        table = put_replicated(plan.page_table, self.model.mesh) if plan.prefill or plan.decode else None
        for lanes, rows, chunk in ((plan.prefill, cfg.prefill_rows, cfg.prefill_chunk), (plan.decode, cfg.max_seqs, 1)):
            if lanes:
                calls.append((lanes, self._serve(lane_rows(lanes, rows, chunk, cfg.max_seqs), table)))
        return _InFlight(tuple(calls), time.perf_counter())

    def _serve(self, rows: StepRows, table: jax.Array) -> jax.Array:
        tokens, self._pool.cache, self._state = programs.serve_step(
            self.model.params, self._pool.cache, self._state, put_replicated(rows, self.model.mesh), table,
            **self.model.program_kwargs)
        tokens.copy_to_host_async()
        return tokens

    def _admit_slot(self, slot: int, prompt: Sequence[int], sampling: Sampling) -> None:
        """Give `slot` to a request on device: its sampling settings and prompt (for penalties)."""
        padded = np.zeros((1, self.config.max_seq_len), np.int32)
        padded[0, :len(prompt)] = prompt
        args = put_replicated((np.int32(slot), _device_sampling([sampling]), padded, np.array([len(prompt)], np.int32)),
                              self.model.mesh)
        self._state = programs.admit_slot(self._state, *args, mesh=self.model.mesh)

    def _read(self, step: _InFlight) -> float:
        """Wait for a dispatched step's tokens and hand them out; returns the seconds waited."""
        start = time.perf_counter()
        tokens = [to_host(out) for _, out in step.calls]
        ready = time.perf_counter()
        self._timing.device += ready - max(step.dispatched_at, self._timing.last_ready)
        self._timing.last_ready = ready
        for (lanes, _), sampled in zip(step.calls, tokens):
            self.scheduler.complete(lanes, sampled)
        return ready - start

    def _record(self, elapsed: float, waited: float, counted: bool) -> None:
        if counted:
            t = self._timing
            t.steps += 1
            t.busy += elapsed
            t.host += elapsed - waited
            t.wait += waited

    # ---- warm-up, checks, stats ----------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile every program the loop runs (idle rows and out-of-range slots: nothing changes), so
        that serving never compiles."""
        cfg = self.config
        with self._step_lock:
            self._admit_slot(cfg.max_seqs, [0], Sampling(seed=0))  # slot out of range: dropped
            table = put_replicated(np.zeros((cfg.max_seqs, cfg.table_width), np.int32), self.model.mesh)
            for rows, chunk in ((cfg.prefill_rows, cfg.prefill_chunk), (cfg.max_seqs, 1)):
                to_host(self._serve(lane_rows((), rows, chunk, cfg.max_seqs), table))
            self._pool.warm_up()

    def check(self) -> None:
        """Verify the page allocator against every holder (running requests, the prefix cache);
        raises `PageError` on a leak, a double free or a broken free list."""
        with self._step_lock:
            self.allocator.check(self.scheduler.holders())

    def stats(self) -> EngineStats:
        with self._step_lock:
            cache, t, s = self.prefix_cache.stats(), self._timing, self.scheduler
            per_step = 1000.0 / max(t.steps, 1)
            return EngineStats(
                running=s.running, waiting=s.waiting + len(self._submitted), finished=s.finished,
                pages_used=self.allocator.used_count, pages_free=self.allocator.free_count,
                pages_cached=cache.device_pages, prompt_tokens=s.prompt_tokens, prefix_hit_tokens=cache.hit_tokens,
                offloaded_pages=cache.offloaded, reloaded_pages=cache.reloaded, host_pages=cache.host_pages,
                host_bytes=cache.host_bytes, generated_tokens=s.generated_tokens, steps=t.steps,
                tokens_per_second=s.generated_tokens / t.busy if t.busy else 0.0,
                host_ms_per_step=t.host * per_step, wait_ms_per_step=t.wait * per_step,
                device_ms_per_step=t.device * per_step)


def _device_sampling(settings: Sequence[Sampling]) -> SamplingArrays:
    """Sampling rows for the slot state. Stops are checked on the host, so none go to the device
    (one fixed column: the arrays' shapes never change)."""
    return batch_sampling([dataclasses.replace(s, stop_token_ids=()) for s in settings], stop_width=1)
