"""`POST /v1/chat/completions` and `POST /v1/completions`: parse and check the request
(`protocol`, `prepare`), submit one engine request per choice through the runner, then answer
with the whole result or stream it as server-sent events ending with `data: [DONE]`.

Log-probabilities, when asked for, are the engine's (`Request.logprobs`) in OpenAI's forms
(`logprobs`), whole or a step's new tokens per chunk; the prompt's (`echo` with `logprobs`, vLLM's
`prompt_logprobs`) are `Request.prompt_logprobs`, computed during prefill. A completions choice
ended by a stop token (EOS, `stop_token_ids`) lists that token's entry last, as vLLM's does. A chat reply that calls
tools has them parsed out of its text (`tools`) as `tool_calls`, with finish reason "tool_calls".

The body is read as it streams in and refused (413) once it passes `MAX_BODY_BYTES`; a prompt that
cannot fit the context is refused by its size before tokenization (`prepare.check_size`), and the
tokenization runs on a worker thread, so the event loop (other streams, `/health`) never waits on it.

Updates come from the engine's thread (`runner.Update`, once per step per changed request) and
are handed to the event loop through an asyncio queue, so no coroutine ever waits on the engine.

A client that goes away cancels its requests at once: for a stream, Starlette cancels the response
when the client disconnects and the generator's `finally` cancels the engine requests; a
non-streamed request polls for the disconnect while it waits. Either way the engine drops them at
its next step, freeing their slots and pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..generation.output import TokenLogprob
from ..generation.tokenizer import Tokenizer
from ..serving import Request
from .errors import APIError
from .logprobs import (
    LogprobCursor,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_entries,
    vllm_prompt_logprobs,
)
from .metrics import Metrics, RequestClock
from .prepare import Limits, Plan, check_size, plan_chat, plan_completion
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    TextChoice,
    TextCompletion,
    ToolCall,
    Usage,
    parse_request,
)
from .reasoning import ReasoningSplitter, split_reply
from .runner import ABORT, Draining, EngineFailed, EngineRunner, QueueFull, Update
from .tools import ToolCallSplitter, split_tool_calls

__all__ = ["CompletionService", "Submission", "finish_reason", "read_body"]

DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there
MAX_BODY_BYTES = 64 << 20  # a request body beyond this is refused (413) before it is parsed
RETRY_AFTER = "1"  # seconds, for a full queue or a draining server


def finish_reason(request: Request) -> str | None:
    """The request's finish reason as OpenAI spells it ("stop", "length", "abort")."""
    reason = request.finish_reason
    return "abort" if reason == ABORT else reason


