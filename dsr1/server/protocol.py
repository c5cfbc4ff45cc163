"""The OpenAI wire format: request bodies (parsed strictly: a wrong type is an error, never coerced)
and response bodies, as pydantic models.

Requests are parsed by `parse_request`, which turns malformed JSON and every validation error into
an `APIError` (400) naming the field (`param`, e.g. `messages[0].role`). Range checks that depend
on the model or the server (context length, queue) are `completions.py`'s.

Fields outside OpenAI's API that vLLM also accepts (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `bad_words`, `allowed_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `prompt_logprobs`, the structured-output
fields...) are parsed here and each one honoured or refused by name in `prepare`; unknown fields
are ignored, as vLLM does, so clients that send other vendor extensions keep working.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..programs.sampling import TOP_LOGPROBS
from .errors import APIError

__all__ = [
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "Usage", "parse_request",
]

MAX_STOP_STRINGS = 16
MAX_N = 64
MAX_TOP_LOGPROBS = TOP_LOGPROBS  # alternatives per token the engine records at most
SEED_RANGE = (-(2**63), 2**64)  # OpenAI documents int64 seeds; dsr1 takes [0, 2**64) (negatives wrap)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ThinkingSwitch(_Strict):
    """DeepSeek's `thinking: {"type": "enabled" | "disabled"}`."""

    type: Literal["enabled", "disabled"]


class ContentPart(_Strict):
    """One part of a message's content given as a list (only `{"type": "text", "text": ...}` parts
    are supported: `prepare` refuses the others by name)."""

    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One chat message. `developer` is OpenAI's newer name for `system`; `latest_reminder` is V4's
    (its encoder's date-and-locale turn; the other templates refuse it)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # sent back by clients; V3.2's and V4's encoders render it where kept

    def text(self) -> str | None:
        """The content as one string (text parts joined), or None."""
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """The sampling and output fields shared by chat completions and completions."""

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: completions with echo only (the prompt's log-probabilities)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's convention and dsr1's)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling parameters
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # A constrained reply's reasoning budget (tool_choice required/named, structured outputs): </think> forced after it
    max_reasoning_tokens: int | None = Field(None, ge=0)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    best_of: int | None = Field(None, ge=1)
    logits_processors: list[Any] | None = None
    # structured outputs: OpenAI's response_format (chat), vLLM's structured_outputs and guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's switches (V3.1: thinking)
    thinking: ThinkingSwitch | None = None  # DeepSeek's API: the template's thinking switch, where it has one
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = None  # V4's encoder reads it ("max")

    @property
    def token_budget(self) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) or else `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`: `prompt` is a string, token ids, or a list of either (a batch; the
    two kinds may be mixed)."""

    prompt: str | list[int] | list[str | list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI stops at 5; vLLM, like us, at 20
    echo: bool = False
    suffix: str | None = None

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


Body = TypeVar("Body", bound=BaseModel)

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].role` from a pydantic location, leaving out the union-member tags pydantic
    inserts (`str`, `list[str]`, `TextPart`...)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def parse_request(body: bytes, model: type[Body]) -> Body:
    """Parse and validate a JSON request body strictly; an `APIError` (400) names what is wrong."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # Of a union's alternatives, the error that got deepest into the value says the most (`stop[1]`).
        first = max(errors, key=lambda error: len(_param(error["loc"]) or ""))
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json") from None
        if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
            raise APIError(400, "the request body must be a JSON object", code="invalid_json") from None
        param = _param(first["loc"])
        if first["type"] == "missing":
            raise APIError(400, f"missing required parameter '{param}'", param=param,
                           code="missing_required_parameter") from None
        raise APIError(400, f"invalid value for '{param}': {first['msg']} (got {_short(first.get('input'))})",
                       param=param, code="invalid_value") from None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # R1's thinking, as DeepSeek's API returns it
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Any = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: Any = None  # vLLM's, when asked for: one entry per prompt token (None for the first)


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: Any = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None
    prompt_logprobs: Any = None  # vLLM's: one entry per prompt token (None for the first) when asked for


class TextCompletion(BaseModel):
    """A `/v1/completions` response, or (with `usage` None and partial texts) one of its stream chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsr1"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Strict):
    """vLLM's `POST /tokenize`: a text `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a text prompt gets BOS
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: list[int]
