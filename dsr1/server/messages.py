"""Anthropic's Messages API over the chat machinery: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`, for the anthropic SDK and the agents built on it.

A Messages request is translated into the chat request it means (`chat_request`) and planned,
submitted and limited exactly as `/v1/chat/completions` is (`completions.CompletionService`: body
size, the model's chat template, tools described in the system prompt, the tool-call grammar, the
queue's 429, the drain's 503, cancellation when the client leaves):

- `system` is a system message; text blocks are the turn's text (joined by newlines);
- a user turn's `tool_result` blocks are `tool` messages (an `is_error` result's text begins
  "Error: "); an assistant turn's `tool_use` blocks are its `tool_calls` (`input` as the JSON
  arguments) and its `thinking` blocks its `reasoning_content` (rendered as the model's chat
  template says: R1's drops earlier turns' reasoning); `redacted_thinking` blocks are dropped;
- `tools[].input_schema` is each function's parameters; `tool_choice` `auto`, `any`, `tool`,
  `none` is `auto`, `required`, the named function, `none` (`any` and `tool` are the grammar's:
  the calls always parse); `disable_parallel_tool_use` is `parallel_tool_calls: false` (which
  the chat endpoint does not yet enforce);
- `stop_sequences` are stop strings (matched in the raw output, so the reply names the one that
  stopped it); `max_tokens`, `temperature`, `top_p`, `top_k` are the chat's;
- `output_config.format` (`json_schema`) is `response_format`: the text is JSON valid against the
  schema (after R1's thinking); `output_config.effort` changes nothing on R1, which has no switch;
- `thinking.budget_tokens` is the reasoning budget of a reply the grammar constrains
  (`max_reasoning_tokens`); R1 always thinks, so its reasoning comes back as a `thinking` block
  whatever `thinking.type` says (`display: "omitted"`: the block without its text).

The reply's content blocks are `thinking`, `text`, then one `tool_use` per call (`toolu_` ids,
`input` the parsed arguments); a call whose arguments are not a JSON object leaves the reply
without calls, its text as written, as the chat endpoint does. `stop_reason` is `end_turn`,
`max_tokens`, `stop_sequence` (with `stop_sequence`) or `tool_use`; `usage` counts
`input_tokens` (the prompt's tokens the prefix cache did not serve), `cache_read_input_tokens`
and `output_tokens`. Streamed, the events are Anthropic's: `message_start`, `ping`, per block
`content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta`:
a call's input in one delta, once the call is complete and parsed) and `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`. A request cancelled by the shutdown or an
engine failure is answered 503 (streamed: an `error` event), `overloaded_error`.

Every error under `/v1/messages` (the key check, unknown routes and methods included) has
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (`install_error_shape`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving import Request
from .completions import CompletionService, Submission
from .errors import APIError
from .messages_protocol import (
    ContentBlock,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    ThinkingConfig,
    Tool,
    ToolChoice,
    error_type,
)
from .prepare import Plan, plan_chat
from .protocol import ChatCompletionRequest
from .reasoning import ReasoningSplitter, split_reply
from .runner import ABORT
from .tools import ToolCallSplitter, split_tool_calls

__all__ = ["PREFIX", "MessagesService", "chat_request", "install_error_shape", "install_messages"]

PREFIX = "/v1/messages"
_CANCELLED = ("the request was cancelled before it finished: the server is shutting down or its engine failed; "
              "retry later")


# ---- the request, as the chat request it means ----------------------------------------------------
def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means (see the module docstring); an `APIError` (400)
    naming the Messages field for what the translation refuses."""
    max_tokens = getattr(body, "max_tokens", None)  # None: count_tokens, the prompt alone
    budget = _reasoning_budget(body.thinking, max_tokens)
    stops = _stop_sequences(getattr(body, "stop_sequences", None))
    messages = _chat_messages(body.messages)
    if body.system:
        messages.insert(0, {"role": "system", "content": _system_text(body.system)})
    fields: dict[str, Any] = dict(model=body.model, messages=messages, max_tokens=max_tokens or 1, stop=list(stops),
                                  include_stop_str_in_output=bool(stops), tools=_chat_tools(body.tools),
                                  max_reasoning_tokens=budget, **_tool_choice(body.tool_choice, body.tools))
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name, None) is not None:
            fields[name] = getattr(body, name)
    if body.thinking is not None and body.thinking.type in ("enabled", "disabled"):
        # The chat request's own thinking switch (DeepSeek's spelling); R1's template always thinks.
        fields["thinking"] = {"type": body.thinking.type}
    return ChatCompletionRequest.model_validate(fields)


