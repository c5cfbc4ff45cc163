"""`POST /v1/chat/completions` and `POST /v1/completions`: parse and check the request
(`protocol`, `prepare`), submit one engine request per choice through the runner, then answer
with the whole result or stream it as server-sent events ending with `data: [DONE]`.

Log-probabilities, when asked for, are the engine's (`Request.logprobs`) in OpenAI's forms
(`logprobs`), whole or a step's new tokens per chunk.

Updates come from the engine's thread (`runner.Update`, once per step per changed request) and
are handed to the event loop through an asyncio queue, so no coroutine ever waits on the engine.

A client that goes away cancels its requests at once: for a stream, Starlette cancels the response
when the client disconnects and the generator's `finally` cancels the engine requests; a
non-streamed request polls for the disconnect while it waits. Either way the engine drops them at
its next step, freeing their slots and pages.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..generation.tokenizer import Tokenizer
from ..serving import Request
from .errors import APIError
from .logprobs import LogprobCursor, chat_logprobs, completion_logprobs
from .metrics import Metrics, RequestClock
from .prepare import Limits, Plan, plan_chat, plan_completion
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    TextChoice,
    TextCompletion,
    Usage,
    parse_request,
)
from .reasoning import ReasoningSplitter, split_reply
from .runner import Draining, EngineFailed, EngineRunner, QueueFull, Update

__all__ = ["CompletionService", "Submission"]

DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there
MAX_BODY_BYTES = 64 << 20  # a request body beyond this is refused (413) before it is parsed
RETRY_AFTER = "1"  # seconds, for a full queue or a draining server


class Submission:
    """One HTTP request's engine requests (one per choice) and their updates, delivered to the event
    loop. `listener` runs on the engine thread: it records metrics and queues the update."""

    def __init__(self, endpoint: str, metrics: Metrics, loop: asyncio.AbstractEventLoop):
        self.endpoint = endpoint
        self.requests: list[Request] = []
        self._metrics = metrics
        self._loop = loop
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._clocks: dict[int, RequestClock] = {}  # engine thread only

    def listener(self, update: Update) -> None:
        """(Engine thread) Record the update's metrics and pass it to the event loop."""
        self._metrics.observe(self.endpoint, update, self._clocks.setdefault(update.request.id, RequestClock()))
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, update)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone and nobody waits for this update

    def index(self, request: Request) -> int:
        """The choice index of one of this submission's requests."""
        return next(i for i, r in enumerate(self.requests) if r is request)

    async def updates(self, disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Update]:
        """Yield updates until every request is done. With `disconnected`, ask it every
        `DISCONNECT_POLL` seconds whether the client left, and cancel the requests once it did."""
        pending = {r.id for r in self.requests}  # each one's last update says done
        get: asyncio.Future[Update] | None = None
        checked = time.monotonic()
        try:
            while pending:
                if disconnected is not None and time.monotonic() - checked >= DISCONNECT_POLL:
                    checked = time.monotonic()
                    if await disconnected():
                        self.cancel()
                # One get() in flight across polls: cancelling a get that just completed could drop an update.
                get = get or asyncio.ensure_future(self._queue.get())
                done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL if disconnected else None)
                if not done:
                    continue
                update, get = get.result(), None
                if update.done:
                    pending.discard(update.request.id)
                yield update
        finally:
            if get is not None:
                get.cancel()

    async def wait(self, disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Wait until every request is done (cancelling them if the client disconnects)."""
        async for _ in self.updates(disconnected):
            pass

    def cancel(self) -> None:
        """Cancel the requests that are not done (the engine frees them at its next step)."""
        for request in self.requests:
            if not request.done:
                request.cancel()


class CompletionService:
    """The two completion endpoints over one runner; see the module docstring."""

    def __init__(self, runner: EngineRunner, tokenizer: Tokenizer, limits: Limits, metrics: Metrics):
        self.runner = runner
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics

    async def chat(self, http: HTTPRequest) -> Response:
        """Answer `POST /v1/chat/completions`."""
        body = self._parse(await http.body(), ChatCompletionRequest)
        plan = self._checked(lambda: plan_chat(body, self.tokenizer, self.limits))
        submission = self._submit("chat", plan)
        reply = _Reply("chatcmpl", self.limits.model_name)
        if plan.stream:
            return _event_stream(self._chat_events(submission, plan, reply))
        await submission.wait(http.is_disconnected)
        return JSONResponse(self._chat_result(submission, plan, reply).model_dump())

    async def complete(self, http: HTTPRequest) -> Response:
        """Answer `POST /v1/completions`."""
        body = self._parse(await http.body(), CompletionRequest)
        plan = self._checked(lambda: plan_completion(body, self.tokenizer, self.limits))
        submission = self._submit("completions", plan)
        reply = _Reply("cmpl", self.limits.model_name)
        if plan.stream:
            return _event_stream(self._text_events(submission, plan, reply))
        await submission.wait(http.is_disconnected)
        return JSONResponse(self._text_result(submission, plan, reply).model_dump())

    # ---- admission -----------------------------------------------------------------------------
    def _parse(self, body: bytes, model: type[Any]) -> Any:
        if len(body) > MAX_BODY_BYTES:
            self.metrics.rejected.labels("invalid").inc()
            raise APIError(413, f"the request body has {len(body)} bytes, more than the {MAX_BODY_BYTES} accepted",
                           code="request_too_large")
        return self._checked(lambda: parse_request(body, model))

    def _checked(self, check: Callable[[], Any]) -> Any:
        """Run a check, counting the request as rejected ("invalid") when it fails."""
        try:
            return check()
        except APIError:
            self.metrics.rejected.labels("invalid").inc()
            raise

    def _submit(self, endpoint: str, plan: Plan) -> Submission:
        """Submit every choice of `plan` (all or none), or raise the fitting `APIError`."""
        submission = Submission(endpoint, self.metrics, asyncio.get_running_loop())
        try:
            submission.requests = self.runner.submit(plan.choice_prompts(), plan.samplings, submission.listener,
                                                     logprobs=plan.top_logprobs)
        except QueueFull as e:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"the server is busy ({e}); retry later", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER}) from None
        except Draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down and accepts no new requests", code="shutting_down",
                           headers={"Retry-After": RETRY_AFTER}) from None
        except EngineFailed as e:
            self.metrics.rejected.labels("engine_failed").inc()
            raise APIError(503, str(e), code="engine_failed") from None
        except ValueError as e:  # the engine's own checks (e.g. more pages than its pool holds)
            self.metrics.rejected.labels("invalid").inc()
            raise APIError(400, str(e), code="invalid_request") from None
        self.metrics.accepted.labels(endpoint).inc()
        self.metrics.prompt_tokens.labels(endpoint).inc(sum(len(p) for p in plan.prompts))
        return submission

    # ---- whole results -------------------------------------------------------------------------
    def _chat_result(self, submission: Submission, plan: Plan, reply: _Reply) -> ChatCompletion:
        choices = []
        for i, request in enumerate(submission.requests):
            reasoning, content = split_reply(request.text, request.thinking)
            message = AssistantMessage(content=content,
                                       reasoning_content=reasoning if request.thinking or reasoning else None)
            logprobs = None if request.logprobs is None else chat_logprobs(self.tokenizer, request.logprobs)
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=request.finish_reason))
        return ChatCompletion(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                              usage=_usage(submission, plan))

    def _text_result(self, submission: Submission, plan: Plan, reply: _Reply) -> TextCompletion:
        choices = [TextChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                              logprobs=None if r.logprobs is None else completion_logprobs(self.tokenizer, r.logprobs))
                   for i, r in enumerate(submission.requests)]
        return TextCompletion(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                              usage=_usage(submission, plan))

    # ---- streams -------------------------------------------------------------------------------
    async def _chat_events(self, submission: Submission, plan: Plan, reply: _Reply) -> AsyncIterator[str]:
        """The chat stream: a role chunk per choice, reasoning and content deltas as they come (the
        new tokens' log-probabilities on the step's last delta, if asked for), a finish chunk per
        choice, the usage chunk when asked for, then [DONE]."""
        try:
            for i in range(len(submission.requests)):
                yield reply.chat_chunk(plan, i, {"role": "assistant", "content": ""})
            splitters = [ReasoningSplitter(r.thinking) for r in submission.requests]
            cursors = [LogprobCursor(self.tokenizer, chat=True) for _ in submission.requests]
            async for update in submission.updates():
                i = submission.index(update.request)
                reasoning, content = splitters[i].push(update.text)
                if update.done:
                    rest = splitters[i].finish()
                    reasoning, content = reasoning + rest[0], content + rest[1]
                logprobs = cursors[i].take(update.request, update.tokens)
                deltas = [{"reasoning_content": reasoning}] if reasoning else []
                if content or (logprobs and not deltas):  # tokens whose text is held back still send theirs
                    deltas.append({"content": content})
                for k, delta in enumerate(deltas):
                    yield reply.chat_chunk(plan, i, delta, logprobs=logprobs if k == len(deltas) - 1 else None)
                if update.done:
                    yield reply.chat_chunk(plan, i, {}, update.request.finish_reason)
            if plan.include_usage:
                yield reply.usage_chunk("chat.completion.chunk", _usage(submission, plan))
            yield _sse("[DONE]")
        finally:
            submission.cancel()  # the client went away (or the stream failed): free its requests now

    async def _text_events(self, submission: Submission, plan: Plan, reply: _Reply) -> AsyncIterator[str]:
        """The completions stream: text deltas (with the new tokens' log-probabilities, if asked for), a
        finish chunk per choice, usage when asked for, [DONE]."""
        try:
            cursors = [LogprobCursor(self.tokenizer, chat=False) for _ in submission.requests]
            async for update in submission.updates():
                i = submission.index(update.request)
                logprobs = cursors[i].take(update.request, update.tokens)
                if update.text or logprobs:
                    yield reply.text_chunk(plan, i, update.text, logprobs=logprobs)
                if update.done:
                    yield reply.text_chunk(plan, i, "", update.request.finish_reason)
            if plan.include_usage:
                yield reply.usage_chunk("text_completion", _usage(submission, plan))
            yield _sse("[DONE]")
        finally:
            submission.cancel()


class _Reply:
    """The id, creation time and model name every chunk of one response repeats."""

    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, kind: str, plan: Plan, choices: list[dict[str, Any]]) -> str:
        chunk: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                 "choices": choices}
        if plan.include_usage:
            chunk["usage"] = None  # OpenAI's stream: null on every chunk but the last
        return _sse(json.dumps(chunk, ensure_ascii=False))

    def chat_chunk(self, plan: Plan, index: int, delta: dict[str, str], finish_reason: str | None = None, *,
                   logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk("chat.completion.chunk", plan, [choice])

    def text_chunk(self, plan: Plan, index: int, text: str, finish_reason: str | None = None, *,
                   logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk("text_completion", plan, [choice])

    def usage_chunk(self, kind: str, usage: Usage) -> str:
        return _sse(json.dumps({"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                "choices": [], "usage": usage.model_dump()}))


def _usage(submission: Submission, plan: Plan) -> Usage:
    """Token counts: each prompt once (however many choices share it), every choice's output
    tokens (a stop token excluded), and the prompt tokens the prefix cache served."""
    firsts = submission.requests[::plan.n]
    return Usage.of(prompt_tokens=sum(len(p) for p in plan.prompts),
                    completion_tokens=sum(len(r.tokens) for r in submission.requests),
                    cached_tokens=sum(r.cached_tokens for r in firsts))


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # No caching or proxy buffering: every event should reach the client as soon as it is written.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
