"""From a parsed request to what the engine runs: prompt token ids, one `Sampling` per choice and
the output grammar of each prompt, after every check that needs the tokenizer, the model or the
server's limits (unknown model, unsupported features, empty or malformed messages, tools and
output constraints, log-probabilities asked for wrongly, token ids outside the vocabulary, a
prompt or a budget that does not fit the context). Each failure is an `APIError` naming the field.

Defaults follow OpenAI's API: temperature 1 and top_p 1; `/v1/completions` generates 16 tokens
unless told otherwise; a chat request without a budget gets `ServerConfig.default_max_tokens`,
capped by the context left after its prompt. vLLM's sampling parameters are honoured as vLLM
does (`bad_words` tokenized with and without a leading space) or refused by name
(`use_beam_search`, `length_penalty`, `logits_processors`, `best_of` other than `n`, ...).

`check_size` runs on the event loop before any tokenization: a text whose bytes could not fit the
context even at the vocabulary's longest token is refused at once, so a huge prompt costs nothing.
The planning itself (tokenization, grammars) runs on a worker thread (`completions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..core.config import outside_vocabulary
from ..generation.chat_templates import TemplateKwargError, chat_format, template_kwargs
from ..generation.output import opens_thinking
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer
from .errors import APIError
from .guided import constraint_of, reasoning_budget
from .protocol import MAX_STOP_STRINGS, ChatCompletionRequest, ChatMessage, CompletionRequest, TokenizeRequest
from .tools import ToolSpec, parse_tool_choice, parse_tools, tool_call_grammar, with_tools

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "Limits", "Plan", "check_size", "plan_chat", "plan_completion",
           "plan_tokenize"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias in [-100, 100]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What requests are checked against: the model's id, the context (prompt + output tokens a
    request may hold), the vocabulary, the default budget of a chat request, the most bytes one
    token of the vocabulary stands for (for `check_size`), and the default reasoning budget of a
    constrained reply to a prompt that opens R1's `<think>` (`guided.reasoning_budget`)."""

    model_name: str
    context: int
    vocab_size: int
    default_max_tokens: int
    max_token_bytes: int = 1
    max_reasoning_tokens: int = 512


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: its prompts' token ids and `n` settings per prompt (prompt-major: choice
    `i` runs prompt `i // n`), each prompt's output grammar (None: free), the tools a chat reply may
    call (`tool_choice` "none", "auto", "required" or a function's name), and what of the prompt the
    reply repeats (`echo`: its text; `prompt_logprobs`: alternatives per prompt token)."""

    prompts: list[list[int]]
    samplings: list[Sampling]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None = None  # None: no log-probabilities; else alternatives per output token
    grammars: tuple[str | None, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "none"
    tool_format: str = "v3"  # how the model writes its calls (`tools.TOOL_FORMATS`)
    echo: tuple[str, ...] | None = None  # each prompt's text, repeated before its choices' outputs
    prompt_logprobs: int | None = None  # alternatives per prompt token the engine records (None: none)
    report_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field in the reply (not only echo's)
    discard_output: bool = False  # max_tokens 0 with echo: the one token generated is not returned

    def choice_prompts(self) -> list[list[int]]:
        """The prompt of every choice."""
        return [self.prompts[i // self.n] for i in range(len(self.samplings))]

    def choice_grammars(self) -> list[str | None]:
        """The output grammar of every choice."""
        return [self.grammars[i // self.n] if self.grammars else None for i in range(len(self.samplings))]

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def check_size(body: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    """Refuse, before tokenizing it, a prompt whose UTF-8 bytes need more tokens than the context
    holds even if every token were the vocabulary's longest."""
    if isinstance(body, ChatCompletionRequest):
        texts = [(f"messages[{i}].content", m.text() or "") for i, m in enumerate(body.messages)]
        size, param = sum(len(t.encode()) for _, t in texts), "messages"
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        size = max((len(p.encode()) for p in prompts if isinstance(p, str)), default=0)
        param = "prompt"
    least = -(-size // max(limits.max_token_bytes, 1))
    if least > limits.context:
        raise APIError(400, f"the prompt has {size} bytes, at least {least} tokens, but this model's context is "
                            f"{limits.context} tokens (prompt and output together); shorten the prompt",
                       param=param, code="context_length_exceeded")


def template_switches(body: ChatCompletionRequest, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """The request's `chat_template_kwargs`, with DeepSeek's `thinking: {"type": ...}` as the template's
    `thinking` switch where the model's template has one (V3.1, V3.2, V4) and `reasoning_effort` as
    V4's (its "max" directive; any other effort is its default, "high"), where the kwargs do not set
    them already. R1's and V3-0324's templates have none: R1 always thinks, V3-0324 never does."""
    kwargs = body.chat_template_kwargs
    fmt = chat_format(tokenizer.chat_format) if tokenizer.chat_format else None
    if fmt is None or not isinstance(kwargs, dict | None):
        return kwargs  # (kwargs of another type: the template's check names them)
    switches: dict[str, Any] = {}
    if body.thinking is not None and "thinking" in fmt.kwargs:
        switches["thinking"] = body.thinking.type == "enabled"
    if body.reasoning_effort is not None and "reasoning_effort" in fmt.kwargs:  # V4 knows "high" and "max"
        switches["reasoning_effort"] = "max" if body.reasoning_effort == "max" else "high"
    return {**switches, **(kwargs or {})} if switches else kwargs


def plan_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, limits: Limits) -> Plan:
    """Check a chat request and encode its messages (and tools) with the model's chat template
    (`tokenizer.chat_format`), with the request's `chat_template_kwargs`."""
    _check_common(body, limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if body.echo:
        raise APIError(400, "echo is not supported on chat completions", param="echo", code="unsupported_parameter")
    if body.token_budget == 0:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{param} must be at least 1", param=param, code="invalid_value")
    if not body.messages:
        raise APIError(400, "messages must contain at least one message", param="messages", code="invalid_value")
    tools = parse_tools(body.tools or [])
    choice = parse_tool_choice(body.tool_choice, tools)
    messages = _template_messages(body.messages)
    # (A tokenizer without a template fails to render below, with the reason.)
    tool_format = chat_format(tokenizer.chat_format).tool_calls if tokenizer.chat_format else "v3"
    if tools and choice != "none":
        messages = with_tools(messages, tools, body.tools or [], tool_format)
    prompt = _render(tokenizer, messages, True, template_switches(body, tokenizer))
    prompt = _truncated(prompt, body.truncate_prompt_tokens)
    constraint = constraint_of(body)
    thinking = opens_thinking(prompt, tokenizer)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    budget = _budget(len(prompt), body.token_budget, limits.default_max_tokens, limits.context, "messages", param)
    reasoning = reasoning_budget(body.max_reasoning_tokens, limits.max_reasoning_tokens, budget) if thinking else None
    if choice not in ("none", "auto"):
        # The reply is calls alone: a text format beside it (agents send theirs every turn) shapes no text.
        grammar = tool_call_grammar(tools, choice, tokenizer, reasoning, tool_format, budget)
    else:
        grammar = constraint.grammar(tokenizer, reasoning) if constraint is not None else None
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # The reply's markers (tool calls, and R1's </think> where the vocabulary makes it special) must reach the parsers.
    keep_special = (tools and choice != "none") or thinking
    return Plan([prompt], _samplings(body, [budget], tokenizer, limits, keep_special=bool(keep_special)), body.n,
                body.stream, body.include_usage, top_logprobs, grammars=(grammar,), tools=tuple(tools),
                tool_choice=choice, tool_format=tool_format, prompt_logprobs=body.prompt_logprobs,
                report_prompt_logprobs=body.prompt_logprobs is not None)


def plan_completion(body: CompletionRequest, tokenizer: Tokenizer, limits: Limits) -> Plan:
    """Check a completions request and encode its prompt(s) (text with BOS, or token ids as given)."""
    _check_common(body, limits)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    given = _prompt_list(body.prompt)
    prompts = [_truncated(_encode(p, tokenizer, limits), body.truncate_prompt_tokens) for p in given]
    discard = body.max_tokens == 0
    if discard and not body.echo:
        raise APIError(400, "max_tokens 0 needs echo: true (the reply is then the prompt alone)", param="max_tokens",
                       code="invalid_value")
    budgets = [_budget(len(p), 1 if discard else body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, limits.context,
                       "prompt", "max_tokens") for p in prompts]
    constraint = constraint_of(body)
    reasoning = [reasoning_budget(body.max_reasoning_tokens, limits.max_reasoning_tokens, b)
                 if opens_thinking(p, tokenizer) else None for p, b in zip(prompts, budgets)]
    grammars = tuple(None if constraint is None else constraint.grammar(tokenizer, r) for r in reasoning)
    echo = tuple(p if isinstance(p, str) and body.truncate_prompt_tokens is None else tokenizer.decode(q)
                 for p, q in zip(given, prompts)) if body.echo else None
    # echo with logprobs: the prompt's tokens get theirs too (OpenAI's legacy API, lm-evaluation-harness).
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    return Plan(prompts, _samplings(body, budgets, tokenizer, limits), body.n, body.stream, body.include_usage,
                body.logprobs, grammars=grammars, echo=echo, prompt_logprobs=prompt_logprobs,
                report_prompt_logprobs=body.prompt_logprobs is not None, discard_output=discard)


def plan_tokenize(body: TokenizeRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    """`/tokenize`'s token ids: a text prompt (with BOS when `add_special_tokens`) or chat messages
    rendered by the template."""
    if body.model is not None and body.model != limits.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{limits.model_name}'",
                       param="model", code="model_not_found")
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt", code="invalid_value")
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_bos=body.add_special_tokens)
    return _render(tokenizer, _template_messages(body.messages), body.add_generation_prompt,
                   body.chat_template_kwargs)


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
            kwargs: dict[str, Any] | None) -> list[int]:
    """The token ids of `messages` through the chat template, or a 400 naming the field at fault."""
    try:
        if tokenizer.chat_format:
            template_kwargs(chat_format(tokenizer.chat_format), kwargs)
    except TemplateKwargError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt, kwargs)
    except ValueError as e:
        raise APIError(400, f"messages cannot be rendered: {e}", param="messages", code="invalid_value") from None


