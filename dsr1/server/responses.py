"""OpenAI's Responses API over the chat machinery: `POST /v1/responses` (whole or streamed),
`GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` for stored ones, for the openai SDK's
`client.responses` and the agents built on it (openai-agents, Codex-style agents).

A Responses request is translated into the chat request it means (`chat_request`) and planned,
submitted and limited exactly as `/v1/chat/completions` is (`completions.CompletionService`: body
size, the model's chat template, tools described in the system prompt, the tool-call grammar, the
queue's 429, the drain's 503, cancellation when the client leaves):

- `instructions` is a system message (not carried over by `previous_response_id`, as OpenAI's);
  a string `input` is one user message; input items are messages (`user`, `system`, `developer`,
  `assistant`; text or `input_text` / `output_text` parts), `function_call` items (an assistant
  turn's `tool_calls`, `call_id` as the id), `function_call_output` items (`tool` messages) and
  `reasoning` items (the assistant turn's `reasoning_content`, from their `content` or `summary`
  text; rendered as the model's chat template says: R1's drops earlier turns' reasoning). Items of
  one assistant turn (reasoning, message, calls) between two other items are one turn;
- `tools` (function tools: `name`, `description`, `parameters`) are the chat's tools; `tool_choice`
  `auto`, `required`, `none` or `{"type": "function", "name"}` the chat's (`required` and a named
  function are the grammar's: the calls always parse); `parallel_tool_calls` is passed on;
- `text.format` `json_schema` / `json_object` is `response_format`: the text is JSON (valid
  against the schema) after R1's thinking;
- `reasoning.effort` is accepted: `none` turns a switchable template's thinking off, the others on
  (R1 always thinks) with the chat's `reasoning_effort`; `max_output_tokens`, `temperature` and
  `top_p` are the chat's.

The reply's output items are `reasoning` (the model's thinking as `reasoning_text` content; R1
writes no summary, so `summary` is empty), a `message` with one `output_text` part, then one
`function_call` per call (`fc_` item ids, `call_` call ids, `arguments` the JSON text). A reply cut by
`max_output_tokens` is `incomplete` (`incomplete_details.reason` "max_output_tokens"). `usage`
counts `input_tokens` (with `input_tokens_details.cached_tokens`, those the prefix cache served),
`output_tokens` (`output_tokens_details.reasoning_tokens`: the reasoning text's tokens) and
`total_tokens`. Streamed, the events are OpenAI's, each with its `sequence_number`:
`response.created`, `response.in_progress`, per item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`; `response.content_part.added`, `response.output_text.delta`;
`response.function_call_arguments.delta`), their `.done` events and `response.output_item.done`,
then `response.completed` (or `response.incomplete`; `response.failed` when the shutdown or an
engine failure cancelled it; a whole request is then answered 503).

With `store` (the default) the response is kept in memory, with the conversation it ends, for
`previous_response_id` and `GET`: the last `STORED_RESPONSES` responses, within `STORED_CHARS`
characters of conversation, least recently used evicted first; an id not kept (never stored,
deleted or evicted) is a 400 naming `previous_response_id`, or a 404 on `GET` / `DELETE`. Errors have
OpenAI's shape, as every other OpenAI route's.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..generation.tokenizer import Tokenizer
from ..serving import Request
from .completions import CompletionService, Submission
from .errors import APIError
from .prepare import Plan, plan_chat
from .protocol import ChatCompletionRequest
from .reasoning import ReasoningSplitter, split_reply
from .responses_protocol import ContentPart, FunctionTool, InputItem, NamedToolChoice, ResponsesRequest
from .runner import ABORT
from .tools import ToolCall, ToolCallSplitter, split_tool_calls

__all__ = ["PREFIX", "STORED_CHARS", "STORED_RESPONSES", "ResponseStore", "ResponsesService", "Stored",
           "chat_request", "conversation_of", "install_responses"]

PREFIX = "/v1/responses"
STORED_RESPONSES = 256  # responses kept for previous_response_id and GET, the least recently used evicted
STORED_CHARS = 64 << 20  # and at most this many characters of their conversations together
_CANCELLED = ("the request was cancelled before it finished: the server is shutting down or its engine failed; "
              "retry later")
_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max"}
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


# ---- the stored responses ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stored:
    """A stored response: its body (for `GET`) and the chat messages of the conversation it ends
    (its input, the earlier responses' and its output; instructions left out)."""

    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]

    @property
    def size(self) -> int:
        return len(json.dumps(self.conversation, ensure_ascii=False))


