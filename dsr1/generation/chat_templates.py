"""The chat templates of the DeepSeek-V3 line after R1, in plain Python, and which one a release carries.

Each release's `tokenizer_config.json` holds its own jinja `chat_template`; the model was trained on
exactly the text it renders, so each is reproduced here branch for branch, quirks included:

- `deepseek-r1` (R1, the default when a folder has no template): `tokenizer.render_chat`.
- `deepseek-v3-0324` (V3-0324): a user turn ends with `<｜Assistant｜>`; tool calls
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``; earlier
  answers are kept whole.
- `deepseek-r1-0528` (R1-0528): V3-0324's template with the reasoning of earlier turns dropped (the
  text after the last `</think>`); the model opens `<think>` itself.
- `deepseek-v3.1` (V3.1, V3.1-Terminus): hybrid thinking switched by `chat_template_kwargs`
  `{"thinking": true|false}` (default false): the generation prompt ends `<｜Assistant｜><think>` or
  `<｜Assistant｜></think>`; earlier answers keep the text after their first `</think>`; tool calls
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` chained without separators; tool
  results `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>` with no surrounding block.
- `deepseek-v3.2` (V3.2) and `deepseek-v4` (V4-Flash, V4-Pro): no jinja template but a Python
  encoder in the release (`encoder_v32`, `encoder_v4`), DSML tool calls; `chat_template_kwargs`
  `thinking` (default false: chat mode, as V3.1) and `drop_thinking` (default true), V4's also
  `reasoning_effort` (`"max"` puts the release's directive first; `"high"` is the default). Their
  releases have no template, so a folder's `config.json` `model_type` names them
  (`tokenizer.folder_chat_format`). The encoders always open the reply after a user turn: they
  have no `add_generation_prompt`.

`chat_format_of` tells which of these a template is, from marks only its family's text has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from . import encoder_v4, encoder_v32
from .markup import (
    ASSISTANT,
    BOS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    EOS,
    OUTPUT_BEGIN,
    OUTPUT_END,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    THINK_END,
    THINK_START,
    TOOL_SEP,
    USER,
    check_messages,
    render_chat,
)

__all__ = ["CHAT_FORMATS", "MODEL_TYPE_FORMATS", "ChatFormat", "TemplateKwargError", "chat_format", "chat_format_of",
           "render", "render_dsml", "render_v3", "render_v31", "template_kwargs"]


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """One release family's chat template: its name, how its tool calls are written (`"v3"`:
    ``function<｜tool▁sep｜>NAME`` + a fenced JSON block, R1's and V3-0324's; `"v3.1"`:
    ``NAME<｜tool▁sep｜>ARGS``; `"v3.2"` and `"v4"`: DSML `function_calls` / `tool_calls` blocks)
    and the `chat_template_kwargs` its template reads."""

    name: str
    tool_calls: str
    kwargs: tuple[str, ...] = ()


CHAT_FORMATS = {f.name: f for f in (ChatFormat("deepseek-r1", "v3"), ChatFormat("deepseek-v3-0324", "v3"),
                                    ChatFormat("deepseek-r1-0528", "v3"),
                                    ChatFormat("deepseek-v3.1", "v3.1", ("thinking",)),
                                    ChatFormat("deepseek-v3.2", "v3.2", ("thinking", "drop_thinking")),
                                    ChatFormat("deepseek-v4", "v4", ("thinking", "drop_thinking", "reasoning_effort")))}
# A release without a jinja template is known by its config.json's model_type.
MODEL_TYPE_FORMATS = {"deepseek_v32": "deepseek-v3.2", "deepseek_v4": "deepseek-v4"}


def chat_format(name: str) -> ChatFormat:
    """The `ChatFormat` called `name`; ValueError naming the known ones otherwise."""
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; known: {sorted(CHAT_FORMATS)}")
    return CHAT_FORMATS[name]


def chat_format_of(template: str | None, source: str = "chat_template") -> str:
    """The chat format of a release's jinja `chat_template` (None: R1's, the default). A template of
    none of the known families is a ValueError naming `source`: rendering it as another family's
    would feed the model text it was not trained on."""
    if template is None:
        return "deepseek-r1"
    if "thinking" in template and ASSISTANT + THINK_END in template and "is_prefix" not in template:
        return "deepseek-v3.1"
    if "+ content + '" + ASSISTANT + "'" in template and "split('" + THINK_END + "')" in template:
        return "deepseek-r1-0528"
    if "+ message['content'] + '" + ASSISTANT + "'" in template:
        return "deepseek-v3-0324"
    if ASSISTANT + THINK_START in template and "thinking" not in template:
        return "deepseek-r1"
    raise ValueError(f"{source}: the chat template is none of the DeepSeek templates dsr1 renders "
                     f"({', '.join(CHAT_FORMATS)}); pass a tokenizer_config.json from one of those releases")


class TemplateKwargError(ValueError):
    """A `chat_template_kwargs` entry the chat template cannot take; `param` names it."""

    def __init__(self, key: str, message: str) -> None:
        self.param = "chat_template_kwargs" + (f".{key}" if key else "")
        super().__init__(f"{self.param}: {message}")


def template_kwargs(fmt: ChatFormat, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`kwargs` checked against what `fmt`'s template reads; `TemplateKwargError` naming the key at fault."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TemplateKwargError("", f"must be a JSON object, got {type(kwargs).__name__}")
    kwargs = dict(kwargs or {})
    for key, value in kwargs.items():
        if key not in fmt.kwargs:
            takes = f"takes only {list(fmt.kwargs)}" if fmt.kwargs else "takes none"
            raise TemplateKwargError(key, f"the {fmt.name} chat template has no {key!r} switch (it {takes})")
        if key in ("thinking", "drop_thinking") and not isinstance(value, bool):
            raise TemplateKwargError(key, f"must be true or false, got {value!r}")
        if key == "reasoning_effort" and value not in encoder_v4.REASONING_EFFORTS:
            raise TemplateKwargError(key, f"must be one of {list(encoder_v4.REASONING_EFFORTS)}, got {value!r}")
    return kwargs


def render(name: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
           kwargs: Mapping[str, Any] | None = None) -> str:
    """`messages` as the `name` chat format's official template renders them, with its `kwargs`."""
    fmt = chat_format(name)
    kwargs = template_kwargs(fmt, kwargs)
    if name == "deepseek-r1":
        return render_chat(messages, add_generation_prompt)
    if name == "deepseek-v3.1":
        return render_v31(messages, add_generation_prompt, thinking=kwargs.get("thinking", False))
    if name in ("deepseek-v3.2", "deepseek-v4"):
        return render_dsml(name, messages, kwargs)
    return render_v3(messages, add_generation_prompt, drop_reasoning=name == "deepseek-r1-0528")


