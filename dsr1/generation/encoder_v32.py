"""DeepSeek-V3.2's prompt encoder (the release's `encoding/encoding_dsv32.py`, not a jinja template),
in our own code, turn for turn, quirks included:

- the system prompt is written as is (no marker), followed by the tools block (`tools` on the
  message, OpenAI style) and a `response_format` schema when the message has them;
- a user turn is `<｜User｜>TEXT<｜Assistant｜>` then `<think>` (the last user turn in thinking mode)
  or `</think>`; a `developer` turn is a user turn that carries its tools and says
  "# The user's message is: ...";
- an assistant turn is its reasoning and `</think>` (thinking mode, after the last user turn only),
  its text, its calls in a DSML `function_calls` block after a blank line, and EOS;
- tool results follow the calls as `<function_results>` / `<result>...</result>`, then `<think>` or
  `</think>` opens the next reply;
- in thinking mode with `drop_thinking` (the default) assistant turns before the last user turn
  lose their reasoning, and developer turns there are dropped.

`parse_completion` reads a completion back into the message it is (`dsml.parse_completion`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .dsml import DSML, calls_block, check_messages, last_user_turn, to_json
from .dsml import parse_completion as _parse
from .markup import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER

__all__ = ["BLOCK", "ROLES", "encode_messages", "parse_completion", "tools_block"]

BLOCK = "function_calls"
ROLES = ("system", "developer", "user", "assistant", "tool")

_TOOLS = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{DSML}function_calls>
...
</{DSML}function_calls>

<function_results>
...
</function_results>

{THINK_START}...thinking about results{THINK_END}

Here are the functions available in JSONSchema format:
<functions>
"""  # noqa: E501 (the release's text, line for line)
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools section of the system prompt for OpenAI-style `tools` (`{"type": "function",
    "function": {...}}`): each function's JSON on its own line."""
    return _TOOLS + "\n".join(to_json(tool["function"]) for tool in tools) + "\n</functions>\n"


def _extras(msg: Mapping[str, Any]) -> str:
    """The tools block and response format a system or developer message carries."""
    out = "\n\n" + tools_block(msg["tools"]) if msg.get("tools") else ""
    if msg.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT + to_json(msg["response_format"])
    return out


def _decoded_calls(msg: Mapping[str, Any], index: int) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's OpenAI-style tool calls as (name, decoded arguments)."""
    calls = []
    for j, call in enumerate(msg.get("tool_calls") or ()):
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"])
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"messages[{index}]['tool_calls'][{j}].function.arguments must be a JSON object's "
                             f"text ({e})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"messages[{index}]['tool_calls'][{j}].function.arguments must be a JSON object")
        calls.append((fn["name"], arguments))
    return calls


def _assistant(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool) -> str:
    msg = messages[index]
    calls = _decoded_calls(msg, index)
    tail = "\n\n" + calls_block(calls, BLOCK) if calls else ""
    reasoning = ""
    if thinking and index > last_user_turn(messages):
        if not (msg.get("reasoning_content") or calls):
            raise ValueError(f"messages[{index}]: in thinking mode an assistant turn after the last user turn needs "
                             "reasoning_content or tool_calls")
        reasoning = (msg.get("reasoning_content") or "") + THINK_END
    return reasoning + (msg.get("content") or "") + tail + EOS


def _tool(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool) -> str:
    """One tool result, opening the results block after the calls or closing it after the last."""
    owner = index - 1
    while owner >= 0 and messages[owner].get("role") == "tool":
        owner -= 1
    order = index - owner
    calls = messages[owner].get("tool_calls") if owner >= 0 and messages[owner].get("role") == "assistant" else None
    if not calls or len(calls) < order:
        raise ValueError(f"messages[{index}]: a tool result without an assistant tool call before it to answer")
    out = ("\n\n<function_results>" if order == 1 else "") + f"\n<result>{messages[index]['content']}</result>"
    if order == len(calls):
        thinks = thinking and index >= last_user_turn(messages)
        out += "\n</function_results>\n\n" + (THINK_START if thinks else THINK_END)
    return out


def _user(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool) -> str:
    msg = messages[index]
    text = msg["content"]
    if msg["role"] == "developer":
        if not text:
            raise ValueError(f"messages[{index}]: a developer message needs content")
        text = _extras(msg) + f"\n\n# The user's message is: {text}"
    opens = THINK_START if thinking and index == last_user_turn(messages) else THINK_END
    return USER + text + ASSISTANT + opens


def _render(messages: Sequence[Mapping[str, Any]], index: int, thinking: bool) -> str:
    role = messages[index]["role"]
    if role == "system":
        return (messages[index].get("content") or "") + _extras(messages[index])
    if role in ("user", "developer"):
        return _user(messages, index, thinking)
    if role == "tool":
        return _tool(messages, index, thinking)
    return _assistant(messages, index, thinking)


def _drop_thinking(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Turns before the last user turn without their reasoning; developer turns there dropped."""
    last = last_user_turn(messages)
    out: list[Mapping[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] in ("user", "system", "tool") or i >= last:
            out.append(m)
        elif m["role"] == "assistant":
            kept = copy.copy(dict(m))
            kept.pop("reasoning_content", None)
            out.append(kept)
    return out


def encode_messages(messages: Sequence[Mapping[str, Any]], thinking_mode: str = "chat",
                    context: Sequence[Mapping[str, Any]] | None = None, drop_thinking: bool = True,
                    add_default_bos_token: bool = True) -> str:
    """The prompt text of `messages` (after the already encoded `context`, if any) in
    `thinking_mode` "chat" or "thinking", as the release's `encode_messages` writes it."""
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    context = list(context or [])
    full = context + list(messages)
    check_messages(full, ROLES)
    thinking = thinking_mode == "thinking"
    if thinking and drop_thinking:
        full = _drop_thinking(full)
        if len(full) < len(context) + len(messages):
            raise ValueError("V3.2's encoder drops developer messages before the last user turn in thinking mode "
                             "(with drop_thinking) and then cannot render the conversation; send them as system")
    prompt = BOS if add_default_bos_token and not context else ""
    return prompt + "".join(_render(full, i, thinking) for i in range(len(context), len(full)))


def parse_completion(text: str, thinking_mode: str = "chat") -> dict[str, Any]:
    """A V3.2 completion (one assistant turn) as its message: content, reasoning_content and
    OpenAI-style tool_calls (arguments as JSON text). ValueError for malformed text."""
    return _parse(text, thinking_mode, BLOCK)
