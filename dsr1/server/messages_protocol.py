"""Anthropic's Messages API wire format (`POST /v1/messages`, `POST /v1/messages/count_tokens`):
request bodies as pydantic models, parsed strictly by `protocol.parse_request` (a wrong type is a 400
naming the field, e.g. `messages[1].content[0].type`), and the error body Anthropic's clients read.

Content blocks are one model with the fields of every block type the endpoint takes (`text`,
`thinking`, `redacted_thinking`, `tool_use`, `tool_result`); `messages` checks each block's fields
for its type and refuses the types it does not serve (images, documents, server tools) by name.
Unknown fields are ignored (`cache_control`, `citations`, `metadata`, `service_tier`...), as the
OpenAI side ignores vendor extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .protocol import MAX_STOP_STRINGS

__all__ = ["ContentBlock", "CountTokensRequest", "MessageParam", "MessagesRequest", "OutputConfig", "ThinkingConfig",
           "Tool", "ToolChoice", "error_type"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentBlock(_Strict):
    """One block of a message's content: `type` says which of the other fields it carries."""

    type: str
    text: str | None = None  # text
    thinking: str | None = None  # thinking (sent back: the assistant's reasoning)
    signature: str | None = None  # thinking
    data: str | None = None  # redacted_thinking
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result: text, or text blocks
    is_error: bool = False  # tool_result


class MessageParam(_Strict):
    """One turn: `user` (text, tool results) or `assistant` (text, thinking, tool uses)."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    """A client tool: its name, description and the JSON schema of its input. A `type` other than
    `custom` is one of Anthropic's server tools (web search, code execution...), refused by name."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(_Strict):
    """`auto` (the model decides), `any` (some tool must be called), `tool` (the one `name`d), `none`."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Strict):
    """Extended thinking: `enabled` with a `budget_tokens`, `disabled`, or the model's own choice
    (`adaptive`, `between_tools`); `display` "omitted" returns thinking blocks without their text."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    """Structured output: the reply's text is JSON valid against `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """`format`: a structured output; `effort`: how hard the model thinks (R1 has no such switch)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Prompt(_Strict):
    """What both endpoints render into the prompt."""

    model: str
    messages: list[MessageParam]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(_Prompt):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)


class CountTokensRequest(_Prompt):
    """`POST /v1/messages/count_tokens`: the prompt alone; the answer is `{"input_tokens": N}`."""


# Anthropic's error types by HTTP status (its clients read `error.type`).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
