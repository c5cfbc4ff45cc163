"""The V3 line's chat templates (V3-0324, R1-0528, V3.1) rendered by dsr1 byte for byte as jinja2 renders
the official templates (tests/data/chat_templates), on a held-out set of random conversations and on
hand-written ones; which template a release folder carries; the thinking switch. No model needed."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest

from dsr1.generation.chat_templates import TemplateKwargError, chat_format_of, render
from dsr1.generation.output import opens_thinking
from dsr1.generation.tokenizer import (
    BOS,
    EOS,
    Tokenizer,
    folder_chat_format,
    load_tokenizer,
    packaged_tokenizer_json,
)

DATA = Path(__file__).parent / "data"
TEMPLATES = {name: (DATA / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")
             for name in ("deepseek-v3.1", "deepseek-v3-0324", "deepseek-r1-0528")}
R1_TEMPLATE = json.loads((DATA / "deepseek-r1-tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
LLAMA_CPP_V31 = (DATA / "chat_templates" / "deepseek-v3.1.llama-cpp.jinja").read_text(encoding="utf-8")


@functools.cache
def compiled(template: str):
    """The template compiled by jinja2 set up as transformers sets it up."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def jinja_render(template: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    return compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=BOS, eos_token=EOS, **kwargs)


def call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


TEXTS = ["Hi", "", "What is 2+2?", "  spaces \n", "你好，世界 🙂", "<think>\nstep 1\n</think>\n\nx = 2.",
         "<think>a</think>mid<think>b</think>\n\nend", "no reasoning; <think> alone", "</think>leading close",
         f"say {EOS} literally", "line\nbreaks\n\n", '{"json": true}']


def random_conversation(rng: random.Random) -> list[dict]:
    """A conversation of random turns: system prompts anywhere, users, answers with and without
    reasoning, tool-call turns (content or none, one to three calls), tool results, and continued
    (`prefix`) replies."""
    messages: list[dict] = []
    for _ in range(rng.randint(1, 9)):
        kind = rng.choice(["system", "user", "user", "assistant", "assistant", "calls", "tool", "tool", "prefix"])
        text = rng.choice(TEXTS)
        if kind == "calls":
            calls = [call(rng.choice(["get_weather", "lookup"]), {"city": rng.choice(TEXTS)})
                     for _ in range(rng.randint(1, 3))]
            messages.append({"role": "assistant", "content": rng.choice([None, text]), "tool_calls": calls})
        elif kind == "prefix":
            messages.append({"role": "assistant", "content": text, "prefix": True})
        else:
            messages.append({"role": kind, "content": text})
    return messages


HELD_OUT = [random_conversation(random.Random(seed)) for seed in range(300)]
SYS = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "system_user": [SYS, {"role": "user", "content": "Hi"}],
    "only_system": [SYS],
    "multi_turn_reasoning": [
        SYS, {"role": "user", "content": "Solve x+1=3."},
        {"role": "assistant", "content": "<think>\nSubtract 1.\n</think>\n\nx = 2."},
        {"role": "user", "content": "And x+2=5?"},
        {"role": "assistant", "content": "<think>a</think>mid<think>b</think>x = 3."},
        {"role": "user", "content": "Thanks"}],
    "tools_multi_turn": [
        SYS, {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "東京"})]},
        {"role": "tool", "content": '{"temp": 18}'}, {"role": "tool", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "<think>keep?</think>Paris 18, Tokyo 25."},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": '{"temp": 21}'}],
    "tool_then_user": [
        {"role": "user", "content": "Run it"}, {"role": "assistant", "content": "", "tool_calls": [call("run", {})]},
        {"role": "tool", "content": "ok"}, {"role": "user", "content": "Now summarise"}],
    "continued_reply": [{"role": "user", "content": "Write a haiku"},
                        {"role": "assistant", "content": "Autumn", "prefix": True}],
}
V31_KWARGS = [{}, {"thinking": True}, {"thinking": False}]


