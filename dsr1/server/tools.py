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

V3.2 (`"v3.2"`) and V4 (`"v4"`) write DSML blocks, `function_calls` and `tool_calls`, after a
blank line (`dsr1.generation.dsml`)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="arg" string="false">1</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Their arguments are built as JSON from the parameters: a `string="true"` value encoded as a JSON
string, any other kept as written when it is JSON and encoded as a string when it is not (a
model's unquoted word), so the arguments always parse; streamed, each parameter goes out once its
end is read. Their tools are described by the release encoders themselves, from a system message's
`tools` (`with_tools`).

Text before `<｜tool▁calls▁begin｜>` (DSML: before the block and its blank line) is the reply's
content (vLLM's `deepseek_v3` / `deepseek_v31` parsers and SGLang's `deepseekv3` / `deepseekv31`
read the same formats). The V3 line's templates have no place for the tool definitions, so they
are given to the model in the system prompt (`tools_system_prompt`): for V3.1 in the words of its
model card, for R1 and V3-0324 in the format above, as vLLM's DeepSeek tool templates do.
`TOOL_FORMATS` names the formats; a tokenizer's chat format says which one its model writes
(`dsr1.generation.chat_templates`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from ..generation.dsml import DSML, arguments_json, invoke_markers, to_json
from ..generation.tokenizer import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP, Tokenizer
from .errors import APIError
from .guided import output_grammar, special_token
from .schema_bounds import SchemaBounds, bounded_schema, fitting_bounds

__all__ = ["DSML_BLOCKS", "TOOL_FORMATS", "ToolCall", "ToolCallSplitter", "ToolSpec", "calls_begin",
           "parse_tool_choice", "parse_tools", "split_tool_calls", "tool_call_grammar", "tools_system_prompt",
           "with_tools"]

TOOL_FORMATS = ("v3", "v3.1", "v3.2", "v4")
DSML_BLOCKS = {"v3.2": "function_calls", "v4": "tool_calls"}  # the DSML formats' call blocks
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


def with_tools(messages: list[dict[str, Any]], tools: list[ToolSpec], raw: Sequence[dict[str, Any]],
               tool_format: str) -> list[dict[str, Any]]:
    """`messages` with the request's tools described to the model as its format wants them: the
    DSML formats' encoders render the request's own tool objects (`raw`) from the first system
    message's `tools` (an empty system message is put first when there is none, as vLLM does);
    the others get `tools_system_prompt` as a system message."""
    _check_format(tool_format)
    if tool_format not in DSML_BLOCKS:
        return [*messages, {"role": "system", "content": tools_system_prompt(tools, tool_format)}]
    described = [{"type": "function", "function": tool["function"]} for tool in raw]
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": described}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": described}, *messages]


def tools_system_prompt(tools: list[ToolSpec], tool_format: str = "v3") -> str:
    """The tools described for the model, with the exact format of a call in `tool_format` (R1's,
    V3-0324's and V3.1's; the DSML formats' encoders describe their tools themselves)."""
    _check_format(tool_format)
    if tool_format in DSML_BLOCKS:
        raise ValueError(f"the {tool_format} encoder describes its tools itself: pass them with with_tools")
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
    if tool_format in DSML_BLOCKS:
        return _dsml_call_grammar(tools, choice, tokenizer, reasoning, DSML_BLOCKS[tool_format])

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


# A string parameter's value is raw text: bounded (by the schema's maxLength, else this) and without
# `<`, so it cannot run on past its budget nor write the parameter's end inside itself.
DSML_STRING_CHARS = 512
_PARAMETER_LINE_END = json.dumps(f"</{DSML}parameter>\n", ensure_ascii=False)


def _dsml_value_rule(prop: Any, defs: dict[str, Any]) -> tuple[bool, str]:
    """A property's value in a DSML call: (whether it is written as a string, its lark expression):
    a string schema's text as is (an enum's values, or up to maxLength characters), any other value
    as JSON valid against the property's schema."""
    prop = prop if isinstance(prop, dict) else {}
    if prop.get("type") == "string":
        if isinstance(prop.get("enum"), list) and all(isinstance(v, str) for v in prop["enum"]) and prop["enum"]:
            return True, "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in prop["enum"]) + ")"
        low, high = int(prop.get("minLength", 0)), int(prop.get("maxLength", DSML_STRING_CHARS))
        return True, f"/[^<]{{{low},{max(low, min(high, DSML_STRING_CHARS))}}}/"
    schema = {**({"$defs": defs} if defs else {}), **prop}
    return False, f"%json {json.dumps(_compact(schema), ensure_ascii=False)}"