def _reasoning_budget(thinking: ThinkingConfig | None, max_tokens: int | None) -> int | None:
    if thinking is None or thinking.budget_tokens is None:
        return None
    if thinking.type != "enabled":
        raise APIError(400, f"thinking.budget_tokens goes with thinking.type 'enabled', not {thinking.type!r}",
                       param="thinking.budget_tokens")
    if max_tokens is not None and thinking.budget_tokens >= max_tokens:
        raise APIError(400, f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens "
                            f"({max_tokens})", param="thinking.budget_tokens")
    return thinking.budget_tokens


def _stop_sequences(stops: list[str] | None) -> tuple[str, ...]:
    for i, stop in enumerate(stops or ()):
        if not stop:
            raise APIError(400, f"stop_sequences[{i}] must not be empty", param=f"stop_sequences[{i}]")
    return tuple(stops or ())


def _system_text(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_text(block, f"system[{j}]") for j, block in enumerate(system))


def _text(block: ContentBlock, at: str) -> str:
    """A text block's text (a 400 naming `at` for any other block)."""
    if block.type != "text":
        raise APIError(400, f"{at}: only text blocks are supported here, got a {block.type!r} block",
                       param=f"{at}.type", code="unsupported_content")
    if block.text is None:
        raise APIError(400, f"{at}.text is required for a text block", param=f"{at}.text")
    return block.text


def _chat_messages(messages: list[MessageParam]) -> list[dict[str, Any]]:
    if messages and messages[-1].role == "assistant":
        at = f"messages[{len(messages) - 1}]"
        raise APIError(400, f"{at}: the last message must be a user turn (continuing a final assistant turn, "
                            "prefill, is not supported)", param=f"{at}.role")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif not m.content:
            raise APIError(400, f"messages[{i}].content must not be empty", param=f"messages[{i}].content")
        elif m.role == "assistant":
            out.append(_assistant_message(m.content, f"messages[{i}]"))
        else:
            out += _user_messages(m.content, f"messages[{i}]")
    return out


def _user_messages(blocks: list[ContentBlock], at: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages, its text as user messages, in order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{at}.content[{j}]"
        if block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_message(block, where))
        elif block.type in ("tool_use", "thinking", "redacted_thinking"):
            raise APIError(400, f"{where}: a {block.type!r} block belongs to an assistant turn",
                           param=f"{where}.type")
        else:
            texts.append(_text(block, where))
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_message(block: ContentBlock, at: str) -> dict[str, Any]:
    if not isinstance(block.tool_use_id, str) or not block.tool_use_id:
        raise APIError(400, f"{at}.tool_use_id is required for a tool_result block", param=f"{at}.tool_use_id")
    content = block.content if block.content is not None else ""
    if isinstance(content, list):
        content = "\n".join(_text(part, f"{at}.content[{k}]") for k, part in enumerate(content))
    return {"role": "tool", "tool_call_id": block.tool_use_id,
            "content": f"Error: {content}" if block.is_error else content}