def kwargs_of(name: str) -> list[dict]:
    return V31_KWARGS if name == "deepseek-v3.1" else [{}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_held_out_conversations_render_as_the_official_template(name):
    rendered = 0
    for messages in HELD_OUT:
        for kwargs in kwargs_of(name):
            for add_generation_prompt in (True, False):
                try:
                    want = jinja_render(TEMPLATES[name], messages, add_generation_prompt, **kwargs)
                except TypeError:  # R1-0528's template fails on a tool-call turn whose content is None
                    assert name == "deepseek-r1-0528"
                    continue
                assert render(name, messages, add_generation_prompt, kwargs) == want, (messages, kwargs)
                rendered += 1
    assert rendered > 400


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_conversations_render_as_the_official_template(name, conversation):
    messages = CONVERSATIONS[conversation]
    for kwargs in kwargs_of(name):
        for add_generation_prompt in (True, False):
            if name == "deepseek-r1-0528" and any(m.get("content") is None for m in messages):
                continue
            want = jinja_render(TEMPLATES[name], messages, add_generation_prompt, **kwargs)
            assert render(name, messages, add_generation_prompt, kwargs) == want


def test_llama_cpp_copy_of_v31_renders_the_same():
    """llama.cpp's reformatted copy of V3.1's template agrees with the release text stored here."""
    for messages in HELD_OUT[:100]:
        for kwargs in V31_KWARGS:
            assert (jinja_render(LLAMA_CPP_V31, messages, True, **kwargs)
                    == jinja_render(TEMPLATES["deepseek-v3.1"], messages, True, **kwargs))


def test_v31_thinking_switch_and_earlier_reasoning():
    ask = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hmm</think>Hello"},
           {"role": "user", "content": "2+2?"}]
    chat, thinking = render("deepseek-v3.1", ask), render("deepseek-v3.1", ask, kwargs={"thinking": True})
    assert chat.endswith("<｜User｜>2+2?<｜Assistant｜></think>")
    assert thinking.endswith("<｜User｜>2+2?<｜Assistant｜><think>")
    assert "<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>" in chat and "hmm" not in chat + thinking
    assert render("deepseek-v3.1", ask, kwargs={"thinking": False}) == chat


def test_template_kwargs_are_checked():
    ask = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TemplateKwargError, match="chat_template_kwargs.thinking: must be true or false") as info:
        render("deepseek-v3.1", ask, kwargs={"thinking": "yes"})
    assert info.value.param == "chat_template_kwargs.thinking"
    with pytest.raises(TemplateKwargError, match="deepseek-v3.1 chat template has no 'effort' switch"):
        render("deepseek-v3.1", ask, kwargs={"effort": "max"})
    with pytest.raises(TemplateKwargError, match="deepseek-r1 chat template has no 'thinking' switch"):
        render("deepseek-r1", ask, kwargs={"thinking": True})


def test_formats_recognised_from_templates():
    assert chat_format_of(None) == "deepseek-r1"
    assert chat_format_of(R1_TEMPLATE) == "deepseek-r1"
    for name, template in TEMPLATES.items():
        assert chat_format_of(template) == name
    assert chat_format_of(LLAMA_CPP_V31) == "deepseek-v3.1"
    with pytest.raises(ValueError, match="x.json: chat_template: the chat template is none of the DeepSeek"):
        chat_format_of("{{ messages }}", "x.json: chat_template")


@pytest.fixture(scope="module")
def v31_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("v31")
    config = {"bos_token": {"content": BOS}, "eos_token": {"content": EOS}, "chat_template": TEMPLATES["deepseek-v3.1"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer.json").write_bytes(packaged_tokenizer_json().read_bytes())
    return folder


@pytest.fixture(scope="module")
def r1() -> Tokenizer:
    return load_tokenizer()


def test_folder_template_decides_the_format(v31_folder, r1, tmp_path):
    tok = load_tokenizer(v31_folder)
    assert tok.chat_format == "deepseek-v3.1" and r1.chat_format == "deepseek-r1"
    ask = [{"role": "user", "content": "2+2?"}]
    assert tok.render_chat(ask) == render("deepseek-v3.1", ask)
    chat = tok.apply_chat_template(ask)
    thinking = tok.apply_chat_template(ask, chat_template_kwargs={"thinking": True})
    assert chat[-1] == tok.think_end_id and thinking[-1] == tok.think_start_id
    assert not opens_thinking(chat, tok) and opens_thinking(thinking, tok)
    assert opens_thinking(r1.apply_chat_template(ask), r1)  # R1's "<think>" + newline
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template: the chat template is none"):
        folder_chat_format(tmp_path)
    unknown = load_tokenizer(tmp_path)  # loads (ids and text encode); rendering is the error
    assert unknown.chat_format is None and unknown.encode("Hi") == r1.encode("Hi")
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template: the chat template is none.*token ids"):
        unknown.render_chat(ask)
    # transformers' save_pretrained writes the template beside the config, as chat_template.jinja
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES["deepseek-r1-0528"], encoding="utf-8")
    assert folder_chat_format(tmp_path) == "deepseek-r1-0528"
    assert Tokenizer(r1.backend, "deepseek-v3-0324").render_chat(ask) == render("deepseek-v3-0324", ask)
