"""A submitted request as its submitter sees it: the output so far, how it ended, cancellation and
streaming. Thread-safe: the engine's loop adds tokens from its thread while any other thread reads
`tokens` and `text`, iterates `stream()` or calls `cancel()`.

Stop tokens, stop strings, detokenization and the streaming hold-back (text that could still turn
out to begin a stop string is not streamed yet) are `dsr1.generation.output.RowOutput`'s, the
same as `dsr1.generate`'s: every piece streamed joins to the final `text`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

from ..generation.output import Completion, RowOutput, TokenLogprob
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer
from .grammar import Grammar

__all__ = ["FINISH_REASONS", "Request", "TextCallback"]

FINISH_REASONS = ("stop", "length", "abort")  # stop token, string or completed grammar; token budget; cancel()
TextCallback = Callable[[str], None]  # receives each new piece of streamable text, on the engine's thread


class Request:
    """One prompt submitted to a `dsr1.serving.Engine`, and its output as it is generated.

    Read `tokens`, `text`, `done`, `finish_reason` at any time; `wait()` blocks until done;
    `stream()` (or iterating the request) yields new text as it comes; `on_text` (given to
    `Engine.submit`) is called with the same pieces on the engine's thread. `cancel()` stops it:
    it leaves the batch (its pages freed) at the engine's next step, finishing as "abort".
    """

    def __init__(self, request_id: int, prompt: Sequence[int], sampling: Sampling, tokenizer: Tokenizer | None, *,
                 thinking: bool = False, on_text: TextCallback | None = None, top_logprobs: int | None = None,
                 prompt_top_logprobs: int | None = None, matcher: Grammar | None = None):
        self.id = request_id
        self.prompt = list(prompt)
        self.sampling = sampling  # with its seed resolved and the EOS among its stop tokens
        self.top_logprobs = top_logprobs  # None: no log-probabilities; else alternatives per token (0..20)
        self.prompt_top_logprobs = prompt_top_logprobs  # the same for the prompt's tokens
        self.matcher = matcher  # the grammar the output follows (None: free)
        self._prompt_logprobs: list[TokenLogprob | None] = [None]  # the first prompt token has none
        self.thinking = thinking  # the prompt opened R1's <think> block
        self.submitted_at = time.perf_counter()
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (set at admission)
        self.scheduled_at: float | None = None  # when the scheduler admitted it to the batch (perf_counter)
        self.drafted_tokens = 0  # with MTP drafts: drafts verified for this request
        self.accepted_drafts = 0  # ... and accepted (each an output token that cost no step of its own)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._output = RowOutput(tokenizer, sampling)
        self._logprobs: list[TokenLogprob] = []
        self.stop_logprob: TokenLogprob | None = None  # the stop token that ended the output (not in `tokens`)
        self._on_text = on_text
        self._changed = threading.Condition()
        self._streamed = ""  # every piece handed out so far, joined
        self._finish_reason: str | None = None
        self._cancel = threading.Event()

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt={len(self.prompt)} tokens, generated={len(self.tokens)}, "
                f"finish_reason={self.finish_reason!r})")

    # ---- the submitter's side ------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """Output token ids so far (a stop token is not included)."""
        with self._changed:
            return list(self._output.tokens)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One `TokenLogprob` per output token so far (aligned with `tokens`), or None when the request
        did not ask for log-probabilities (`Engine.submit(..., logprobs=...)`)."""
        if self.top_logprobs is None:
            return None
        with self._changed:
            return list(self._logprobs)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """One entry per prompt token (None for the first), each the token's log-probability given the
        tokens before it and the `prompt_logprobs` most likely tokens there; None when not asked for
        (`Engine.submit(..., prompt_logprobs=...)`). Complete once the first output token arrived."""
        if self.prompt_top_logprobs is None:
            return None
        with self._changed:
            return list(self._prompt_logprobs)

    def logprobs_between(self, start: int, stop: int) -> list[TokenLogprob]:
        """`logprobs[start:stop]` without copying the rest (a stream takes each step's new entries)."""
        with self._changed:
            return self._logprobs[start:stop]

    @property
    def text(self) -> str:
        """Output text so far (empty without a tokenizer); once done, it ends before any stop string."""
        with self._changed:
            return self._output.text

    @property
    def done(self) -> bool:
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> str | None:
        """None while running, else one of `FINISH_REASONS`."""
        return self._finish_reason

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from submission until the first output token reached the host (None before)."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    def cancel(self) -> None:
        """Ask the engine to stop this request at its next step (no effect once done)."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is done (someone must be running the engine); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.done, timeout)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yield the output text piece by piece as it is generated, from the beginning, until done.
        Several iterators may run at once, each seeing every piece. `timeout`: seconds to wait for
        each next piece before raising TimeoutError (None: forever)."""
        seen = 0
        while True:
            with self._changed:
                if not self._changed.wait_for(lambda: len(self._streamed) > seen or self.done, timeout):
                    raise TimeoutError(f"request {self.id}: no new text within {timeout} s")
                piece, finished = self._streamed[seen:], self.done
            seen += len(piece)
            if piece:
                yield piece
            elif finished:
                return

    __iter__ = stream

    def completion(self) -> Completion:
        """The finished output, R1's reasoning separated from the answer. Raises if not done."""
        with self._changed:
            if not self.done:
                raise RuntimeError(f"request {self.id} is still running")
            return self._output.completion(self._finish_reason, len(self.prompt), self.thinking)

    # ---- the engine's side ---------------------------------------------------------------------
    def add_tokens(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> bool:
        """(Engine) Sampled tokens arrived, in order, with their log-probabilities if the request asked
        for them. Returns True when a stop token or stop string ended the output (the engine then
        finishes the request as "stop")."""
        with self._changed:
            if self.first_token_at is None and tokens:
                self.first_token_at = time.perf_counter()
            before, stopped_before = len(self._output.tokens), self._output.stopped
            self._output.add(tokens)
            if logprobs is not None:  # the tokens kept (not a stop token, nothing after a stop)
                kept = len(self._output.tokens) - before
                self._logprobs += logprobs[:kept]
                if self._output.stopped_by_token and not stopped_before and kept < len(logprobs):
                    self.stop_logprob = logprobs[kept]  # scorers (echo) read the whole sequence's values
            piece = self._publish(final=False)
            stopped = self._output.stopped
        self._notify(piece)
        return stopped

    def add_prompt_logprobs(self, logprobs: Sequence[TokenLogprob]) -> None:
        """(Engine) The next prompt tokens' log-probabilities, in order, as prefill computed them."""
        with self._changed:
            self._prompt_logprobs += logprobs

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """(Engine) One draft-verify iteration verified `drafted` MTP drafts and kept `accepted` of them."""
        self.drafted_tokens += drafted
        self.accepted_drafts += accepted

    @property
    def draft_acceptance(self) -> float | None:
        """The share of this request's drafts accepted (None before any was verified, or without drafts)."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    def finish(self, reason: str) -> None:
        """(Engine) The request is over: flush held-back text, record `reason`, wake waiters."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} is not one of {FINISH_REASONS}")
        with self._changed:
            if self.done:
                return
            self._output.finish()
            piece = self._publish(final=True)
            self._finish_reason, self.finished_at = reason, time.perf_counter()
            self._changed.notify_all()
        self._notify(piece)

    def _publish(self, final: bool) -> str:
        """Move the newly streamable text to the stream (under the lock) and wake iterators."""
        piece = self._output.streamable(final)
        if piece:
            self._streamed += piece
            self._changed.notify_all()
        return piece

    def _notify(self, piece: str) -> None:
        """The callback runs outside the lock, so it may read the request freely."""
        if piece and self._on_text is not None:
            self._on_text(piece)
