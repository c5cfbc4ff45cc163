"""OpenAI's Responses API wire format (`POST /v1/responses`): the request body as pydantic models,
parsed strictly by `protocol.parse_request` (a wrong type is a 400 naming the field, e.g.
`input[1].call_id`).

Input items are one model with the fields of every item type the endpoint takes (`message`, its
`type` optional as OpenAI's is; `function_call`, `function_call_output`, `reasoning`); `responses`
checks each item's fields for its type and refuses the types it does not serve (images, files,
hosted tools' calls) by name. Unknown fields are ignored (`metadata`, `user`, `service_tier`,
`truncation`, `include`...), as the chat endpoint ignores vendor extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ContentPart", "FunctionTool", "InputItem", "NamedToolChoice", "ReasoningConfig", "ResponsesRequest",
           "TextConfig", "TextFormat"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    """One part of a message's content (`input_text`, `output_text`), or of a reasoning item's
    `summary` (`summary_text`) or `content` (`reasoning_text`): `type` and its `text`."""

    type: str
    text: str | None = None


class InputItem(_Strict):
    """One input item: `type` says which of the other fields it carries (none: a message)."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None  # message
    content: str | list[ContentPart] | None = None  # message: text or parts; reasoning: its text parts
    id: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output
    summary: list[ContentPart] | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning (another model's: dropped)
    status: str | None = None


class FunctionTool(_Strict):
    """A function the model may call; a `type` other than `function` (web_search, file_search, mcp,
    ...) is one of OpenAI's hosted tools, refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(_Strict):
    """`{"type": "function", "name": ...}`: that function must be called."""

    type: str
    name: str | None = None


class TextFormat(_Strict):
    """`text.format`: `text` (free), `json_object`, or `json_schema` with its `name` and `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    """`reasoning`: how hard the model thinks (`effort`) and the summary asked for (R1 writes none)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    """`POST /v1/responses`."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