def _assistant_message(blocks: list[ContentBlock], at: str) -> dict[str, Any]:
    """An assistant turn: its text, its tool uses as tool calls and its thinking as the reasoning."""
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        where = f"{at}.content[{j}]"
        if block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue  # encrypted reasoning of another model: nothing the template could render
        elif block.type == "tool_use":
            for name in ("id", "name", "input"):
                if getattr(block, name) is None:
                    raise APIError(400, f"{where}.{name} is required for a tool_use block", param=f"{where}.{name}")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type == "tool_result":
            raise APIError(400, f"{where}: a 'tool_result' block belongs to a user turn", param=f"{where}.type")
        else:
            texts.append(_text(block, where))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: server tools ({tool.type!r}) are not supported; give client tools "
                                "(name, description, input_schema)", param=f"tools[{i}].type",
                           code="unsupported_parameter")
        if tool.input_schema is None:
            raise APIError(400, f"tools[{i}].input_schema is required", param=f"tools[{i}].input_schema")
        out.append({"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                     "parameters": tool.input_schema}})
    return out or None


def _tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> dict[str, Any]:
    """The chat request's `tool_choice` and `parallel_tool_calls` for Anthropic's `tool_choice`."""
    if choice is None:
        return {}
    names = [t.name for t in tools or ()]
    if choice.type in ("any", "tool") and not names:
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice.type")
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if choice.name not in names:
            raise APIError(400, f"tool_choice names the tool {choice.name!r}, which is not among the tools {names}",
                           param="tool_choice.name")
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice.name}}}
    return {**fields, "tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}


def _renamed(error: APIError) -> APIError:
    """A chat-side error about tools or the output format, in the Messages request's field names."""
    def rename(text: str) -> str:
        return text.replace("function.parameters", "input_schema").replace("function.", "").replace(
            "response_format.json_schema.schema", "output_config.format.schema").replace(
            "response_format", "output_config.format")

    return APIError(error.status, rename(error.message), param=error.param and rename(error.param), code=error.code,
                    headers=error.headers)


# ---- the reply ----------------------------------------------------------------------------------
class StopCutter:
    """The output up to the first stop sequence (the engine keeps the one that stopped it at the
    end: `include_stop_str_in_output`), and which one it was."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.matched: str | None = None
        self._keep = max((len(s) for s in self.stops), default=1) - 1  # a stop may straddle two pieces
        self._tail = ""

    def push(self, piece: str) -> str:
        """The part of `piece` before the stop sequence (all of it while none has appeared)."""
        if self.matched is not None:
            return ""
        text = self._tail + piece
        hits = [(at, stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if not hits:
            self._tail = text[len(text) - self._keep:] if self._keep else ""
            return piece
        at, self.matched = min(hits)
        return text[len(self._tail):at]


def calls_of(content: str, tool_format: str = "v3") -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(text, calls as (name, input)) of a reply's content in the model's tool-call format: the calls
    that are complete with a JSON object as their arguments (the markup is never text)."""
    parsed = split_tool_calls(content, tool_format)
    if parsed is None:
        return content, []
    text, calls = parsed
    inputs = [_json_object(call.arguments) if call.complete else None for call in calls]
    return text, [(call.name, value) for call, value in zip(calls, inputs) if value is not None]


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def stop_reason(request: Request, calls: bool, matched: str | None) -> str:
    """Anthropic's stop reason of a finished request."""
    if request.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if matched is not None else "end_turn"


def usage(plan: Plan, request: Request) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens the prefix cache did not serve, those it did, the output's."""
    prompt, cached = len(plan.prompts[0]), request.cached_tokens
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": len(request.tokens)}


def whole_message(message_id: str, model: str, plan: Plan, request: Request, stops: Sequence[str],
                  omit_thinking: bool) -> dict[str, Any]:
    """The Message of a finished request."""
    cutter = StopCutter(stops)
    reasoning, content = split_reply(cutter.push(request.text), request.thinking)
    text, calls = calls_of(content, plan.tool_format) if plan.calls_tools else (content, [])
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": "" if omit_thinking else reasoning, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    blocks += [{"type": "tool_use", "id": _tool_use_id(), "name": name, "input": value} for name, value in calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason(request, bool(calls), cutter.matched), "stop_sequence": cutter.matched,
            "usage": usage(plan, request)}


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class BlockEvents:
    """The content-block events of one streamed reply: a block opens when the kind of text changes
    and closes before the next one (or the message's end)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def text(self, kind: str, text: str, *, show: bool = True) -> list[str]:
        """Events for more `kind` ("thinking" or "text") text; `show` False: open the block only."""
        events = [] if self.open == kind else [*self.close(), *self._start(kind)]
        if show and text:
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
                {"type": "text_delta", "text": text}
            events.append(_event("content_block_delta", index=self.index, delta=delta))
        return events

    def tool_use(self, name: str, value: dict[str, Any]) -> list[str]:
        """Events of one whole call: its block, its input as one JSON delta, its end."""
        events = [*self.close(), *self._start("tool_use", id=_tool_use_id(), name=name, input={})]
        delta = {"type": "input_json_delta", "partial_json": json.dumps(value, ensure_ascii=False)}
        return [*events, _event("content_block_delta", index=self.index, delta=delta), *self.close()]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _start(self, kind: str, **fields: Any) -> list[str]:
        self.index, self.open = self.index + 1, kind
        block = {"type": kind, **({"thinking": "", "signature": ""} if kind == "thinking" else {}),
                 **({"text": ""} if kind == "text" else {}), **fields}
        return [_event("content_block_start", index=self.index, content_block=block)]


class StreamedReply:
    """One request's streamed text, turned into content-block events as it comes: the same blocks
    `whole_message` gives for the whole text."""

    def __init__(self, request: Request, stops: Sequence[str], calls_tools: bool, omit_thinking: bool,
                 tool_format: str = "v3"):
        self.cutter = StopCutter(stops)
        self.reasoning = ReasoningSplitter(request.thinking)
        self.caller = ToolCallSplitter(tool_format) if calls_tools else None
        self.tool_format = tool_format
        self.blocks = BlockEvents()
        self.omit_thinking = omit_thinking
        self.content = ""  # the reply's content so far (calls' markup included)
        self.sent = ""  # of which sent as text
        self.calls = False

    def push(self, piece: str, done: bool) -> list[str]:
        """Events for the next piece of output (`done`: the last one)."""
        reasoning, content = self.reasoning.push(self.cutter.push(piece))
        if done:
            rest = self.reasoning.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        events = self.blocks.text("thinking", reasoning, show=not self.omit_thinking) if reasoning else []
        self.content += content
        if self.caller is None:
            events += self._text(content)
        elif not done:
            events += self._text(self.caller.push(content)[0])  # held back from where the calls may begin
        else:
            text, calls = calls_of(self.content, self.tool_format)
            events += self._text(text[len(self.sent):])
            for name, value in calls:
                events += self.blocks.tool_use(name, value)
            self.calls = bool(calls)
        return [*events, *self.blocks.close()] if done else events

    def _text(self, text: str) -> list[str]:
        self.sent += text
        return self.blocks.text("text", text) if text else []


# ---- the endpoints --------------------------------------------------------------------------------
class MessagesService(CompletionService):
    """`/v1/messages` and `/v1/messages/count_tokens` over the chat endpoint's machinery."""

    async def create(self, http: HTTPRequest) -> Response:
        """Answer `POST /v1/messages`."""
        body = await self._parse(http, MessagesRequest)
        plan = await self._plan_messages(body)
        submission = await self._submit("messages", plan)
        message_id = f"msg_{secrets.token_hex(12)}"
        stops = tuple(body.stop_sequences or ())
        omit = body.thinking is not None and body.thinking.display == "omitted"
        if body.stream:
            return StreamingResponse(self._events(submission, plan, message_id, stops, omit),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await submission.wait(http.is_disconnected)
        request = submission.requests[0]
        if request.finish_reason == ABORT:
            raise APIError(503, _CANCELLED, code="cancelled")
        return JSONResponse(whole_message(message_id, self.limits.model_name, plan, request, stops, omit))

    async def count_tokens(self, http: HTTPRequest) -> JSONResponse:
        """Answer `POST /v1/messages/count_tokens`: the prompt `/v1/messages` would run, its tokens."""
        plan = await self._plan_messages(await self._parse(http, CountTokensRequest))
        return JSONResponse({"input_tokens": len(plan.prompts[0])})

    async def _plan_messages(self, body: MessagesRequest | CountTokensRequest) -> Plan:
        chat = self._checked(lambda: chat_request(body))
        try:
            return await self._plan(plan_chat, chat)
        except APIError as e:
            raise _renamed(e) from None

    async def _events(self, submission: Submission, plan: Plan, message_id: str, stops: Sequence[str],
                      omit_thinking: bool) -> AsyncIterator[str]:
        request = submission.requests[0]
        try:
            start = {"id": message_id, "type": "message", "role": "assistant", "model": self.limits.model_name,
                     "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": len(plan.prompts[0]), "output_tokens": 0}}
            yield _event("message_start", message=start)
            yield _event("ping")
            reply = StreamedReply(request, stops, plan.calls_tools, omit_thinking, plan.tool_format)
            async for update in submission.updates():
                if events := reply.push(update.text, update.done):
                    yield "".join(events)  # one write per step, however many events it made
            if request.finish_reason == ABORT:
                yield _event("error", error={"type": error_type(503), "message": _CANCELLED})
                return
            delta = {"stop_reason": stop_reason(request, reply.calls, reply.cutter.matched),
                     "stop_sequence": reply.cutter.matched}
            yield _event("message_delta", delta=delta, usage=usage(plan, request))
            yield _event("message_stop")
        finally:
            submission.cancel()  # the client went away (or the stream failed): free its request now


