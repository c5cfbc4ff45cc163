"""DeepSeek's chat markup: the special tokens of its templates, the checks every chat's messages
pass, and R1's official `chat_template` in plain Python (`render_chat`), which the other releases'
templates (`chat_templates`) build on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"

_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError naming the message index and field for anything the template cannot render."""
    if isinstance(messages, (str, Mapping)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {_ROLES}, got {role!r}")
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}]['tool_calls'] must be a list, got {type(calls).__name__}")
            for j, call in enumerate(calls):
                for field in ("type", "function.name", "function.arguments"):
                    value = _get(call, *field.split("."))
                    if not isinstance(value, str):
                        raise ValueError(f"messages[{i}]['tool_calls'][{j}].{field} must be a string (arguments as "
                                         f"a JSON string), got {type(value).__name__}")
            if m.get("content") is not None and not isinstance(m["content"], str):
                raise ValueError(f"messages[{i}]['content'] must be a string or None")
        elif not isinstance(m.get("content"), str):
            what = "is missing" if "content" not in m else f"must be a string, got {type(m['content']).__name__}"
            raise ValueError(f"messages[{i}]['content'] {what} (role {role!r})")


def _get(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]..., or None where a level is missing or not a dict."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render `messages` exactly as R1's official jinja chat template does (including its quirks).

    Roles: system (all concatenated with blank lines, right after BOS, wherever they appear), user,
    assistant (optionally with OpenAI-style `tool_calls`, whose `arguments` is a JSON string) and tool.
    Like `transformers`, a `tool_calls` of None counts as absent; a tool-call message's content may be
    None or missing (the template's `content is none` branch).
    """
    check_messages(messages)
    out = [BOS, "\n\n".join(m["content"] for m in messages if m["role"] == "system")]
    # The template's namespace flags. `calls_seen` and `outputs_seen` are never reset, so only the first
    # tool-call message of the whole chat opens with <｜Assistant｜><｜tool▁calls▁begin｜> (later ones start
    # with "\n<｜tool▁call▁begin｜>" and lose their content) and only the first tool output opens the block.
    in_tool_outputs = calls_seen = outputs_seen = False
    for m in messages:
        role = m["role"]
        if role == "user":
            in_tool_outputs = False
            out.append(USER + m["content"])
        elif role == "assistant" and m.get("tool_calls") is not None:
            in_tool_outputs = False
            for call in m["tool_calls"]:
                fn = call["function"]
                body = f"{CALL_BEGIN}{call['type']}{TOOL_SEP}{fn['name']}\n```json\n{fn['arguments']}\n```{CALL_END}"
                if not calls_seen:
                    out.append(ASSISTANT + (m.get("content") or "") + CALLS_BEGIN + body)
                    calls_seen = True
                else:
                    out.append("\n" + body)
            out.append(CALLS_END + EOS)
        elif role == "assistant":
            if in_tool_outputs:
                # The answer after tool outputs closes the block and, unlike a plain turn, keeps its reasoning.
                out.append(OUTPUTS_END + m["content"] + EOS)
                in_tool_outputs = False
            else:
                # Earlier turns' reasoning is dropped: only the text after the last </think> is kept.
                out.append(ASSISTANT + m["content"].split(THINK_END)[-1] + EOS)
        elif role == "tool":
            in_tool_outputs = True
            out.append(("" if outputs_seen else OUTPUTS_BEGIN) + OUTPUT_BEGIN + m["content"] + OUTPUT_END)
            outputs_seen = True
    # Note: a user turn right after tool outputs does not close the block; only an assistant turn or the end does.
    if in_tool_outputs:
        out.append(OUTPUTS_END)
    elif add_generation_prompt:
        out.append(ASSISTANT + THINK_START + "\n")
    return "".join(out)
