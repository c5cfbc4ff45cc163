"""The engine's thread: steps `dsr1.serving.Engine` while it has work, sleeps while it has none,
and tells each request's listener what changed after every step.

The HTTP side never touches the engine's step lock (a step may wait for the device for a while):
it submits through `EngineRunner.submit` (thread-safe, bounded by the queue cap, refused while
draining), gets `Update`s through its listener on the engine thread, and reads engine statistics
from the snapshot the runner refreshes between steps.

Shutdown: `drain()` refuses new requests; `cancel_all()` cancels the ones in flight (they finish
as "abort" at the next step, their pages freed); `stop()` cancels what is left, steps until
the engine is idle and joins the thread.

Health: `stalled(after)` is true when the engine has had work for `after` seconds without
finishing a step (a hung device, a deadlock), which `/health` reports as a failure.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..generation.sampling import Sampling
from ..serving import Engine, EngineStats, Request
from ..serving.request import FINISH_REASONS

__all__ = ["Draining", "EngineFailed", "EngineRunner", "QueueFull", "Update"]

log = logging.getLogger("dsr1.server")

STATS_INTERVAL = 0.2  # seconds between statistics snapshots while stepping
ABORT = "abort" if "abort" in FINISH_REASONS else FINISH_REASONS[-1]  # the finish reason of a cancelled request


@dataclasses.dataclass(frozen=True)
class Update:
    """What changed for one request in one step: the new streamable text (it can still be empty when
    a token completed no character or may begin a stop string), its output token count so far, and
    whether it is done (then `request.finish_reason` says why). `at`: when the step's tokens arrived
    (`time.perf_counter()`)."""

    request: Request
    text: str
    tokens: int
    done: bool
    at: float
    scheduled: bool = False  # the request was admitted to the batch in this step (for its queue time)


Listener = Callable[[Update], None]  # called on the engine thread: must be quick and must not block


class QueueFull(Exception):
    """More requests are in flight than the server admits; try again later."""


class Draining(Exception):
    """The server is shutting down and admits no new requests."""


class EngineFailed(Exception):
    """The engine raised during a step; the server cannot serve any more."""


@dataclasses.dataclass(eq=False)
class _Tracked:
    """A request in flight and its listener; `pieces` collects the engine's `on_text` pieces (on the
    engine thread) until the step's update hands them out."""

    listener: Listener
    request: Request | None = None
    pieces: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    scheduled: bool = False