def install_messages(app: FastAPI, service: MessagesService, dependencies: Sequence[Depends]) -> None:
    """Add the two routes to `app` (behind `dependencies`, the key check) and Anthropic's error shape
    under them. Call after `errors.install_error_handlers`."""

    @app.post(PREFIX, dependencies=list(dependencies))
    async def messages(request: HTTPRequest) -> Response:
        return await service.create(request)

    @app.post(PREFIX + "/count_tokens", dependencies=list(dependencies))
    async def count_tokens(request: HTTPRequest) -> JSONResponse:
        return await service.count_tokens(request)

    install_error_shape(app, PREFIX)


Handler = Callable[[HTTPRequest, Exception], Awaitable[Response]]


def install_error_shape(app: FastAPI, prefix: str) -> None:
    """Answer the errors of the routes under `prefix` in Anthropic's shape, `{"type": "error", "error":
    {"type", "message"}}` (status and `Retry-After` kept, the field at fault named in the message),
    whichever handler made them."""
    for kind in (APIError, StarletteHTTPException, RequestValidationError, Exception):
        app.exception_handlers[kind] = _reshaped(app.exception_handlers[kind], prefix)


def _reshaped(handler: Handler, prefix: str) -> Handler:
    async def reshape(request: HTTPRequest, error: Exception) -> Response:
        response = await handler(request, error)
        path = request.url.path
        if not (path == prefix or path.startswith(prefix + "/")):
            return response
        error_body = json.loads(response.body)["error"]
        message, param = error_body["message"], error_body.get("param")
        if param and param not in message:  # Anthropic's errors have no field of their own for it
            message = f"{param}: {message}"
        kept = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "www-authenticate")}
        body = {"type": "error", "error": {"type": error_type(response.status_code), "message": message}}
        return JSONResponse(body, status_code=response.status_code, headers=kept)

    return reshape