def render_dsml(name: str, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> str:
    """`messages` through V3.2's or V4's encoder (`name`), with the checked `kwargs` as its options."""
    mode = "thinking" if kwargs.get("thinking", False) else "chat"
    drop = kwargs.get("drop_thinking", True)
    if name == "deepseek-v3.2":
        return encoder_v32.encode_messages(messages, mode, drop_thinking=drop)
    effort = kwargs.get("reasoning_effort")
    return encoder_v4.encode_messages(messages, mode, drop_thinking=drop, reasoning_effort=effort)


def _system_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    return "\n\n".join(m["content"] for m in messages if m["role"] == "system")


def _v3_call(call: Mapping[str, Any], first: bool) -> str:
    fn = call["function"]
    body = f"{CALL_BEGIN}{call['type']}{TOOL_SEP}{fn['name']}\n```json\n{fn['arguments']}\n```{CALL_END}"
    return body if first else "\n" + body


def render_v3(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
              drop_reasoning: bool = False) -> str:
    """V3-0324's official template (R1-0528's with `drop_reasoning`: every assistant text, tool-call
    turns' and answers after tool results' too, keeps only what follows its last `</think>`)."""
    check_messages(messages)
    out = [BOS, _system_prompt(messages)]
    in_outputs = last_user = False
    first_output = True
    for m in messages:
        role, content = m["role"], m.get("content")
        if role == "assistant" and drop_reasoning and content is not None:
            content = content.split(THINK_END)[-1]
        if role == "user":
            in_outputs, last_user = False, True
            out.append(USER + content + ASSISTANT)
        elif role == "assistant" and m.get("tool_calls") is not None:
            last_user, first_output = False, True
            out.append(OUTPUTS_END if in_outputs else "")
            in_outputs = False
            for j, call in enumerate(m["tool_calls"]):
                out.append(((content or "") + CALLS_BEGIN if j == 0 else "") + _v3_call(call, j == 0))
            out.append(CALLS_END + EOS)
        elif role == "assistant":
            last_user = False
            out.append((OUTPUTS_END if in_outputs else "") + content + EOS)
            in_outputs = False
        elif role == "tool":
            last_user, in_outputs = False, True
            out.append((OUTPUTS_BEGIN if first_output else "\n") + OUTPUT_BEGIN + content + OUTPUT_END)
            first_output = False
    if in_outputs:
        out.append(OUTPUTS_END)
    elif add_generation_prompt and not last_user:
        out.append(ASSISTANT)
    return "".join(out)


def _v31_call(call: Mapping[str, Any]) -> str:
    fn = call["function"]
    return f"{CALL_BEGIN}{fn['name']}{TOOL_SEP}{fn['arguments']}{CALL_END}"


def render_v31(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               thinking: bool = False) -> str:
    """V3.1's official template. `thinking` opens the reply's `<think>` (else `</think>` closes it
    at once); an assistant message with `prefix: true` right after a user turn is a reply being
    continued, opened with `<think>` when thinking. Only a reply that follows a user turn gets
    `<｜Assistant｜>`: one after tool results continues right after them."""
    check_messages(messages)
    out = [BOS, _system_prompt(messages)]
    last_user = after_tool = False
    for m in messages:
        role, content = m["role"], m.get("content")
        if role == "user":
            last_user, after_tool = True, False
            out.append(USER + content)
        elif role == "assistant" and m.get("tool_calls") is not None:
            out.append(ASSISTANT + THINK_END if last_user else "")
            last_user = after_tool = False
            calls = [_v31_call(call) for call in m["tool_calls"]]
            out.append((((content or "") + CALLS_BEGIN) if calls else "") + "".join(calls) + CALLS_END + EOS)
        elif role == "assistant":
            if last_user:
                out.append(ASSISTANT + (THINK_START if m.get("prefix") and thinking else THINK_END))
            last_user = False
            if not after_tool and THINK_END in content:
                content = content.split(THINK_END, 1)[1]
            after_tool = False
            out.append(content + EOS)
        elif role == "tool":
            last_user, after_tool = False, True
            out.append(OUTPUT_BEGIN + content + OUTPUT_END)
    if add_generation_prompt and last_user:
        out.append(ASSISTANT + (THINK_START if thinking else THINK_END))
    return "".join(out)
