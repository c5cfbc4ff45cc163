"""V3.2's and V4's prompt encoders (`dsr1.generation.encoder_v32` / `encoder_v4`) against DeepSeek's
own (`tests/data/deepseek_encoding`, verbatim): a held-out set of random conversations (tools,
thinking on and off, drop_thinking, reasoning_effort, multi-turn with tool results, developer and
latest_reminder turns) renders byte for byte as the official encoders render it, the release's own
V4 test cases too, and completions parse back to the messages they came from, as the official
parsers read them. No model needed."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

import pytest

from dsr1.generation import encoder_v4, encoder_v32
from dsr1.generation.markup import EOS

DATA = Path(__file__).parent / "data" / "deepseek_encoding"


@functools.cache
def official(name: str) -> ModuleType:
    """DeepSeek's encoder module `name` (encoding_dsv32 / encoding_dsv4), loaded from its copy."""
    path = DATA / f"{name}.py.txt"
    loader = importlib.machinery.SourceFileLoader(f"official_{name}", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


TEXTS = ["Hi", "What is 2+2?", "  spaces \n", "你好，世界 🙂", "line\nbreaks\n\n", '{"json": true}', "a {brace} b",
         "<think>not a marker here</think>", f"say {EOS} literally", "tabs\tand \\ backslashes"]
CLEAN = ["Hi", "What is 2+2?", "你好，世界 🙂", "line\nbreaks", '{"json": true}', "a {brace} b", "x < y > z"]
VALUES = ["Rome", "", "multi\nline", "quote \" and <tag>", 3, -2.5, True, None, [1, "two", {"k": [3]}],
          {"nested": {"deep": "é"}}, "😀"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web, 搜索.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}}}}]


def random_call(rng: random.Random, k: int) -> dict:
    keys = rng.sample(["city", "days", "query", "q u", "flags", "数"], rng.randint(0, 3))
    arguments = {key: rng.choice(VALUES) for key in keys}
    return {"id": f"call_{k}", "type": "function",
            "function": {"name": rng.choice(["get_weather", "search"]), "arguments": json.dumps(arguments)}}


def assistant_turn(rng: random.Random, texts: list[str], calls: bool, k: int) -> dict:
    turn = {"role": "assistant", "content": rng.choice([*texts, "", None]) if calls else rng.choice(texts),
            "reasoning_content": rng.choice([*texts, None]) if calls else rng.choice(texts)}
    if calls:
        turn["tool_calls"] = [random_call(rng, k + j) for j in range(rng.randint(1, 3))]
    return turn


def random_conversation(rng: random.Random, v4: bool, texts: list[str] = TEXTS) -> list[dict]:
    """System (tools or not), then rounds of a user turn and replies: answers, or calls followed by
    their results (in shuffled order for V4, which sorts them) and then maybe an answer; it ends on
    a user turn or on tool results, where the model replies next."""
    messages: list[dict] = []
    if rng.random() < 0.8:
        messages.append({"role": "system", "content": rng.choice(texts)})
        if rng.random() < 0.5:
            messages[-1]["tools"] = TOOLS
        if rng.random() < 0.2:
            messages[-1]["response_format"] = {"type": "json_object"}
    k = 0
    for turn in range(rng.randint(1, 4)):
        if v4 and rng.random() < 0.15:
            messages.append({"role": "latest_reminder", "content": "Today is 2026-12-02."})
        messages.append({"role": "user", "content": rng.choice(texts)})
        if rng.random() < 0.1:  # the search agents' developer turn, carrying its own tools
            messages[-1] = {"role": "developer", "content": rng.choice(texts), "tools": TOOLS[1:]}
        for _ in range(rng.randint(0, 3)):
            reply = assistant_turn(rng, texts, rng.random() < 0.5, k)
            messages.append(reply)
            k += len(reply.get("tool_calls", ()))
            if "tool_calls" not in reply:
                break
            results = [{"role": "tool", "tool_call_id": c["id"], "content": rng.choice(texts)}
                       for c in reply["tool_calls"]]
            messages += rng.sample(results, len(results)) if v4 else results
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": rng.choice(texts)})
    return messages


