"""From a parsed request to what the engine runs: prompt token ids and one `Sampling` per choice,
after every check that needs the tokenizer, the model or the server's limits (unknown model,
unsupported features, empty or malformed messages,
log-probabilities asked for wrongly, token ids outside the vocabulary, a prompt or a
budget that does not fit the context). Each failure is an `APIError` naming the field.

Defaults follow OpenAI's API: temperature 1 and top_p 1; `/v1/completions` generates 16 tokens
unless told otherwise; a chat request without a budget gets `ServerConfig.default_max_tokens`,
capped by the context left after its prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer
from .errors import APIError
from .protocol import MAX_STOP_STRINGS, ChatCompletionRequest, ChatMessage, CompletionRequest

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "Limits", "Plan", "plan_chat", "plan_completion"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Limits:
    """What requests are checked against: the model's id, the context (prompt + output tokens a
    request may hold), the vocabulary, and the default budget of a chat request."""

    model_name: str
    context: int
    vocab_size: int
    default_max_tokens: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: its prompts' token ids and `n` settings per prompt (prompt-major: choice
    `i` runs prompt `i // n`)."""

    prompts: list[list[int]]
    samplings: list[Sampling]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None = None  # None: no log-probabilities; else alternatives per output token

    def choice_prompts(self) -> list[list[int]]:
        """The prompt of every choice."""
        return [self.prompts[i // self.n] for i in range(len(self.samplings))]


def plan_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, limits: Limits) -> Plan:
    """Check a chat request and encode its messages with R1's chat template."""
    _check_common(body, limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if body.tools:
        raise APIError(400, "tools (function calling) are not supported", param="tools", code="unsupported_parameter")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format",
                       code="unsupported_parameter")
    if not body.messages:
        raise APIError(400, "messages must contain at least one message", param="messages", code="invalid_value")
    try:
        prompt = tokenizer.apply_chat_template(_template_messages(body.messages))
    except ValueError as e:
        raise APIError(400, f"messages cannot be rendered: {e}", param="messages", code="invalid_value") from None
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    budget = _budget(len(prompt), body.token_budget, limits.default_max_tokens, limits.context, "messages", param)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return Plan([prompt], _samplings(body, [budget]), body.n, body.stream, body.include_usage, top_logprobs)


def plan_completion(body: CompletionRequest, tokenizer: Tokenizer, limits: Limits) -> Plan:
    """Check a completions request and encode its prompt(s) (text with BOS, or token ids as given)."""
    _check_common(body, limits)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    prompts = [_encode(p, tokenizer, limits) for p in _prompt_list(body.prompt)]
    budgets = [_budget(len(p), body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, limits.context, "prompt", "max_tokens")
               for p in prompts]
    return Plan(prompts, _samplings(body, budgets), body.n, body.stream, body.include_usage, body.logprobs)


# ---- checks ----------------------------------------------------------------------------------------
def _check_common(body: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    if body.model != limits.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{limits.model_name}'",
                       param="model", code="model_not_found")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                       code="invalid_value")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    for i, stop in enumerate(body.stop_strings()):
        if not stop:
            raise APIError(400, "stop strings must not be empty", param=f"stop[{i}]", code="invalid_value")
    if len(body.stop_strings()) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(body.stop_strings())}", param="stop",
                       code="invalid_value")


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as R1's chat template takes them (`developer` is a system message; text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"only text content parts are supported, got a {part.type!r} part",
                               param=f"messages[{i}].content[{j}].type", code="unsupported_content")
        text = m.text()
        if text is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages[{i}].content is required for a {m.role} message",
                           param=f"messages[{i}].content", code="invalid_value")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        out.append(message)
    return out


def _prompt_list(prompt: str | list[int] | list[str | list[int]]) -> list[str | list[int]]:
    """The prompts of a completions request: one text, one list of ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _encode(prompt: str | list[int], tokenizer: Tokenizer, limits: Limits) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    if not prompt:
        raise APIError(400, "a prompt of token ids must not be empty", param="prompt", code="invalid_value")
    bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", param="prompt",
                       code="invalid_value")
    return list(prompt)


def _budget(prompt_tokens: int, requested: int | None, default: int, context: int, prompt_param: str,
            budget_param: str) -> int:
    """The request's token budget; an error naming the numbers when the prompt or the budget does not
    fit the context (prompt + output tokens)."""
    if prompt_tokens >= context:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens, but this model's context is {context} tokens "
                            "(prompt and output together); shorten the prompt", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return min(default, context - prompt_tokens)
    if prompt_tokens + requested > context:
        raise APIError(400, f"this model's context is {context} tokens, but {prompt_tokens + requested} were requested "
                            f"({prompt_tokens} in the prompt, {requested} for the output); lower {budget_param} to at "
                            f"most {context - prompt_tokens}", param=budget_param, code="context_length_exceeded")
    return requested


def _samplings(body: ChatCompletionRequest | CompletionRequest, budgets: list[int]) -> list[Sampling]:
    """`n` settings per prompt: the request's sampling fields, its stops, the prompt's budget, and
    seeds `seed + i` so seeded choices differ from one another and repeat across calls."""
    fields = dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_strings=body.stop_strings(),
    )
    seeds = [None if body.seed is None else (body.seed + i) % 2**64 for i in range(body.n)]
    try:
        return [Sampling(**fields, seed=seed, max_new_tokens=budget) for budget in budgets for seed in seeds]
    except ValueError as e:  # the protocol's ranges are Sampling's, so this is a bug if it happens
        raise APIError(400, str(e), code="invalid_value") from None
