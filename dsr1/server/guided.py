"""Structured outputs: a request's output constraint as an llguidance grammar (lark), which the
engine applies as a token mask on every step (`Engine.submit(..., grammar=...)`).

Accepted spellings, at most one per request:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}` and its
  older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (lark).

A chat prompt that opens R1's `<think>` gets the constraint after the reasoning: any text, then
`</think>`, then the constrained answer (as vLLM does with a reasoning parser), so the reasoning
goes to `reasoning_content` and the answer to `content`. The reasoning is free but bounded: after
its budget of tokens (`reasoning_budget`) the grammar forces `</think>`, so a model that would
reason past the request's `max_tokens` still gives the constrained answer. JSON is compact (no
free whitespace): a model cannot spend its budget on blank space.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from ..generation.tokenizer import THINK_END, Tokenizer
from .errors import APIError

__all__ = ["Constraint", "checked_grammar", "constraint_of", "output_grammar", "reasoning_budget", "special_token"]

_COMPACT = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One output constraint: the lark expression of the answer (`body`), or a whole lark grammar of
    the user's (`grammar`), and the request field it came from."""

    body: str
    param: str
    user_grammar: bool = False

    def grammar(self, tokenizer: Tokenizer, reasoning: int | None) -> str:
        """The output's grammar for a prompt that opened R1's `<think>` (`reasoning`: the most tokens
        the reasoning may take) or not (None)."""
        if not self.user_grammar:
            return output_grammar(self.body, tokenizer, reasoning, param=self.param)
        if reasoning is not None:
            raise APIError(400, f"{self.param} applies to the whole output, and this prompt opens R1's reasoning: "
                                "use it with /v1/completions, or use a JSON schema, regex or choice",
                           param=self.param, code="unsupported_parameter")
        from llguidance import LLMatcher

        return checked_grammar(LLMatcher.grammar_from_lark(self.body), self.param)


def _json_body(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param} is not valid JSON: {e}", param=param, code="invalid_value") from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param, code="invalid_value")
    schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
    return f"%json {json.dumps(schema, ensure_ascii=False)}"


def _regex_body(pattern: Any, param: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise APIError(400, f"{param} must be a non-empty regular expression", param=param, code="invalid_value")
    return "/" + pattern.replace("/", "\\/") + "/"


def _choice_body(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise APIError(400, f"{param} must be a non-empty list of non-empty strings", param=param,
                       code="invalid_value")
    return "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + ")"


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(_json_body({"type": "object"}, "response_format"), "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format json_schema needs {'name': ..., 'schema': {...}}",
                           param="response_format.json_schema", code="invalid_value")
        return Constraint(_json_body(spec.get("schema", {}), "response_format.json_schema.schema"),
                          "response_format")
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type", code="invalid_value")


_VLLM = {"json": _json_body, "regex": _regex_body, "choice": _choice_body}


def constraint_of(body: Any) -> Constraint | None:
    """The request's constraint (None: free output), or a 400 naming the field that is malformed or
    the second constraint of a request that sets two."""
    found: list[Constraint] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        constraint = _response_format(fmt)
        if constraint is not None:
            found.append(constraint)
    structured = getattr(body, "structured_outputs", None) or {}
    for key, value in structured.items():
        param = f"structured_outputs.{key}"
        if value is None or value is False:
            continue
        if key in _VLLM:
            found.append(Constraint(_VLLM[key](value, param), param))
        elif key == "json_object":
            found.append(Constraint(_json_body({"type": "object"}, param), param))
        elif key == "grammar":
            found.append(Constraint(_grammar_body(value, param), param, user_grammar=True))
        elif key not in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                         "whitespace_pattern", "backend"):
            raise APIError(400, f"structured_outputs.{key} is not supported", param=param,
                           code="unsupported_parameter")
    for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(body, key, None)
        if value is not None:
            make = _grammar_body if key == "guided_grammar" else _VLLM[key.removeprefix("guided_")]
            found.append(Constraint(make(value, key), key, user_grammar=key == "guided_grammar"))
    if len(found) > 1:
        raise APIError(400, f"at most one output constraint per request, got {found[0].param} and {found[1].param}",
                       param=found[1].param, code="invalid_value")
    return found[0] if found else None


def _grammar_body(grammar: Any, param: str) -> str:
    """A user's lark grammar (with its own `start` rule)."""
    if not isinstance(grammar, str) or "start" not in grammar:
        raise APIError(400, f"{param} must be a lark grammar with a 'start' rule", param=param, code="invalid_value")
    return grammar


def special_token(tokenizer: Tokenizer, text: str, param: str) -> str:
    """The lark reference to one token of the vocabulary by id (`<[id]>`), so the grammar asks for
    that token and not its text spelled in pieces."""
    token_id = tokenizer.backend.token_to_id(text)
    if token_id is None:
        raise APIError(400, f"the model's vocabulary has no {text!r} token", param=param,
                       code="unsupported_parameter")
    return f"<[{token_id}]>"


def reasoning_budget(requested: int | None, default: int, max_tokens: int) -> int:
    """The most tokens a constrained reply's reasoning may take: the request's `max_reasoning_tokens`
    (else the server's `default`), and at most a quarter of its `max_tokens`, so the answer has the rest."""
    return min(default if requested is None else requested, max_tokens // 4)


def output_grammar(answer: str, tokenizer: Tokenizer, reasoning: int | None, *, rules: Sequence[str] = (),
                   param: str | None = None) -> str:
    """The whole output's grammar (llguidance's serialized form): an answer matching the lark
    expression `answer` (with extra `rules`), after free reasoning of at most `reasoning` tokens and
    `</think>` (None: the prompt opened no reasoning; 0: `</think>` first). Raises `APIError` (400,
    naming `param`) when llguidance rejects it."""
    from llguidance import LLMatcher

    lines = [f"start: {answer}", *rules]
    if reasoning is not None:
        if reasoning < 0:
            raise ValueError(f"reasoning budget must be >= 0, got {reasoning}")
        think_end = special_token(tokenizer, THINK_END, param or "messages")
        free = "reasoning " if reasoning else ""
        # At most two newlines after </think> (R1 writes two): unbounded blank lines could eat the budget.
        lines[0] = f"start: {free}{think_end} /\\n{{0,2}}/ {answer}"
        if reasoning:
            lines.append(f"reasoning[max_tokens={reasoning}]: /(?s:.*)/")
    return checked_grammar(LLMatcher.grammar_from_lark("\n".join(lines)), param)


def checked_grammar(grammar: str, param: str | None) -> str:
    """`grammar` if llguidance accepts it, else a 400 naming `param`."""
    from llguidance import LLMatcher

    message = LLMatcher.validate_grammar(grammar)
    if message:
        raise APIError(400, f"the output constraint is not a valid grammar: {message}", param=param,
                       code="invalid_value")
    return grammar
