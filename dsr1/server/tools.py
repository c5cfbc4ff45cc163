"""Function calling in DeepSeek's formats: the tools described to the model, its calls parsed out
of the reply (whole or streamed as OpenAI's `tool_calls` deltas), and the grammar that makes
`tool_choice` `required` or a named function always produce calls whose arguments parse.

The model writes calls as its release chat template renders them in earlier turns. R1, V3-0324 and
R1-0528 (tool format `"v3"`)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": 1}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 and V3.1-Terminus (`"v3.1"`), calls chained without separators::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(shown on two lines here; the model writes no newline between calls).

Text before `<｜tool▁calls▁begin｜>` is the reply's content (vLLM's `deepseek_v3` / `deepseek_v31`
parsers and SGLang's `deepseekv3` / `deepseekv31` read the same formats). The release templates have
no place for the tool definitions, so they are given to the model in the system prompt
(`tools_system_prompt`): for V3.1 in the words of its model card, for the others in the format
above, as vLLM's DeepSeek tool templates do. `TOOL_FORMATS` names the formats; a tokenizer's chat
format says which one its model writes (`dsr1.generation.chat_templates`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from ..generation.tokenizer import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP, Tokenizer
from .errors import APIError
from .guided import output_grammar, special_token
from .schema_bounds import SchemaBounds, bounded_schema, fitting_bounds

__all__ = ["TOOL_FORMATS", "ToolCall", "ToolCallSplitter", "ToolSpec", "parse_tool_choice", "parse_tools",
           "split_tool_calls", "tool_call_grammar", "tools_system_prompt"]

TOOL_FORMATS = ("v3", "v3.1")
_ARGS_OPEN = "\n```json\n"
_ARGS_CLOSE = "\n```" + CALL_END


def _check_format(tool_format: str) -> None:
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {tool_format!r}; known: {TOOL_FORMATS}")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One function the request offers: its name, description and JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


def parse_tools(tools: Sequence[dict[str, Any]]) -> list[ToolSpec]:
    """The request's `tools`, checked (an `APIError` naming `tools[i]...` for anything malformed)."""
    specs = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise APIError(400, f"only function tools are supported, got type {tool.get('type')!r}",
                           param=f"tools[{i}].type", code="invalid_value")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, "a tool needs function.name (a non-empty string)", param=f"tools[{i}].function.name",
                           code="invalid_value")
        if any(c in fn["name"] for c in "\n`<>\"") or len(fn["name"]) > 64:
            raise APIError(400, f"invalid function name {fn['name']!r} (at most 64 characters, no newline, quote, "
                                "backtick or angle bracket)", param=f"tools[{i}].function.name", code="invalid_value")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise APIError(400, "function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters", code="invalid_value")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise APIError(400, "function.description must be a string", param=f"tools[{i}].function.description",
                           code="invalid_value")
        specs.append(ToolSpec(fn["name"], description, parameters))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise APIError(400, f"tool names must be unique, got {names}", param="tools", code="invalid_value")
    return specs