# ---- checks ----------------------------------------------------------------------------------------
def _check_common(body: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    if body.model != limits.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{limits.model_name}'",
                       param="model", code="model_not_found")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                       code="invalid_value")
    refused = [("use_beam_search", body.use_beam_search, "beam search is not supported"),
               ("length_penalty", body.length_penalty != 1.0, "length_penalty applies to beam search only"),
               ("logits_processors", bool(body.logits_processors), "custom logits processors are not supported"),
               ("spaces_between_special_tokens", not body.spaces_between_special_tokens,
                "special tokens are always decoded without spaces between them"),
               ("best_of", body.best_of is not None and body.best_of != body.n,
                "best_of other than n is not supported")]
    for param, refuse, why in refused:
        if refuse:
            raise APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")
    if body.min_tokens and body.token_budget is not None and body.min_tokens > body.token_budget:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({body.token_budget})",
                       param="min_tokens", code="invalid_value")
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
        if m.reasoning_content is not None:  # read by the encoders that keep it (V3.2's, V4's)
            message["reasoning_content"] = m.reasoning_content
        if m.tool_call_id is not None:  # V4's encoder orders results as the calls they answer
            message["tool_call_id"] = m.tool_call_id
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
    check_token_ids(prompt, "prompt", limits)
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


def _truncated(prompt: list[int], keep: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens."""
    return prompt if keep is None else prompt[-keep:]


def check_token_ids(ids: Sequence[int], param: str, limits: Limits) -> None:
    """A 400 naming `param` and the first of `ids` outside the model's vocabulary, if any."""
    if ids and (problem := outside_vocabulary(ids, limits.vocab_size)) is not None:
        raise APIError(400, problem, param=param, code="invalid_value")


def _token_ids(ids: list[int] | None, param: str, limits: Limits) -> tuple[int, ...]:
    check_token_ids(ids or (), param, limits)
    return tuple(ids or ())


def _logit_bias(bias: dict[str, float] | None, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token id strings to a bias in [-100, 100]) as (id, bias) pairs."""
    out = []
    for key, value in (bias or {}).items():
        param = f"logit_bias.{key}"
        if not key.isdigit() or not 0 <= int(key) < limits.vocab_size:
            raise APIError(400, f"logit_bias keys are token ids in [0, {limits.vocab_size}), got {key!r}", param=param,
                           code="invalid_value")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise APIError(400, f"a logit bias is in [-100, 100], got {value}", param=param, code="invalid_value")
        out.append((int(key), float(value)))
    return tuple(out)


def bad_words_ids(words: list[str] | None, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token sequences: each word as written and, when that makes other
    tokens of the same count, with a leading space (the word inside a text)."""
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words or ()):
        if not word.strip():
            raise APIError(400, "bad words must not be empty", param=f"bad_words[{i}]", code="invalid_value")
        plain = tuple(tokenizer.encode(word.lstrip()))
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


