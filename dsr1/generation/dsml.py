"""DSML, the markup of V3.2's and V4's tool calls, shared by their prompt encoders (`encoder_v32`,
`encoder_v4`): a call block and how a completion is read back into a message.

A call block (`BLOCK` is `function_calls` for V3.2, `tool_calls` for V4)::

    <｜DSML｜BLOCK>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="N" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜BLOCK>

A string argument is written as is (`string="true"`), any other value as JSON (`string="false"`);
reading a call back gives its arguments as JSON text in which the strings are encoded and the other
values are kept as written (`arguments_json`). The block follows the reply's text after a blank line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .markup import BOS, EOS, THINK_END, THINK_START

__all__ = ["DSML", "arguments_json", "calls_block", "check_messages", "invoke_markers", "last_user_turn",
           "parse_completion", "to_json"]

DSML = "｜DSML｜"
_INVOKE, _INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke"
_PARAMETER, _PARAMETER_END = f"<{DSML}parameter", f"/{DSML}parameter"
_NAME = re.compile(r'^\s*name="(.*?)">\n$', flags=re.DOTALL)
_PARAMETER_BODY = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', flags=re.DOTALL)


def invoke_markers() -> tuple[str, str, str, str]:
    """The openings of an invoke, of its end, of a parameter and of a parameter's end (without the
    `<` of the last: the official reader searches for `/｜DSML｜parameter`)."""
    return _INVOKE, _INVOKE_END, _PARAMETER, _PARAMETER_END


def to_json(value: Any) -> str:
    """JSON text of `value` as the encoders write it: non-ASCII kept, unless it cannot be (lone
    surrogates), then escaped."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (UnicodeEncodeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def check_messages(messages: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> None:
    """ValueError naming the message and field for what the encoder cannot write."""
    if isinstance(messages, (str, Mapping)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in roles:
            raise ValueError(f"messages[{i}] must be a dict whose 'role' is one of {tuple(roles)}, got "
                             f"{m.get('role') if isinstance(m, Mapping) else type(m).__name__!r}")
        content = m.get("content")
        if m["role"] in ("user", "tool", "latest_reminder") and not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a string (role {m['role']!r})")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a string or None")
        for j, call in enumerate(m.get("tool_calls") or () if m["role"] == "assistant" else ()):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ValueError(f"messages[{i}]['tool_calls'][{j}] must be {{'function': {{'name', 'arguments'}}}}")


def _parameters(arguments: Mapping[str, Any]) -> str:
    """The parameter lines of one call's arguments."""
    lines = []
    for key, value in arguments.items():
        text, is_string = (value, "true") if isinstance(value, str) else (to_json(value), "false")
        lines.append(f'<{DSML}parameter name="{key}" string="{is_string}">{text}</{DSML}parameter>')
    return "\n".join(lines)


def calls_block(calls: Sequence[tuple[str, Mapping[str, Any]]], block: str) -> str:
    """The call block of `calls` (name, decoded arguments), as an assistant turn writes it."""
    invokes = [f'<{DSML}invoke name="{name}">\n{_parameters(arguments)}\n</{DSML}invoke>' for name, arguments in calls]
    return f"<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def arguments_json(parameters: Sequence[tuple[str, str, bool]]) -> str:
    """A call's arguments as JSON text from its parameters (name, value as written, whether
    `string="true"`): strings encoded, other values as written."""
    return "{" + ", ".join(f"{to_json(k)}: {to_json(v) if s else v}" for k, v, s in parameters) + "}"


def _read_until(text: str, at: int, stops: Sequence[str]) -> tuple[int, str, str | None]:
    """From `at`, the text before the first of `stops` to occur: (where reading goes on, that text,
    the stop found or None when none occurs: then the rest of the text)."""
    found = [(pos, stop) for stop in stops if (pos := text.find(stop, at)) >= 0]
    if not found:
        return len(text), text[at:], None
    pos, stop = min(found, key=lambda f: f[0])
    return pos + len(stop), text[at:pos], stop


def _read_parameters(text: str, at: int) -> tuple[int, list[tuple[str, str, bool]], str | None]:
    """An invoke's parameters, from just after its name line's `<｜DSML｜parameter`: (where reading
    goes on, the parameters, the stop that ended them)."""
    parameters: list[tuple[str, str, bool]] = []
    stop: str | None = _PARAMETER
    while stop == _PARAMETER:
        at, body, stop = _read_until(text, at, [_PARAMETER_END])
        match = _PARAMETER_BODY.match(body)
        if match is None:
            raise ValueError(f"DSML parameter format error: {body[:80]!r}")
        name, string, value = match.groups()
        if name in {p[0] for p in parameters}:
            raise ValueError(f"DSML call repeats the parameter {name!r}")
        parameters.append((name, value, string == "true"))
        at, between, stop = _read_until(text, at, [_PARAMETER, _INVOKE_END])
        if between != ">\n":
            raise ValueError(f"DSML parameter format error after {name!r}: {between[:80]!r}")
    return at, parameters, stop


def _read_calls(text: str, at: int, block: str) -> tuple[int, list[dict[str, str]]]:
    """The calls of a block, from just after its `<｜DSML｜BLOCK` opening, each {name, arguments}:
    (where reading goes on, the calls)."""
    calls, end = [], f"</{DSML}{block}>"
    while at < len(text):
        at, before, stop = _read_until(text, at, [_INVOKE, end])
        if before != ">\n":
            raise ValueError(f"DSML tool-call format error: expected '>\\n', got {before[:80]!r}")
        if stop == end:
            break
        if stop is None:
            raise ValueError(f"DSML tool calls end without {end}")
        at, head, stop = _read_until(text, at, [_PARAMETER, _INVOKE_END])
        name = _NAME.match(head)
        if name is None:
            raise ValueError(f"DSML tool name format error: {head[:80]!r}")
        parameters: list[tuple[str, str, bool]] = []
        if stop == _PARAMETER:
            at, parameters, stop = _read_parameters(text, at)
        calls.append({"name": name.group(1), "arguments": arguments_json(parameters)})
    return at, calls


def parse_completion(text: str, thinking_mode: str, block: str) -> dict[str, Any]:
    """A well-formed completion (one assistant turn, EOS included or not) as the message it is:
    role, content, reasoning_content and OpenAI-style tool_calls. ValueError on anything else: this
    reads what the encoder writes and corrects nothing."""
    calls_start = f"\n\n<{DSML}{block}"
    at, reasoning, calls = 0, "", []
    if thinking_mode == "thinking":
        at, reasoning, stop = _read_until(text, at, [THINK_END, calls_start])
        if stop != THINK_END:
            raise ValueError(f"the completion's reasoning does not end with {THINK_END}")
    at, content, stop = _read_until(text, at, [EOS, calls_start])
    if stop == calls_start:
        at, calls = _read_calls(text, at, block)
        at, rest, stop = _read_until(text, at, [EOS])
        if rest:
            raise ValueError(f"text after the tool calls: {rest[:80]!r}")
    elif stop != EOS:
        raise ValueError("the completion ends without EOS or tool calls")
    if at != len(text) or stop not in (EOS, None):
        raise ValueError("text after the completion's end")
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise ValueError(f"{token!r} inside the completion's text")
    tool_calls = [{"type": "function", "function": call} for call in calls]
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


def last_user_turn(messages: Sequence[Mapping[str, Any]]) -> int:
    """The index of the last user (or developer) message, -1 if none: the encoders think after it
    and drop earlier turns' reasoning before it."""
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)