def _dsml_invoke_rule(i: int, tool: ToolSpec) -> list[str]:
    """The rules of one call of `tool` (`call_i`): its parameters in the schema's order, the
    required ones always, the others optionally, no others (bounded keys: an open schema cannot
    make the model invent names without end)."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    defs = tool.parameters.get("$defs") or {}
    rules, parts = [], []
    for k, (key, prop) in enumerate(props.items()):
        is_string, value = _dsml_value_rule(prop, defs)
        head = f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">'
        rules.append(f"param_{i}_{k}: {json.dumps(head, ensure_ascii=False)} {value} {_PARAMETER_LINE_END}")
        parts.append(f"param_{i}_{k}" + ("" if key in required else "?"))
    head = json.dumps(f'<{DSML}invoke name="{tool.name}">\n' + ("" if props else "\n"), ensure_ascii=False)
    rules.append(f"call_{i}: {head} {' '.join(parts)} {json.dumps(_INVOKE_CLOSE, ensure_ascii=False)}")
    return rules


def _dsml_call_grammar(tools: list[ToolSpec], choice: str, tokenizer: Tokenizer, reasoning: int | None,
                       block: str) -> str:
    """`tool_call_grammar` for a DSML format: the block after its blank line (after `</think>` the
    reasoning grammar's newlines stand for it), its calls one per line."""
    chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
    rules = [rule for i, t in enumerate(chosen) for rule in _dsml_invoke_rule(i, t)]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    more = len(chosen) - 1 if choice == "required" else 0
    calls = f'call ("\\n" call){{0,{more}}}' if more else "call"
    opening = json.dumps(("" if reasoning is not None else "\n\n") + f"<{DSML}{block}>\n", ensure_ascii=False)
    closing = json.dumps(f"\n</{DSML}{block}>", ensure_ascii=False)
    return output_grammar(f"{opening} {calls} {closing}", tokenizer, reasoning, rules=rules, param="tools")


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


_INVOKE, _INVOKE_END, _PARAMETER, _ = invoke_markers()
_INVOKE_HEAD = re.compile(r' name="([^"\n]*)">\n?')
_PARAMETER_HEAD = re.compile(r' name="([^"\n]*)" string="(true|false)">')
_PARAMETER_CLOSE = f"</{DSML}parameter>"
_INVOKE_CLOSE = _INVOKE_END + ">"
Parsed = tuple[list[tuple[str, str, bool]], bool]  # the calls read (name, arguments, complete), well formed so far


def _dsml_value(value: str, is_string: bool) -> str:
    """A parameter's JSON: a string encoded; another value as written when it is JSON, else (a
    model's unquoted word) encoded as a string, so the arguments always parse."""
    if not is_string:
        try:
            json.loads(value)
            return value
        except json.JSONDecodeError:
            pass
    return to_json(value)


def _dsml_parameter(text: str, at: int, final: bool) -> tuple[tuple[str, str, bool] | None, int, bool]:
    """The parameter at `at` (just after `<｜DSML｜parameter`): (name, value, string) or None while
    it is incomplete, where reading goes on, and whether the text is well formed so far."""
    head = _PARAMETER_HEAD.match(text, at)
    if head is None:
        return None, at, not final and ">" not in text[at:] and "\n" not in text[at:]
    close = text.find(_PARAMETER_CLOSE, head.end())
    if close < 0:
        return None, at, not final
    return (head.group(1), text[head.end():close], head.group(2) == "true"), close + len(_PARAMETER_CLOSE), True


def _dsml_invoke(text: str, at: int, final: bool) -> tuple[tuple[str, str, bool] | None, int, bool]:
    """The invoke at `at` (just after `<｜DSML｜invoke`): (name, arguments so far, complete) or None
    while its name is coming, where reading goes on, and whether the text is well formed so far.
    The arguments grow by whole parameters: each one's JSON once its end is read, `}` at the end."""
    named = _INVOKE_HEAD.match(text, at)
    if named is None:
        return None, at, not final and ">" not in text[at:] and "\n" not in text[at:]
    parameters: list[tuple[str, str, bool]] = []
    pos = named.end()
    while True:
        while text.startswith("\n", pos):
            pos += 1
        complete = text.startswith(_INVOKE_CLOSE, pos)
        if complete or not text.startswith(_PARAMETER, pos):
            rest = text[pos:]
            ok = complete or (not final and (_INVOKE_CLOSE.startswith(rest) or _PARAMETER.startswith(rest)))
            break
        found, pos, ok = _dsml_parameter(text, pos + len(_PARAMETER), final)
        if found is None:
            break
        parameters.append(found)
    body = arguments_json([(k, _dsml_value(v, s), False) for k, v, s in parameters])
    arguments = body if complete else body[:-1]
    return (named.group(1), arguments, complete), pos + len(_INVOKE_CLOSE) if complete else pos, ok


def _parse_dsml(text: str, final: bool, block: str) -> Parsed:
    """The calls in `text` (what follows `<｜DSML｜BLOCK>`) and whether it is well formed so far (at
    the end, `final`: every call complete; a block left open at the end is tolerated, as the
    official parser does)."""
    calls: list[tuple[str, str, bool]] = []
    end, pos = f"</{DSML}{block}>", 0
    while True:
        while text.startswith("\n", pos):
            pos += 1
        rest = text[pos:]
        if rest.startswith(end) or not rest:
            return calls, rest.startswith(end) or not final or bool(calls)
        if not rest.startswith(_INVOKE):
            return calls, not final and (_INVOKE.startswith(rest) or end.startswith(rest))
        found, pos, ok = _dsml_invoke(text, pos + len(_INVOKE), final)
        if found is not None:
            calls.append(found)
        if found is None or not found[2] or not ok:
            return calls, ok and not final


@dataclasses.dataclass(frozen=True)
class _Format:
    """How a tool format's calls begin (`begin`, the text the content ends before), how many
    newlines before it are markup (`trim`: the DSML block's blank line), and the reader of the
    calls after it."""

    begin: str
    read: Callable[[str, bool], Parsed]
    trim: int = 0

    def content_end(self, text: str, at: int) -> int:
        """Where the content ends, for calls that begin at `at`."""
        return at - min(self.trim, at - len(text[:at].rstrip("\n")))

    def held(self, text: str) -> int:
        """How many characters at the end of streamed `text` might still turn out to be markup."""
        k = _partial_suffix(text, self.begin)
        body = text[:len(text) - k]
        return k + min(self.trim, len(body) - len(body.rstrip("\n")))


_FORMATS = {"v3": _Format(CALLS_BEGIN, functools.partial(_parse, call_at=_v3_call)),
            "v3.1": _Format(CALLS_BEGIN, functools.partial(_parse, call_at=_v31_call)),
            **{name: _Format(f"<{DSML}{block}>", functools.partial(_parse_dsml, block=block), trim=2)
               for name, block in DSML_BLOCKS.items()}}


def calls_begin(tool_format: str) -> str:
    """The text that begins a reply's calls in `tool_format`."""
    _check_format(tool_format)
    return _FORMATS[tool_format].begin


def split_tool_calls(text: str, tool_format: str = "v3") -> tuple[str, list[ToolCall]] | None:
    """A finished reply's (content, calls) in `tool_format`, or None when it begins no calls (then
    the whole text is the content). The markup never lands in the content: a reply cut short inside
    its calls (`max_tokens`) gives the calls read so far, the last one `complete` False."""
    _check_format(tool_format)
    fmt = _FORMATS[tool_format]
    start = text.find(fmt.begin)
    if start < 0:
        return None
    parsed, _ = fmt.read(text[start + len(fmt.begin):], True)
    return text[:fmt.content_end(text, start)], [ToolCall(_new_id(), name, args, complete)
                                                 for name, args, complete in parsed]


class ToolCallSplitter:
    """Split a streamed reply's content into content deltas and OpenAI `tool_calls` deltas: a call's
    first delta has its index, id, type and name (arguments ""), the next ones more of its arguments,
    as the `openai` client joins them. Text that could begin the calls is held back (DSML: with the
    blank line before them). `tool_format`: how the model writes its calls (`TOOL_FORMATS`)."""

    def __init__(self, tool_format: str = "v3") -> None:
        _check_format(tool_format)
        self._format = _FORMATS[tool_format]
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
        fmt = self._format
        if self._calls_at is None:
            at = self._raw.find(fmt.begin)
            if at >= 0:
                self._calls_at = at
            else:
                stable = len(self._raw) if final else len(self._raw) - fmt.held(self._raw)
                content, self._content_sent = self._raw[self._content_sent:stable], stable
                return content, []
        parsed, _ = fmt.read(self._raw[self._calls_at + len(fmt.begin):], final)
        end = fmt.content_end(self._raw, self._calls_at)
        content = self._raw[self._content_sent:end]
        self._content_sent = max(self._content_sent, end)
        return content, self._call_deltas(parsed)

    def _call_deltas(self, parsed: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
        """The deltas that bring the sent calls up to `parsed`."""
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
        return deltas