class ResponseStore:
    """The last `capacity` stored responses within `chars` characters of conversation, least
    recently used (stored or read) evicted first."""

    def __init__(self, capacity: int = STORED_RESPONSES, chars: int = STORED_CHARS):
        self.capacity, self.chars = capacity, chars
        self._items: OrderedDict[str, tuple[Stored, int]] = OrderedDict()
        self._size = 0

    def put(self, response_id: str, stored: Stored) -> None:
        """Keep `stored` under `response_id`, evicting the least recently used beyond the bounds."""
        self.delete(response_id)
        size = stored.size
        self._items[response_id] = (stored, size)
        self._size += size
        while len(self._items) > self.capacity or (self._size > self.chars and len(self._items) > 1):
            _, (_, evicted) = self._items.popitem(last=False)
            self._size -= evicted

    def get(self, response_id: str) -> Stored | None:
        """The stored response, or None (never stored, deleted or evicted)."""
        if response_id not in self._items:
            return None
        self._items.move_to_end(response_id)
        return self._items[response_id][0]

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was kept."""
        if response_id not in self._items:
            return False
        self._size -= self._items.pop(response_id)[1]
        return True

    def __len__(self) -> int:
        return len(self._items)


# ---- the request, as the chat request it means ----------------------------------------------------
def chat_request(body: ResponsesRequest, previous: Stored | None) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request a Responses request means (see the module docstring) and the conversation
    its reply continues (chat messages, instructions left out); an `APIError` (400) naming the
    Responses field for what the translation refuses."""
    if body.background:
        raise APIError(400, "background responses are not supported; send background: false",
                       param="background", code="unsupported_parameter")
    conversation = [*(previous.conversation if previous else ()), *conversation_of(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = dict(model=body.model, messages=[*system, *conversation],
                                  max_completion_tokens=body.max_output_tokens, tools=_chat_tools(body.tools),
                                  parallel_tool_calls=body.parallel_tool_calls, **_reasoning(body))
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if (response_format := _response_format(body)) is not None:
        fields["response_format"] = response_format
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return ChatCompletionRequest.model_validate(fields), conversation


def conversation_of(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`: the items of one assistant turn (reasoning, text,
    function calls) merged into one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must contain at least one item", param="input", code="invalid_value")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at, kind = f"input[{i}]", item.type or "message"
        if kind == "message" and item.role != "assistant":
            out.append({"role": "system" if item.role == "developer" else _role(item, at),
                        "content": _text(item.content, f"{at}.content")})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _required(item.call_id, f"{at}.call_id"),
                        "content": _text(item.output, f"{at}.output")})
        elif kind in ("message", "function_call", "reasoning"):
            _add_to_turn(_assistant_turn(out), item, kind, at)
        else:
            raise APIError(400, f"{at}: input items of type {kind!r} are not supported; give messages, function_call, "
                                "function_call_output or reasoning items", param=f"{at}.type",
                           code="unsupported_content")
    for message in out:
        if message["role"] == "assistant" and message["content"] is None and not message.get("tool_calls"):
            message["content"] = ""
    return out


def _role(item: InputItem, at: str) -> str:
    if item.role is None:
        raise APIError(400, f"{at}.role is required for a message item", param=f"{at}.role",
                       code="missing_required_parameter")
    return item.role


def _required(value: str | None, at: str) -> str:
    if not value:
        raise APIError(400, f"{at} is required (a non-empty string)", param=at, code="missing_required_parameter")
    return value


def _text(content: str | list[ContentPart] | None, at: str) -> str:
    """A message's or an output's text: the string, or its text parts joined (a 400 for other parts)."""
    if content is None:
        raise APIError(400, f"{at} is required", param=at, code="missing_required_parameter")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise APIError(400, f"{at}[{j}]: only text parts are supported, got a {part.type!r} part",
                           param=f"{at}[{j}].type", code="unsupported_content")
        if part.text is None:
            raise APIError(400, f"{at}[{j}].text is required for a {part.type!r} part", param=f"{at}[{j}].text",
                           code="missing_required_parameter")
        texts.append(part.text)
    return "".join(texts)


def _assistant_turn(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn being assembled at the end of `out` (a new one if the last message is not)."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None})
    return out[-1]


def _add_to_turn(turn: dict[str, Any], item: InputItem, kind: str, at: str) -> None:
    if kind == "function_call":
        call = {"id": _required(item.call_id, f"{at}.call_id"), "type": "function", "function": {
            "name": _required(item.name, f"{at}.name"), "arguments": _arguments(item.arguments, at)}}
        turn.setdefault("tool_calls", []).append(call)
        return
    if kind == "reasoning":
        # The model's text (content), else its summary; encrypted reasoning of another model cannot be rendered.
        parts = item.content if isinstance(item.content, list) and item.content else item.summary or []
        text, key = _text(parts, f"{at}.content" if item.content else f"{at}.summary"), "reasoning_content"
    else:
        text, key = _text(item.content, f"{at}.content"), "content"
    if text:
        turn[key] = text if turn.get(key) is None else f"{turn[key]}\n{text}"


def _arguments(arguments: str | None, at: str) -> str:
    text = _required(arguments, f"{at}.arguments")
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"{at}.arguments is not JSON: {e}", param=f"{at}.arguments", code="invalid_value") from None
    return text


def _chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.type != "function":
            raise APIError(400, f"tools[{i}]: hosted tools ({tool.type!r}) are not supported; give function tools "
                                "(type 'function', name, parameters)", param=f"tools[{i}].type",
                           code="unsupported_parameter")
        function: dict[str, Any] = {"name": tool.name, "description": tool.description or ""}
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(choice: str | NamedToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise APIError(400, f"tool_choice of type {choice.type!r} is not supported; give 'auto', 'required', 'none' "
                            "or {'type': 'function', 'name': ...}", param="tool_choice.type",
                       code="unsupported_parameter")
    return {"type": "function", "function": {"name": _required(choice.name, "tool_choice.name")}}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema is required for the json_schema format", param="text.format.schema",
                       code="missing_required_parameter")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_,
                                                   "strict": bool(fmt.strict)}}


def _reasoning(body: ResponsesRequest) -> dict[str, Any]:
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return {}
    if effort == "none":
        return {"thinking": {"type": "disabled"}}
    return {"thinking": {"type": "enabled"}, "reasoning_effort": _EFFORTS[effort]}


_RENAMES = (("max_completion_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
            ("function.parameters", "parameters"), ("function.name", "name"))


def _renamed(error: APIError) -> APIError:
    """A chat-side error in the Responses request's field names."""
    def rename(text: str) -> str:
        for old, new in _RENAMES:
            text = text.replace(old, new)
        return text

    param = "input" if error.param == "messages" else error.param and rename(error.param)
    return APIError(error.status, rename(error.message), param=param, code=error.code, headers=error.headers)


# ---- the reply ------------------------------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def assistant_message(reasoning: str, text: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The chat message of a reply, for the stored conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The response's `text.format`: the request's, or `text`."""
    if body.text is None or body.text.format is None:
        return {"type": "text"}
    return body.text.format.model_dump(by_alias=True, exclude_none=True)


def _choice_echo(body: ResponsesRequest) -> str | dict[str, Any]:
    """The response's `tool_choice`: the request's, or `auto`."""
    if isinstance(body.tool_choice, NamedToolChoice):
        return body.tool_choice.model_dump(exclude_none=True)
    return body.tool_choice or "auto"


class Reply:
    """One response's id, creation time and the fields it repeats from its request, and its end:
    the response body, its usage and (with `store`) its stored conversation."""

    def __init__(self, body: ResponsesRequest, model: str, conversation: list[dict[str, Any]]):
        self.id, self.created_at = _item_id("resp"), int(time.time())
        self.store, self.conversation = body.store, conversation
        self.head = {"object": "response", "model": model, "instructions": body.instructions,
                     "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls,
                     "previous_response_id": body.previous_response_id, "store": body.store,
                     "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
                     "temperature": 1.0 if body.temperature is None else body.temperature,
                     "top_p": 1.0 if body.top_p is None else body.top_p, "text": {"format": _format_echo(body)},
                     "tool_choice": _choice_echo(body),
                     "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
                     "truncation": "disabled", "metadata": body.metadata or {}, "error": None}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        """The response body with `status` ("in_progress", "completed", "incomplete", "failed")."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.head, "id": self.id, "created_at": self.created_at, "status": status, "output": output,
                "usage": usage, "incomplete_details": incomplete, **({"error": error} if error else {})}

    def finish(self, store: ResponseStore, tokenizer: Tokenizer, plan: Plan, request: Request,
               output: list[dict[str, Any]], message: dict[str, Any]) -> dict[str, Any]:
        """The finished response (stored with its conversation when asked to)."""
        reasoning = message.get("reasoning_content") or ""
        prompt, cached, generated = len(plan.prompts[0]), request.cached_tokens, len(request.tokens)
        thought = min(len(tokenizer.encode(reasoning, add_bos=False)), generated) if reasoning else 0
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": thought},
                 "total_tokens": prompt + generated}
        response = self.response("incomplete" if request.finish_reason == "length" else "completed", output, usage)
        if self.store:
            store.put(self.id, Stored(response, (*self.conversation, message)))
        return response


def whole_output(plan: Plan, request: Request) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A finished request's output items and its chat message."""
    reasoning, content = split_reply(request.text, request.thinking)
    calls: list[ToolCall] = []
    if plan.calls_tools and (parsed := split_tool_calls(content, plan.tool_format)) is not None:
        content, calls = parsed
    status = "incomplete" if request.finish_reason == "length" else "completed"
    output = [reasoning_item(_item_id("rs"), reasoning)] if reasoning else []
    output += [message_item(_item_id("msg"), content, status)] if content else []
    output += [call_item(_item_id("fc"), call) for call in calls]
    return output, assistant_message(reasoning, content, calls)


# ---- the stream -----------------------------------------------------------------------------------
class OutputEvents:
    """The events of one streamed response, numbered: an output item opens when the kind of output
    changes (reasoning, message, a function call) and closes before the next one (or the end)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the finished items
        self.open: dict[str, Any] | None = None  # the item being written, its text so far in "text"
        self.calls: list[ToolCall] = []

    def event(self, kind: str, **data: Any) -> str:
        """One server-sent event, with the next sequence number."""
        self.sequence += 1
        body = {"type": kind, "sequence_number": self.sequence - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def text(self, kind: str, text: str) -> list[str]:
        """Events for more `kind` ("reasoning" or "message") text."""
        if not text:
            return []
        events = [] if self.open is not None and self.open["type"] == kind else [*self.close(), *self._start(kind)]
        self.open["text"] += text
        where = {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", **where, delta=text)]
        return [*events, self.event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """Events for one `ToolCallSplitter` delta: a new call's item, or more of its arguments."""
        events = []
        if "id" in delta:
            events += self.close()
            self.calls.append(ToolCall(delta["id"], delta["function"]["name"], ""))
            self.open = {"type": "function_call", "id": _item_id("fc"), "text": ""}
            item = call_item(self.open["id"], self.calls[-1], "in_progress")
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        piece = delta["function"]["arguments"]
        if piece:
            self.calls[-1].arguments += piece
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output), delta=piece))
        return events

    def close(self, status: str = "completed") -> list[str]:
        """The events that finish the open item (a message's `status`: "incomplete" when cut short)."""
        if self.open is None:
            return []
        kind, item_id, text = self.open["type"], self.open["id"], self.open["text"]
        where = {"item_id": item_id, "output_index": len(self.output)}
        if kind == "reasoning":
            item = reasoning_item(item_id, text)
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=text)]
        elif kind == "message":
            item = message_item(item_id, text, status)
            events = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=_text_part(text))]
        else:
            item = call_item(item_id, self.calls[-1])
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"])]
        self.open = None
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        return events

    def _start(self, kind: str) -> list[str]:
        self.open = {"type": kind, "id": _item_id("rs" if kind == "reasoning" else "msg"), "text": ""}
        index = len(self.output)
        if kind == "reasoning":
            item = {**reasoning_item(self.open["id"], ""), "content": []}
            return [self.event("response.output_item.added", output_index=index, item=item)]
        return [self.event("response.output_item.added", output_index=index,
                           item=message_item(self.open["id"], "", "in_progress")),
                self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                           content_index=0, part=_text_part(""))]

    def message(self) -> dict[str, Any]:
        """The streamed reply's chat message (once every item is closed)."""
        texts = {kind: "".join(i["content"][0]["text"] for i in self.output if i["type"] == kind and i["content"])
                 for kind in ("reasoning", "message")}
        return assistant_message(texts["reasoning"], texts["message"], self.calls)


class StreamedOutput:
    """One request's streamed text, turned into output-item events as it comes: the same items
    `whole_output` gives for the whole text."""

    def __init__(self, plan: Plan, request: Request):
        self.reasoning = ReasoningSplitter(request.thinking)
        self.caller = ToolCallSplitter(plan.tool_format) if plan.calls_tools else None
        self.items = OutputEvents()
        self.request = request

    def push(self, piece: str, done: bool) -> list[str]:
        """Events for the next piece of output (`done`: the last one)."""
        reasoning, content = self.reasoning.push(piece)
        if done:
            rest = self.reasoning.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        calls: list[dict[str, Any]] = []
        if self.caller is not None:
            content, calls = self.caller.push(content, final=done)
        events = [*self.items.text("reasoning", reasoning), *self.items.text("message", content)]
        for delta in calls:
            events += self.items.call(delta)
        if not done:
            return events
        return [*events, *self.items.close("incomplete" if self.request.finish_reason == "length" else "completed")]


# ---- the endpoints --------------------------------------------------------------------------------
class ResponsesService(CompletionService):
    """`/v1/responses` over the chat endpoint's machinery, with its own store of responses."""

    def __init__(self, *args: Any, store: ResponseStore | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.store = store if store is not None else ResponseStore()

    async def create(self, http: HTTPRequest) -> Response:
        """Answer `POST /v1/responses`."""
        body = await self._parse(http, ResponsesRequest)
        previous = self._checked(lambda: self._previous(body.previous_response_id))
        chat, conversation = self._checked(lambda: chat_request(body, previous))
        try:
            plan = await self._plan(plan_chat, chat)
        except APIError as e:
            raise _renamed(e) from None
        submission = await self._submit("responses", plan)
        reply = Reply(body, self.limits.model_name, conversation)
        if body.stream:
            return StreamingResponse(self._events(submission, plan, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await submission.wait(http.is_disconnected)
        request = submission.requests[0]
        if request.finish_reason == ABORT:
            raise APIError(503, _CANCELLED, code="cancelled")
        output, message = whole_output(plan, request)
        return JSONResponse(reply.finish(self.store, self.tokenizer, plan, request, output, message))

    def retrieve(self, response_id: str) -> JSONResponse:
        """Answer `GET /v1/responses/{id}`."""
        stored = self.store.get(response_id)
        if stored is None:
            raise self._not_kept(404, "response_id", response_id)
        return JSONResponse(stored.response)

    def delete(self, response_id: str) -> JSONResponse:
        """Answer `DELETE /v1/responses/{id}`."""
        if not self.store.delete(response_id):
            raise self._not_kept(404, "response_id", response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _previous(self, response_id: str | None) -> Stored | None:
        if response_id is None:
            return None
        stored = self.store.get(response_id)
        if stored is None:
            raise self._not_kept(400, "previous_response_id", response_id)
        return stored

    def _not_kept(self, status: int, param: str, response_id: str) -> APIError:
        """The error for a response id the store does not keep."""
        return APIError(status, f"{param}: no stored response has the id {response_id!r}: it was not stored "
                                f"(store: false), was deleted, or was evicted (this server keeps the last "
                                f"{self.store.capacity} stored responses)", param=param,
                        code="previous_response_not_found" if status == 400 else "response_not_found")

    async def _events(self, submission: Submission, plan: Plan, reply: Reply) -> AsyncIterator[str]:
        request = submission.requests[0]
        try:
            stream = StreamedOutput(plan, request)
            events = stream.items
            yield events.event("response.created", response=reply.response("in_progress", []))
            yield events.event("response.in_progress", response=reply.response("in_progress", []))
            async for update in submission.updates():
                if pieces := stream.push(update.text, update.done):
                    yield "".join(pieces)  # one write per step, however many events it made
            if request.finish_reason == ABORT:
                failed = reply.response("failed", events.output, error={"code": "server_error", "message": _CANCELLED})
                yield events.event("response.failed", response=failed)
                return
            response = reply.finish(self.store, self.tokenizer, plan, request, events.output, events.message())
            yield events.event(f"response.{response['status']}", response=response)
        finally:
            submission.cancel()  # the client went away (or the stream failed): free its request now


def install_responses(app: FastAPI, service: ResponsesService, dependencies: Sequence[Depends]) -> None:
    """Add the routes to `app`, behind `dependencies` (the key check)."""

    @app.post(PREFIX, dependencies=list(dependencies))
    async def create(request: HTTPRequest) -> Response:
        return await service.create(request)

    @app.get(PREFIX + "/{response_id}", dependencies=list(dependencies))
    async def retrieve(response_id: str) -> JSONResponse:
        return service.retrieve(response_id)

    @app.delete(PREFIX + "/{response_id}", dependencies=list(dependencies))
    async def delete(response_id: str) -> JSONResponse:
        return service.delete(response_id)