HELD_OUT = [(seed, random_conversation(random.Random(seed), v4=False)) for seed in range(200)]
HELD_OUT_V4 = [(seed, random_conversation(random.Random(10_000 + seed), v4=True)) for seed in range(150)]


def outcome(fn, *args, **kwargs):
    """fn's result, or "error" when it refuses the input (the official code asserts, ours raises)."""
    try:
        return fn(*args, **kwargs)
    except (AssertionError, ValueError, IndexError):
        return "error"


def test_v32_held_out_conversations_render_as_the_official_encoder():
    ref, rendered = official("encoding_dsv32"), 0
    for seed, messages in HELD_OUT:
        for mode in ("chat", "thinking"):
            for drop in (True, False):
                theirs = outcome(ref.encode_messages, messages, thinking_mode=mode, drop_thinking=drop)
                ours = outcome(encoder_v32.encode_messages, messages, thinking_mode=mode, drop_thinking=drop)
                assert ours == theirs, (seed, mode, drop)
                rendered += theirs != "error"
    assert rendered > 600  # most conversations are ones the official encoder takes


def test_v4_held_out_conversations_render_as_the_official_encoder():
    ref, rendered = official("encoding_dsv4"), 0
    for seed, messages in HELD_OUT_V4:
        for mode, effort in (("chat", None), ("thinking", None), ("thinking", "max"), ("thinking", "high"),
                             ("chat", "max")):
            for drop in (True, False):
                kwargs = dict(thinking_mode=mode, drop_thinking=drop, reasoning_effort=effort)
                theirs = outcome(ref.encode_messages, messages, **kwargs)
                assert theirs != "error"
                assert encoder_v4.encode_messages(messages, **kwargs) == theirs, (seed, kwargs)
                rendered += 1
    assert rendered == 1500


def test_v4_release_test_cases():
    """The four cases of the release's `test_encoding_dsv4.py`, against its expected outputs."""
    for case, mode in ((1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")):
        given = json.loads((DATA / "v4" / f"test_input_{case}.json").read_text(encoding="utf-8"))
        if case == 1:
            messages = given["messages"]
            messages[0]["tools"] = given["tools"]
        else:
            messages = given
        expected = (DATA / "v4" / f"test_output_{case}.txt").read_text(encoding="utf-8")
        assert encoder_v4.encode_messages(messages, thinking_mode=mode) == expected, case


def test_context_continues_an_encoded_prefix():
    """`context`: the messages already encoded; the result continues their text exactly."""
    for seed, messages in HELD_OUT[:40] + HELD_OUT_V4[:40]:
        encoder, ref = ((encoder_v4, official("encoding_dsv4")) if seed >= 10_000 or any(
            m["role"] == "latest_reminder" for m in messages) else (encoder_v32, official("encoding_dsv32")))
        cut = len(messages) // 2
        for mode in ("chat", "thinking"):
            kwargs = dict(thinking_mode=mode, drop_thinking=False)
            theirs = outcome(ref.encode_messages, messages[cut:], context=messages[:cut], **kwargs)
            ours = outcome(encoder.encode_messages, messages[cut:], context=messages[:cut], **kwargs)
            assert ours == theirs


@pytest.mark.parametrize("version", ["v3.2", "v4"])
def test_completions_parse_back_to_their_messages(version):
    """Each reply of a conversation, written as the encoder writes it, read back by our parser and
    by the official one: the same message, the one it came from."""
    encoder = encoder_v32 if version == "v3.2" else encoder_v4
    ref = official("encoding_dsv32" if version == "v3.2" else "encoding_dsv4")
    parsed = 0
    for seed in range(150):
        rng = random.Random(seed)
        ask = [{"role": "user", "content": rng.choice(CLEAN)}]
        reply = assistant_turn(rng, CLEAN, rng.random() < 0.6, 0)
        for mode in ("chat", "thinking"):
            prompt = encoder.encode_messages(ask, thinking_mode=mode)
            completion = encoder.encode_messages(ask + [reply], thinking_mode=mode)[len(prompt):]
            ours = encoder.parse_completion(completion, mode)
            assert ours == ref.parse_message_from_completion_text(completion, thinking_mode=mode)
            assert ours["content"] == (reply["content"] or "")
            assert ours["reasoning_content"] == ((reply["reasoning_content"] or "") if mode == "thinking" else "")
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours["tool_calls"]]
            assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                             for c in reply.get("tool_calls", [])]
            parsed += 1
    assert parsed == 300