# Sampling's fields beyond the basic ones, with the value that leaves the output unchanged.
_NEUTRAL: dict[str, Any] = {"min_tokens": 0, "ignore_eos": False, "logit_bias": (), "allowed_token_ids": (),
                            "bad_words_ids": (), "include_stop_str_in_output": False, "skip_special_tokens": False}
_REQUEST_PARAM = {"bad_words_ids": "bad_words"}


def _engine_fields(fields: dict[str, Any], requested: set[str]) -> dict[str, Any]:
    """`fields` less the ones this engine's `Sampling` lacks; a 400 naming the request parameter when
    one of those is `requested` with anything but its neutral value."""
    known = {f.name for f in dataclasses.fields(Sampling)}
    for name in [n for n in fields if n not in known]:
        if fields.pop(name) != _NEUTRAL[name] and _REQUEST_PARAM.get(name, name) in requested:
            param = _REQUEST_PARAM.get(name, name)
            raise APIError(400, f"{param} is not supported by this engine", param=param,
                           code="unsupported_parameter")
    return fields


def _samplings(body: ChatCompletionRequest | CompletionRequest, budgets: list[int], tokenizer: Tokenizer,
               limits: Limits, *, keep_special: bool = False) -> list[Sampling]:
    """`n` settings per prompt: the request's sampling fields, its stops, the prompt's budget, and
    seeds `seed + i` so seeded choices differ from one another and repeat across calls.
    `keep_special`: decode special tokens whatever the request says (the reply's parsers read them)."""
    fields = dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_strings=body.stop_strings(),
        stop_token_ids=_token_ids(body.stop_token_ids, "stop_token_ids", limits),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        logit_bias=_logit_bias(body.logit_bias, limits),
        allowed_token_ids=_token_ids(body.allowed_token_ids, "allowed_token_ids", limits),
        bad_words_ids=bad_words_ids(body.bad_words, tokenizer),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens and not keep_special,
    )
    fields = _engine_fields(fields, body.model_fields_set)
    seeds = [None if body.seed is None else (body.seed + i) % 2**64 for i in range(body.n)]
    try:
        return [Sampling(**fields, seed=seed, max_new_tokens=budget) for budget in budgets for seed in seeds]
    except ValueError as e:  # the protocol's ranges are Sampling's, so this is a bug if it happens
        raise APIError(400, str(e), code="invalid_value") from None
