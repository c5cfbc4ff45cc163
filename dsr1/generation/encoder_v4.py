"""DeepSeek-V4's prompt encoder (the release's `encoding/encoding_dsv4.py`), in our own code, turn for
turn, quirks included:

- `reasoning_effort="max"` in thinking mode puts the release's directive before everything else;
- the system prompt is written as is, then its tools block ("## Tools", `tools` on the message)
  and `response_format`; a `developer` turn is a user turn carrying its own tools;
- tool results are no role of their own: each `tool` message becomes a `<tool_result>...</tool_result>`
  block of a user turn (consecutive results and a user text after them share that turn, joined by
  a blank line), in the order of the calls they answer (`tool_call_id`);
- after a user or developer turn that the reply follows, `<｜Assistant｜>` then `<think>` (thinking
  mode) or `</think>`; `latest_reminder` turns (`<｜latest_reminder｜>TEXT`) may come between;
- an assistant turn is its reasoning and `</think>` (thinking mode), its text, its calls in a DSML
  `tool_calls` block after a blank line, and EOS (none with `wo_eos`);
- `drop_thinking` (the default) drops the reasoning of assistant turns before the last user turn,
  and developer turns there, unless a message carries tools (agents keep their reasoning);
- a message's `task` (`action`, `query`, `authority`, `domain`, `title`, `read_url`) ends the
  prompt with that task's token instead.

`parse_completion` reads a completion back into the message it is (`dsml.parse_completion`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .dsml import DSML, calls_block, check_messages, last_user_turn, to_json
from .dsml import parse_completion as _parse
from .markup import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER

__all__ = ["BLOCK", "LATEST_REMINDER", "REASONING_EFFORT_MAX", "REASONING_EFFORTS", "ROLES", "TASKS",
           "encode_messages", "parse_completion", "tools_block"]

BLOCK = "tool_calls"
LATEST_REMINDER = "<｜latest_reminder｜>"
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
TASKS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
REASONING_EFFORTS = (None, "high", "max")
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

_TOOLS = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""  # noqa: E501 (the release's text, line for line)
_TOOLS_END = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools section for OpenAI-style `tools`: each function's JSON on its own line."""
    return _TOOLS + "\n".join(to_json(tool["function"]) for tool in tools) + _TOOLS_END


def _extras(msg: Mapping[str, Any]) -> str:
    out = "\n\n" + tools_block(msg["tools"]) if msg.get("tools") else ""
    if msg.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT + to_json(msg["response_format"])
    return out


# ---- tool results into user turns -----------------------------------------------------------------
def _merge_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each tool message as a `tool_result` block of a user turn; a user text right after results
    (or after another user text) joins that turn."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        msg = dict(msg)  # (only the merged turns' own block lists are changed later: no deeper copy needed)
        last = merged[-1] if merged and merged[-1].get("role") == "user" and "content_blocks" in merged[-1] else None
        if msg["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""), "content": msg.get("content")}
            if last is not None:
                last["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif msg["role"] == "user":
            text = {"type": "text", "text": msg.get("content", "")}
            if last is not None and last.get("task") is None:
                last["content_blocks"].append(text)
            else:
                merged.append({"role": "user", "content": msg.get("content", ""), "content_blocks": [text],
                               **{k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg}})
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict[str, Any]]) -> None:
    """Tool-result blocks of each user turn in the order of the calls of the assistant turn before it
    (by `tool_call_id`; a result whose id is unknown sorts first), in place."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {}
            for k, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = k
        elif msg["role"] == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b
                                         for b in msg["content_blocks"]]


def _result_text(content: Any) -> str:
    """A tool result's text: a string as is, content parts' texts joined by blank lines."""
    if isinstance(content, list):
        return "\n\n".join(b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                           for b in content)
    return f"{content}"


def _user_text(msg: Mapping[str, Any]) -> str:
    blocks = msg.get("content_blocks")
    if not blocks:
        return msg.get("content") or ""
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "tool_result":
            parts.append(f"<tool_result>{_result_text(block.get('content', ''))}</tool_result>")
        else:
            parts.append(f"[Unsupported {kind}]")
    return "\n\n".join(parts)


# ---- one message --------------------------------------------------------------------------------
def _decoded_calls(msg: Mapping[str, Any], index: int) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's tool calls as (name, decoded arguments); arguments that are not JSON
    become one `arguments` string, as the release does."""
    calls = []
    for j, call in enumerate(msg.get("tool_calls") or ()):
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"])
        except (TypeError, json.JSONDecodeError):
            arguments = {"arguments": fn["arguments"]}
        if not isinstance(arguments, dict):
            raise ValueError(f"messages[{index}]['tool_calls'][{j}].function.arguments must be a JSON object")
        calls.append((fn["name"], arguments))
    return calls