@pytest.mark.parametrize("text", ["no end", "a</think>b" + EOS + "more", "x\n\n<｜DSML｜function_calls>\nbroken",
                                  "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n"
                                  "</｜DSML｜tool_calls>after", "</think>" + EOS])
def test_malformed_completions_are_refused_alike(text):
    for encoder, name in ((encoder_v32, "encoding_dsv32"), (encoder_v4, "encoding_dsv4")):
        for mode in ("chat", "thinking"):
            expected = outcome(official(name).parse_message_from_completion_text, text, thinking_mode=mode)
            assert outcome(encoder.parse_completion, text, mode) == expected


def test_bad_messages_name_the_field():
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a string"):
        encoder_v32.encode_messages([{"role": "system", "content": "s"}, {"role": "user", "content": None}])
    with pytest.raises(ValueError, match="'role' is one of"):
        encoder_v32.encode_messages([{"role": "latest_reminder", "content": "x"}])
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        encoder_v4.encode_messages([{"role": "user", "content": "x"}], reasoning_effort="low")
    with pytest.raises(ValueError, match=r"messages\[1\].*reasoning_content or tool_calls"):
        encoder_v32.encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                    thinking_mode="thinking")
    with pytest.raises(ValueError, match="a tool result without an assistant tool call"):
        encoder_v32.encode_messages([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_chat_formats_render_through_the_encoders(tmp_path):
    """`deepseek-v3.2` / `deepseek-v4` render with their encoders and switches, chosen from a folder's
    config.json when it has no template (V3.2-Exp's V3.1 template still decides for it); `generate`'s
    chat path (`encode_prompt`) passes the switches on."""
    import shutil

    import dsr1
    from dsr1.generation.chat_templates import TemplateKwargError, render
    from dsr1.generation.output import encode_prompt
    from dsr1.generation.tokenizer import folder_chat_format, load_tokenizer

    messages = HELD_OUT_V4[3][1]
    expected = encoder_v4.encode_messages(messages, "thinking", drop_thinking=False, reasoning_effort="max")
    kwargs = {"thinking": True, "drop_thinking": False, "reasoning_effort": "max"}
    assert render("deepseek-v4", messages, kwargs=kwargs) == expected
    assert render("deepseek-v3.2", HELD_OUT[3][1]) == encoder_v32.encode_messages(HELD_OUT[3][1], "chat")
    for name, bad in (("deepseek-v4", {"reasoning_effort": "low"}), ("deepseek-v3.2", {"drop_thinking": "no"}),
                      ("deepseek-v3.2", {"reasoning_effort": "max"})):
        with pytest.raises(TemplateKwargError, match="chat_template_kwargs"):
            render(name, messages, kwargs=bad)
    shutil.copy(dsr1.demo_checkpoint() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.chat_format == "deepseek-v4"
    assert encode_prompt(messages, tokenizer, True, kwargs) == tokenizer.encode(expected)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    assert folder_chat_format(tmp_path) == "deepseek-v3.2"
    v31 = (Path(__file__).parent / "data" / "chat_templates" / "deepseek-v3.1.jinja").read_text(encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": v31}))
    assert folder_chat_format(tmp_path) == "deepseek-v3.1"  # V3.2-Exp ships V3.1's template