async def read_body(http: HTTPRequest, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, read as it arrives; 413 as soon as it (or its Content-Length) passes `limit`."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes, more than the {limit} accepted",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body has more than the {limit} bytes accepted", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class Inbox:
    """Updates on their way from the engine's thread to one event loop: the engine thread appends
    them, and wakes the loop once for all it appends until the loop takes them, not once per
    update (many streams would otherwise cost the loop a callback and a wakeup each per step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Update], Update]] = []

    def post(self, queue: asyncio.Queue[Update], update: Update) -> None:
        """(Engine thread) Queue `update` for `queue`'s consumer on the loop."""
        with self._lock:
            self._items.append((queue, update))
            if len(self._items) > 1:
                return  # the loop is woken already and takes this one too
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone and nobody waits for this update

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, update in items:
            queue.put_nowait(update)


def merged(updates: list[Update]) -> list[Update]:
    """The updates one consumer has waiting, one per request (its pieces joined, its latest counts):
    a stream that falls behind the engine sends fewer, larger chunks instead of falling further."""
    by_request: dict[int, Update] = {}
    for update in updates:
        first = by_request.get(update.request.id)
        by_request[update.request.id] = update if first is None else dataclasses.replace(
            update, text=first.text + update.text, scheduled=first.scheduled or update.scheduled)
    return list(by_request.values())


class Submission:
    """One HTTP request's engine requests (one per choice) and their updates, delivered to the event
    loop through its `Inbox`. `listener` runs on the engine thread: it records metrics and posts the update."""

    def __init__(self, endpoint: str, metrics: Metrics, inbox: Inbox):
        self.endpoint = endpoint
        self.requests: list[Request] = []
        self._metrics = metrics
        self._inbox = inbox
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._clocks: dict[int, RequestClock] = {}  # engine thread only

    def listener(self, update: Update) -> None:
        """(Engine thread) Record the update's metrics and pass it to the event loop."""
        self._metrics.observe(self.endpoint, update, self._clocks.setdefault(update.request.id, RequestClock()))
        self._inbox.post(self._queue, update)

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
                waiting, get = [get.result()], None
                while not self._queue.empty():
                    waiting.append(self._queue.get_nowait())
                for update in merged(waiting):
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
        self._inbox: Inbox | None = None  # made on the event loop, by the first submission

    async def chat(self, http: HTTPRequest) -> Response:
        """Answer `POST /v1/chat/completions`."""
        body = await self._parse(http, ChatCompletionRequest)
        plan = await self._plan(plan_chat, body)
        submission = await self._submit("chat", plan)
        reply = _Reply("chatcmpl", self.limits.model_name)
        if plan.stream:
            return _event_stream(self._chat_events(submission, plan, reply))
        await submission.wait(http.is_disconnected)
        return JSONResponse(self._chat_result(submission, plan, reply).model_dump())

    async def complete(self, http: HTTPRequest) -> Response:
        """Answer `POST /v1/completions`."""
        body = await self._parse(http, CompletionRequest)
        plan = await self._plan(plan_completion, body)
        submission = await self._submit("completions", plan)
        reply = _Reply("cmpl", self.limits.model_name)
        if plan.stream:
            return _event_stream(self._text_events(submission, plan, reply))
        await submission.wait(http.is_disconnected)
        return JSONResponse(self._text_result(submission, plan, reply).model_dump())

    # ---- admission -----------------------------------------------------------------------------
    async def _parse(self, http: HTTPRequest, model: type[Any]) -> Any:
        try:
            body = await read_body(http)
        except APIError:
            self.metrics.rejected.labels("invalid").inc()
            raise
        # Parsing megabytes of JSON takes long enough to stall every stream: a worker thread does it.
        try:
            return await run_in_threadpool(parse_request, body, model)
        except APIError:
            self.metrics.rejected.labels("invalid").inc()
            raise

    async def _plan(self, plan: Callable[..., Plan], body: Any) -> Plan:
        """On a worker thread: check the request's size (before tokenizing), then tokenize and check it."""

        def sized_plan() -> Plan:
            check_size(body, self.limits)
            return plan(body, self.tokenizer, self.limits)

        try:
            return await run_in_threadpool(sized_plan)
        except APIError:
            self.metrics.rejected.labels("invalid").inc()
            raise

    def _checked(self, check: Callable[[], Any]) -> Any:
        """Run a check, counting the request as rejected ("invalid") when it fails."""
        try:
            return check()
        except APIError:
            self.metrics.rejected.labels("invalid").inc()
            raise

    async def _submit(self, endpoint: str, plan: Plan) -> Submission:
        """Submit every choice of `plan` (all or none), or raise the fitting `APIError`. On a worker
        thread: the engine compiles each grammar's matcher as it takes the request."""
        self._check_capacity(plan)
        loop = asyncio.get_running_loop()
        if self._inbox is None or self._inbox.loop is not loop:
            self._inbox = Inbox(loop)
        submission = Submission(endpoint, self.metrics, self._inbox)
        try:
            submission.requests = await run_in_threadpool(
                self.runner.submit, plan.choice_prompts(), plan.samplings, submission.listener,
                logprobs=plan.top_logprobs, grammars=plan.choice_grammars(), prompt_logprobs=plan.prompt_logprobs)
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

    def _check_capacity(self, plan: Plan) -> None:
        """400 (not 429) for what could never run: more choices than the server admits at once, or a
        feature this engine lacks."""
        if len(plan.samplings) > self.runner.capacity:
            self.metrics.rejected.labels("invalid").inc()
            raise APIError(400, f"the request has {len(plan.samplings)} choices ({len(plan.prompts)} prompts x n="
                                f"{plan.n}); this server admits at most {self.runner.capacity} at once",
                           param="n", code="invalid_value")
        for option, param, wanted in (("grammar", "response_format", any(plan.grammars)),
                                      ("prompt_logprobs", "prompt_logprobs", plan.prompt_logprobs is not None)):
            if wanted and not self.runner.supports(option):
                self.metrics.rejected.labels("invalid").inc()
                raise APIError(400, f"{param}: this engine cannot constrain or score prompts ({option})",
                               param=param, code="unsupported_parameter")

    # ---- whole results -------------------------------------------------------------------------
    def _chat_result(self, submission: Submission, plan: Plan, reply: _Reply) -> ChatCompletion:
        choices = []
        for i, request in enumerate(submission.requests):
            reasoning, content = split_reply(request.text, request.thinking)
            calls, finish = [], finish_reason(request)
            if plan.calls_tools and (parsed := split_tool_calls(content, plan.tool_format)) is not None:
                content, found = parsed
                calls = [ToolCall(id=c.id, function={"name": c.name, "arguments": c.arguments}) for c in found]
                finish = "tool_calls" if finish == "stop" and calls else finish
            message = AssistantMessage(content=content if content or not calls else None, tool_calls=calls,
                                       reasoning_content=reasoning if request.thinking or reasoning else None)
            logprobs = None if request.logprobs is None else chat_logprobs(self.tokenizer, request.logprobs)
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish))
        return ChatCompletion(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                              usage=_usage(submission, plan),
                              prompt_logprobs=self._prompt_logprobs(plan, submission.requests[0]))

    def _text_result(self, submission: Submission, plan: Plan, reply: _Reply) -> TextCompletion:
        choices = []
        for i, request in enumerate(submission.requests):
            prefix, prompt_entries = self._echo(plan, i, request)
            text = prefix + ("" if plan.discard_output else request.text)
            logprobs = None
            if request.logprobs is not None:
                output = [] if plan.discard_output else request.logprobs + _stop_entry(request)
                logprobs = completion_logprobs(self.tokenizer, prompt_entries + output)
            choices.append(TextChoice(index=i, text=text, finish_reason="length" if plan.discard_output
                                      else finish_reason(request), logprobs=logprobs,
                                      prompt_logprobs=self._prompt_logprobs(plan, request)))
        return TextCompletion(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                              usage=_usage(submission, plan))

    def _echo(self, plan: Plan, i: int, request: Request) -> tuple[str, list[Any]]:
        """The prompt text choice `i` repeats (`echo`) and its prompt tokens' log-probability entries
        (with `logprobs`; the first token's is None)."""
        if plan.echo is None:
            return "", []
        entries = []
        if request.top_logprobs is not None and plan.prompt_logprobs is not None:
            entries = prompt_logprobs_entries(request.prompt, request.prompt_logprobs)
        return plan.echo[i // plan.n], entries

    def _prompt_logprobs(self, plan: Plan, request: Request) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of a choice (None when not asked for)."""
        if not plan.report_prompt_logprobs:
            return None
        return vllm_prompt_logprobs(self.tokenizer, request.prompt_logprobs)

    # ---- streams -------------------------------------------------------------------------------
    async def _chat_events(self, submission: Submission, plan: Plan, reply: _Reply) -> AsyncIterator[str]:
        """The chat stream: a role chunk per choice, reasoning, content and tool-call deltas as they come
        (the new tokens' log-probabilities on the step's last delta, if asked for), a finish chunk per
        choice, the usage chunk when asked for, then [DONE]."""
        try:
            for i in range(len(submission.requests)):
                yield reply.chat_chunk(plan, i, {"role": "assistant", "content": ""})
            splitters = [ReasoningSplitter(r.thinking) for r in submission.requests]
            callers = [ToolCallSplitter(plan.tool_format) if plan.calls_tools else None for _ in submission.requests]
            cursors = [LogprobCursor(self.tokenizer, chat=True) for _ in submission.requests]
            async for update in submission.updates():
                i = submission.index(update.request)
                reasoning, content = splitters[i].push(update.text)
                if update.done:
                    rest = splitters[i].finish()
                    reasoning, content = reasoning + rest[0], content + rest[1]
                calls: list[dict[str, Any]] = []
                if callers[i] is not None:
                    content, calls = callers[i].push(content, final=update.done)
                logprobs = cursors[i].take(update.request, update.tokens)
                deltas: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
                if content or (logprobs and not deltas and not calls):  # tokens whose text is held back send theirs
                    deltas.append({"content": content})
                deltas += [{"tool_calls": [call]} for call in calls]
                chunks = [reply.chat_chunk(plan, i, delta, logprobs=logprobs if k == len(deltas) - 1 else None)
                          for k, delta in enumerate(deltas)]
                if update.done:
                    finish = finish_reason(update.request)
                    if callers[i] is not None and callers[i].calls and finish == "stop":
                        finish = "tool_calls"
                    chunks.append(reply.chat_chunk(plan, i, {}, finish))
                if chunks:
                    yield "".join(chunks)  # one write per update, however many chunks it made
            if plan.include_usage:
                yield reply.usage_chunk("chat.completion.chunk", _usage(submission, plan))
            yield _sse("[DONE]")
        finally:
            submission.cancel()  # the client went away (or the stream failed): free its requests now

    async def _text_events(self, submission: Submission, plan: Plan, reply: _Reply) -> AsyncIterator[str]:
        """The completions stream: with `echo`, each choice's prompt first; text deltas (with the new
        tokens' log-probabilities, if asked for), a finish chunk per choice, usage when asked for, [DONE]."""
        try:
            cursors = [LogprobCursor(self.tokenizer, chat=False) for _ in submission.requests]
            echoed = [plan.echo is None for _ in submission.requests]
            async for update in submission.updates():
                i = submission.index(update.request)
                request = update.request
                if not echoed[i] and (update.tokens or update.done):  # the prompt's log-probabilities are in
                    echoed[i] = True
                    prefix, entries = self._echo(plan, i, request)
                    logprobs = completion_logprobs(self.tokenizer, entries) if request.top_logprobs is not None \
                        else None
                    cursors[i].offset = len(prefix)
                    yield reply.text_chunk(plan, i, prefix, logprobs=logprobs)
                if not plan.discard_output:
                    logprobs = cursors[i].take(request, update.tokens)
                    if update.text or logprobs:
                        yield reply.text_chunk(plan, i, update.text, logprobs=logprobs)
                    if update.done and request.top_logprobs is not None and (stop := _stop_entry(request)):
                        yield reply.text_chunk(plan, i, "", logprobs=completion_logprobs(
                            self.tokenizer, stop, cursors[i].offset))
                if update.done:
                    yield reply.text_chunk(plan, i, "", "length" if plan.discard_output else finish_reason(request))
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

    def chat_chunk(self, plan: Plan, index: int, delta: dict[str, Any], finish_reason: str | None = None, *,
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


def _stop_entry(request: Request) -> list[TokenLogprob]:
    """The log-probability entry of the stop token (EOS, `stop_token_ids`) that ended a choice, if
    any: completions' `logprobs` list it after the text's tokens, as vLLM's do, so that a scorer
    reading `token_logprobs[ctxlen:-1]` after `echo` (lm-evaluation-harness) drops that token and
    not the prompt's last one."""
    return [] if request.stop_logprob is None else [request.stop_logprob]


def _usage(submission: Submission, plan: Plan) -> Usage:
    """Token counts: each prompt once (however many choices share it), every choice's output
    tokens (a stop token excluded), and the prompt tokens the prefix cache served."""
    firsts = submission.requests[::plan.n]
    return Usage.of(prompt_tokens=sum(len(p) for p in plan.prompts),
                    completion_tokens=0 if plan.discard_output else sum(len(r.tokens) for r in submission.requests),
                    cached_tokens=sum(r.cached_tokens for r in firsts))


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # No caching or proxy buffering: every event should reach the client as soon as it is written.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