def parse_tool_choice(choice: str | dict[str, Any] | None, tools: list[ToolSpec]) -> str:
    """`tool_choice` as "none", "auto", "required" or the name of the function that must be called."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                           param="tool_choice", code="invalid_value")
        if choice != "none" and not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice", code="invalid_value")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice", code="invalid_value")
    if name not in {t.name for t in tools}:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice", code="invalid_value")
    return name


def tools_system_prompt(tools: list[ToolSpec], tool_format: str = "v3") -> str:
    """The tools described for the model, with the exact format of a call in `tool_format`."""
    _check_format(tool_format)
    lines = ["## Tools", "You have access to the following tools:"]
    for t in tools:
        lines += ["", f"### {t.name}", f"Description: {t.description}", "",
                  f"Parameters: {json.dumps(t.parameters, ensure_ascii=False)}"]
    lines += ["", "IMPORTANT: ALWAYS adhere to this exact format for tool use:"]
    if tool_format == "v3.1":  # V3.1's model card, word for word
        return "\n".join([*lines, f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{CALL_END}"
                                   f"{{{{additional_tool_calls}}}}{CALLS_END}", "", "Where:", "",
                           "- `tool_call_name` must be an exact match to one of the available tools",
                           "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters "
                           "Schema", "- For multiple tool calls, chain them directly without separators or spaces"])
    lines += [f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}tool_call_name{_ARGS_OPEN}tool_call_arguments"
              f"{_ARGS_CLOSE}{{additional_tool_calls}}{CALLS_END}", "",
              "Where `tool_call_name` is exactly one of the tools' names and `tool_call_arguments` is valid JSON "
              "for the tool's parameters. Additional calls follow on new lines, in the same format."]
    return "\n".join(lines)


def tool_call_grammar(tools: list[ToolSpec], choice: str, tokenizer: Tokenizer, reasoning: int | None,
                      tool_format: str = "v3", budget: int | None = None) -> str:
    """The llguidance grammar of a reply that must call tools, written in `tool_format`: one or more
    calls of any of `tools` (`choice` "required") or exactly one of the named function, each call's
    arguments valid against its schema, with what the schema leaves open bounded
    (`schema_bounds`) so the calls fit the reply's `budget` of tokens (None: the default bounds).
    `reasoning`: the prompt opened `<think>`, so the reply reasons first, for at most that many
    tokens (None: it did not)."""
    _check_format(tool_format)

    def special(text: str) -> str:
        return special_token(tokenizer, text, "tools")

    chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
    chosen = _bounded_tools(chosen, None if budget is None else budget - (reasoning or 0))
    if tool_format == "v3.1":
        rules = [f"call_{i}: {json.dumps(t.name)} {special(TOOL_SEP)} %json {json.dumps(_compact(t.parameters))} "
                 f"{special(CALL_END)}" for i, t in enumerate(chosen)]
        head, between = special(CALL_BEGIN), ""
    else:
        close = json.dumps(_ARGS_CLOSE.removesuffix(CALL_END))
        rules = [f"call_{i}: {json.dumps(t.name)} {json.dumps(_ARGS_OPEN)} %json {json.dumps(_compact(t.parameters))} "
                 f"{close} {special(CALL_END)}" for i, t in enumerate(chosen)]
        head, between = f'{special(CALL_BEGIN)} "function" {special(TOOL_SEP)}', '"\\n" '
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    rules.append(f"call: {head} ({alternatives})")
    # "required": up to one call per offered tool, so the calls end within the reply's budget.
    more = len(chosen) - 1 if choice == "required" else 0  # lark's {0,0} is an error: no repeat then
    calls = f"call ({between}call){{0,{more}}}" if more else "call"
    return output_grammar(f"{special(CALLS_BEGIN)} {calls} {special(CALLS_END)}", tokenizer, reasoning, rules=rules,
                          param="tools")


def _bounded_tools(tools: list[ToolSpec], budget: int | None) -> list[ToolSpec]:
    """`tools` with their schemas bounded so that as many calls as the grammar allows fit in `budget`
    tokens (at one character a token, after each call's markup)."""
    markup = max(len(t.name) for t in tools) + 12  # a call's markers, name, fences, newlines (tokens)
    bounds = SchemaBounds() if budget is None else fitting_bounds(
        [t.parameters for t in tools], budget - len(tools) * markup, len(tools))
    return [dataclasses.replace(t, parameters=bounded_schema(t.parameters, bounds)) for t in tools]


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with llguidance told to write JSON without free whitespace (a model cannot spend its
    budget on blank space)."""
    return {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}


@dataclasses.dataclass
class ToolCall:
    """A call as parsed so far: its id, function name and arguments text (`complete` once its end
    marker was read)."""

    id: str
    name: str
    arguments: str
    complete: bool = False

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


def _calls_end(text: str, pos: int, calls: list[tuple[str, str, bool]], final: bool) -> tuple[bool, bool]:
    """At `pos`, between calls: (whether the calls end here, whether the text is well formed so far)."""
    if text.startswith(CALLS_END, pos) or pos == len(text):
        return True, not final or text.startswith(CALLS_END, pos) or (pos == len(text) and bool(calls))
    if not text.startswith(CALL_BEGIN, pos):
        return True, CALL_BEGIN.startswith(text[pos:]) and not final
    return False, True


Call = tuple[str, int, str]  # a call's function name, where its arguments start, and the marker ending them


def _v3_call(text: str, head: int, final: bool) -> tuple[Call | None, bool]:
    """A call in R1's / V3-0324's format from `head` (after `<｜tool▁call▁begin｜>`):
    `TYPE<｜tool▁sep｜>NAME` then the arguments in a json block; None (and whether the text is well
    formed so far) while its name or the block's opening is still coming."""
    sep = text.find(TOOL_SEP, head)
    opened = text.find(_ARGS_OPEN, sep + len(TOOL_SEP)) if sep >= 0 else -1
    if opened < 0:
        return None, (not final and "\n" not in text[sep + len(TOOL_SEP):]) if sep >= 0 else not final
    return (text[sep + len(TOOL_SEP):opened], opened + len(_ARGS_OPEN), _ARGS_CLOSE), True


def _v31_call(text: str, head: int, final: bool) -> tuple[Call | None, bool]:
    """A call in V3.1's format from `head`: `NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`; None (and whether
    the text is well formed so far) while its name is still coming, one line."""
    sep = text.find(TOOL_SEP, head)
    if sep < 0:
        return None, not final and "\n" not in text[head:]
    name = text[head:sep]
    if "\n" in name:
        return None, False
    return (name, sep + len(TOOL_SEP), CALL_END), True


def _parse(text: str, final: bool, call_at: Callable[[str, int, bool], tuple[Call | None, bool]]
           ) -> tuple[list[tuple[str, str, bool]], bool]:
    """The calls in `text` (what follows `<｜tool▁calls▁begin｜>`), each read by `call_at` (the format's):
    (name, arguments so far, complete) for each call whose name is known, and whether the text is
    well formed so far (at the end, `final`: every call complete). Newlines between calls are
    tolerated, as vLLM's parsers do."""
    calls: list[tuple[str, str, bool]] = []
    pos = 0
    while True:
        while text.startswith("\n", pos):
            pos += 1
        done, ok = _calls_end(text, pos, calls, final)
        if done:
            return calls, ok
        found, ok = call_at(text, pos + len(CALL_BEGIN), final)
        if found is None:
            return calls, ok
        name, args_at, end = found
        close = text.find(end, args_at)
        if close < 0:
            rest = text[args_at:]
            calls.append((name, rest[:len(rest) - _partial_suffix(rest, end)], False))
            return calls, not final
        calls.append((name, text[args_at:close], True))
        pos = close + len(end)


_PARSERS = {"v3": functools.partial(_parse, call_at=_v3_call),
            "v3.1": functools.partial(_parse, call_at=_v31_call)}


def split_tool_calls(text: str, tool_format: str = "v3") -> tuple[str, list[ToolCall]] | None:
    """A finished reply's (content, calls) in `tool_format`, or None when it begins no calls (then
    the whole text is the content). The markup never lands in the content: a reply cut short inside
    its calls (`max_tokens`) gives the calls read so far, the last one `complete` False."""
    _check_format(tool_format)
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return None
    parsed, _ = _PARSERS[tool_format](text[start + len(CALLS_BEGIN):], final=True)
    return text[:start], [ToolCall(_new_id(), name, args, complete) for name, args, complete in parsed]


class ToolCallSplitter:
    """Split a streamed reply's content into content deltas and OpenAI `tool_calls` deltas: a call's
    first delta has its index, id, type and name (arguments ""), the next ones more of its arguments,
    as the `openai` client joins them. Text that could begin `<｜tool▁calls▁begin｜>` is held back.
    `tool_format`: how the model writes its calls (`TOOL_FORMATS`)."""

    def __init__(self, tool_format: str = "v3") -> None:
        _check_format(tool_format)
        self._parse = _PARSERS[tool_format]
        self._raw = ""
        self._calls_at: int | None = None  # where the calls begin in `_raw`
        self._content_sent = 0
        self._sent: list[ToolCall] = []  # what was sent of each call

    @property
    def calls(self) -> list[ToolCall]:
        return self._sent

    def push(self, piece: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Add content text; returns (content delta, tool-call deltas)."""
        self._raw += piece
        if self._calls_at is None:
            at = self._raw.find(CALLS_BEGIN)
            if at >= 0:
                self._calls_at = at
            else:
                stable = len(self._raw) if final else len(self._raw) - _partial_suffix(self._raw, CALLS_BEGIN)
                content, self._content_sent = self._raw[self._content_sent:stable], stable
                return content, []
        parsed, _ = self._parse(self._raw[self._calls_at + len(CALLS_BEGIN):], final)
        content = self._raw[self._content_sent:self._calls_at]
        self._content_sent = max(self._content_sent, self._calls_at)
        deltas = []
        for index, (name, arguments, complete) in enumerate(parsed):
            if index == len(self._sent):
                self._sent.append(ToolCall(_new_id(), name, ""))
                deltas.append({"index": index, "id": self._sent[index].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            call = self._sent[index]
            if len(arguments) > len(call.arguments):
                deltas.append({"index": index, "function": {"arguments": arguments[len(call.arguments):]}})
                call.arguments = arguments
            call.complete = complete
        return content, deltas