def _assistant(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool, drop: bool) -> str:
    msg = messages[index]
    calls = _decoded_calls(msg, index)
    tail = "\n\n" + calls_block(calls, BLOCK) if calls else ""
    after_task = index > 0 and messages[index - 1].get("task") is not None
    reasoning = ""
    if thinking and not after_task and (not drop or index > last_user_turn(messages)):
        reasoning = (msg.get("reasoning_content") or "") + THINK_END
    return reasoning + (msg.get("content") or "") + tail + ("" if msg.get("wo_eos", False) else EOS)


def _body(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool, drop: bool) -> str:
    msg = messages[index]
    role = msg["role"]
    if role == "system":
        return (msg.get("content") or "") + _extras(msg)
    if role == "developer":
        if not msg.get("content"):
            raise ValueError(f"messages[{index}]: a developer message needs content")
        return USER + msg["content"] + _extras(msg)
    if role == "user":
        return USER + _user_text(msg)
    if role == "latest_reminder":
        return LATEST_REMINDER + f"{msg.get('content')}"
    return _assistant(messages, index, thinking, drop)


def _transition(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool, drop: bool) -> str:
    """What follows message `index`: nothing before another user, system or developer turn; else a
    task's token, or the reply's opening after a user or developer turn."""
    if index + 1 < len(messages) and messages[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return ""
    task = messages[index].get("task")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"messages[{index}]['task'] must be one of {sorted(TASKS)}, got {task!r}")
        if task != "action":
            return TASKS[task]
        return ASSISTANT + (THINK_START if thinking else THINK_END) + TASKS[task]
    if messages[index]["role"] in ("user", "developer"):
        opens = thinking and (not drop or index >= last_user_turn(messages))
        return ASSISTANT + (THINK_START if opens else THINK_END)
    return ""


# ---- the conversation ---------------------------------------------------------------------------
def _drop_thinking(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant turns before the last user turn without their reasoning; turns there of roles other
    than user, system, tool and latest_reminder (developer) dropped."""
    last = last_user_turn(messages)
    out = []
    for i, m in enumerate(messages):
        if m["role"] in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last:
            out.append(m)
        elif m["role"] == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return out


def encode_messages(messages: Sequence[Mapping[str, Any]], thinking_mode: str = "chat",
                    context: Sequence[Mapping[str, Any]] | None = None, drop_thinking: bool = True,
                    add_default_bos_token: bool = True, reasoning_effort: str | None = None) -> str:
    """The prompt text of `messages` (after the already encoded `context`, if any) in
    `thinking_mode` "chat" or "thinking", as the release's `encode_messages` writes it."""
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    context = list(context or [])
    check_messages(context + list(messages), ROLES)
    merged_context = _merge_tool_results(context)
    full = merged_context + _merge_tool_results(messages)
    _sort_tool_results(full)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in full)
    start = len(merged_context)
    if thinking and drop:
        full = _drop_thinking(full)
        start = len(_drop_thinking(merged_context))
    prompt = BOS if add_default_bos_token and not context else ""
    if thinking and reasoning_effort == "max" and start == 0 and full:
        prompt += REASONING_EFFORT_MAX
    for i in range(start, len(full)):
        prompt += _body(full, i, thinking, drop) + _transition(full, i, thinking, drop)
    return prompt


def parse_completion(text: str, thinking_mode: str = "chat") -> dict[str, Any]:
    """A V4 completion (one assistant turn) as its message: content, reasoning_content and
    OpenAI-style tool_calls (arguments as JSON text). ValueError for malformed text."""
    return _parse(text, thinking_mode, BLOCK)