class EngineRunner:
    """Own `engine`'s loop on a background thread; see the module docstring.

    `capacity`: requests in flight (running and waiting) at most; `submit` raises `QueueFull` beyond.
    """

    def __init__(self, engine: Engine, *, capacity: int):
        self.engine = engine
        self.capacity = capacity
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._tracked: list[_Tracked] = []
        self._reserved = 0  # admitted by `submit`, not yet tracked
        self._draining = False
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._stats_at = 0.0
        self._progress_at = time.monotonic()  # the last finished step, or when work arrived at an idle engine
        self._submit_options = set(inspect.signature(engine.submit).parameters)
        self._thread = threading.Thread(target=self._loop, name="dsr1-engine", daemon=True)

    # ---- the HTTP side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (running or waiting)."""
        with self._lock:
            return len(self._tracked)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine, if any."""
        return self._error

    @property
    def stats(self) -> EngineStats:
        """The engine's statistics as of the latest snapshot (at most `STATS_INTERVAL` old while busy)."""
        return self._stats

    def stalled(self, after: float) -> bool:
        """The engine has work and has finished no step for `after` seconds."""
        return self.engine.has_work and time.monotonic() - self._progress_at > after

    def supports(self, option: str) -> bool:
        """Whether the engine's `submit` takes `option` (e.g. "grammar", "prompt_logprobs")."""
        return option in self._submit_options

    def submit(self, prompts: Sequence[list[int]], samplings: Sequence[Sampling], listener: Listener, *,
               logprobs: int | None = None, grammars: Sequence[str | None] | None = None,
               prompt_logprobs: int | None = None) -> list[Request]:
        """Submit one request per (prompt, sampling), all or none, each recording `logprobs` alternatives
        per token if not None, constrained by its grammar (`grammars`, llguidance's; None: free) and
        recording `prompt_logprobs` alternatives per prompt token if not None; `listener` receives
        their updates. Raises `Draining`, `EngineFailed`, `QueueFull`, or the engine's ValueError for a
        request that can never run."""
        grammars = list(grammars) if grammars is not None else [None] * len(prompts)
        with self._lock:
            if self._error is not None:
                raise EngineFailed(f"the engine stopped: {self._error!r}")
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self._tracked) + self._reserved + len(prompts) > self.capacity:
                raise QueueFull(f"{len(self._tracked)} requests in flight; the server admits {self.capacity}")
            if not self.engine.has_work:
                self._progress_at = time.monotonic()  # an idle engine's stall clock starts now
            self._reserved += len(prompts)
        # The engine compiles each grammar's matcher as it takes the request: outside the lock, so the
        # engine's thread (publishing a step) and other submissions do not wait on it.
        tracked: list[_Tracked] = []
        try:
            for prompt, sampling, grammar in zip(prompts, samplings, grammars, strict=True):
                options: dict[str, Any] = {"grammar": grammar} if grammar is not None else {}
                if prompt_logprobs is not None:
                    options["prompt_logprobs"] = prompt_logprobs
                one = _Tracked(listener)
                one.request = self.engine.submit(prompt, sampling=sampling, on_text=one.pieces.append,
                                                 logprobs=logprobs, **options)
                tracked.append(one)
        except BaseException:
            for t in tracked:
                t.request.cancel()  # the engine drops them at its next step
            with self._lock:
                self._reserved -= len(prompts)
            raise
        with self._lock:
            self._reserved -= len(prompts)
            self._tracked += tracked
            stopping = self._stopping
        for t in tracked if stopping else ():
            t.request.cancel()  # `stop` came while they were being submitted
        self._wake.set()
        return [t.request for t in tracked]

    def drain(self) -> None:
        """Admit no more requests (`submit` raises `Draining`); those in flight go on."""
        with self._lock:
            self._draining = True

    def cancel_all(self) -> int:
        """Cancel every request in flight; returns how many."""
        with self._lock:
            requests = [t.request for t in self._tracked if t.request is not None and not t.request.done]
        for request in requests:
            request.cancel()
        self._wake.set()
        return len(requests)

    def stop(self, timeout: float = 30.0) -> None:
        """Drain, cancel what is in flight, let the engine finish its step and join the thread."""
        self.drain()
        self.cancel_all()
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine's thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.clear()
            if self._error is None and self.engine.has_work:
                self._step()
                continue
            self._publish(time.perf_counter())  # a request can finish before `submit` tracks it
            self._refresh_stats(force=True)
            if self._stopping:
                return
            self._wake.wait(timeout=1.0)

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as e:  # anything the engine raises ends serving; say so to everyone
            log.exception("the engine failed; no more requests will be served")
            self._error = e
            self._fail_all()
            return
        self._progress_at = time.monotonic()
        self._publish(time.perf_counter())
        self._refresh_stats(force=False)

    def _publish(self, now: float) -> None:
        """Give every request that changed in the step its update; forget the finished ones."""
        with self._lock:
            tracked = list(self._tracked)
        finished = []
        for t in tracked:
            request = t.request
            done, tokens = request.done, len(request.tokens)
            scheduled = not t.scheduled and request.scheduled_at is not None
            if not (t.pieces or tokens != t.tokens or done or scheduled):
                continue
            text = "".join(t.pieces)
            t.pieces.clear()
            t.tokens, t.scheduled = tokens, t.scheduled or scheduled
            self._notify(t, Update(request, text, tokens, done, now, scheduled))
            if done:
                finished.append(t)
        if finished:
            with self._lock:
                self._tracked = [t for t in self._tracked if t not in finished]

    def _fail_all(self) -> None:
        """The engine is broken: finish every request in flight as aborted and tell its listener."""
        with self._lock:
            tracked, self._tracked = self._tracked, []
        for t in tracked:
            t.request.finish(ABORT)
            self._notify(t, Update(t.request, "".join(t.pieces), len(t.request.tokens), True, time.perf_counter()))

    @staticmethod
    def _notify(tracked: _Tracked, update: Update) -> None:
        try:
            tracked.listener(update)
        except Exception:  # one broken listener must not stop the engine for everyone
            log.exception("a request listener failed")

    def _refresh_stats(self, force: bool) -> None:
        now = time.perf_counter()
        if force or now - self._stats_at >= STATS_INTERVAL:
            self._stats, self._stats_at = self.engine.stats(), now
