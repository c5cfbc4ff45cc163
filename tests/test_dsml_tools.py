"""The server's side of V3.2's and V4's DSML tool calls, without a server: held-out completions (as
the release encoders write a reply's calls) parsed whole and streamed at random chunk boundaries to
the same calls with no markup in the content, the reasoning that a call block ends when `</think>`
is missing, arguments that always parse, and the tool format chosen from a folder's config.json."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

import dsr1
from dsr1.generation import encoder_v4, encoder_v32
from dsr1.generation.markup import EOS
from dsr1.generation.tokenizer import load_tokenizer
from dsr1.server.errors import APIError
from dsr1.server.prepare import Limits, plan_chat
from dsr1.server.protocol import ChatCompletionRequest
from dsr1.server.reasoning import ReasoningSplitter, split_reply
from dsr1.server.tools import ToolCallSplitter, split_tool_calls

from .test_tool_formats import streamed

ENCODERS = {"v3.2": encoder_v32, "v4": encoder_v4}
VALUES = ["Rome", "", "multi\nline", 'quote " </tag> <｜x', "x < y", 3, -2.5, True, None, [1, "two", {"k": [3]}],
          {"nested": {"deep": "é"}}, "😀 {brace}"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]


def held_out_reply(rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    """Content (maybe none) and one to three calls with random arguments."""
    calls = []
    for _ in range(rng.randint(1, 3)):
        keys = rng.sample(["city", "days", "query", "q u", "数"], rng.randint(0, 3))
        calls.append((rng.choice(["get_weather", "search", "x.y-z"]), {k: rng.choice(VALUES) for k in keys}))
    return rng.choice(["", "Let me look.", "Checking 你好\nnow", "two blank lines\n\n"]), calls


def completion(tool_format: str, content: str, calls: list[tuple[str, dict]], thinking: str | None = None) -> str:
    """What the model writes for that reply, as the release encoder writes it (EOS stripped, as the
    engine stops on it): the assistant turn after the prompt."""
    encoder = ENCODERS[tool_format]
    ask = [{"role": "user", "content": "hi"}]
    written = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]
    reply = {"role": "assistant", "content": content, "reasoning_content": thinking, "tool_calls": written}
    mode = "chat" if thinking is None else "thinking"
    prompt = encoder.encode_messages(ask, mode)
    return encoder.encode_messages(ask + [reply], mode)[len(prompt):].removesuffix(EOS)


@pytest.mark.parametrize("tool_format", ["v3.2", "v4"])
def test_held_out_calls_parse_whole_and_streamed_alike(tool_format):
    rng, runs = np.random.default_rng(0), 0
    for seed in range(40):
        content, calls = held_out_reply(random.Random(seed))
        reply = completion(tool_format, content, calls)
        whole, found = split_tool_calls(reply, tool_format)
        assert whole == content  # the blank line before the block is markup, not content
        assert [(c.name, json.loads(c.arguments)) for c in found] == calls
        for _ in range(5):
            text, joined = streamed(reply, tool_format, rng)
            assert text == whole and "｜" not in text and "DSML" not in text
            assert joined == [(c.name, c.arguments) for c in found]
            runs += 1
    assert runs == 200


@pytest.mark.parametrize("tool_format", ["v3.2", "v4"])
def test_replies_without_a_whole_call_keep_the_markup_out_of_content(tool_format):
    reply = completion(tool_format, "Let me look.", [("get_weather", {"city": "Rome"})])
    assert split_tool_calls("plain answer\n\n", tool_format) is None
    for cut in (reply[:reply.index("invoke") + 3], reply[:reply.index("Rome") + 2]):
        content, calls = split_tool_calls(cut, tool_format)  # cut inside the block: the calls read so far
        assert content == "Let me look." and all(c.name == "get_weather" and not c.complete for c in calls)
    for cut in (reply[:reply.index("invoke") + 3], reply[:reply.index("Rome") + 2], "plain answer\n\n"):
        splitter = ToolCallSplitter(tool_format)
        content, _ = splitter.push(cut)
        rest, _ = splitter.push("", final=True)
        assert not splitter.calls or splitter.calls[0].name == "get_weather"
        assert "DSML" not in content + rest
        if "DSML" not in cut:
            assert content + rest == cut
    other = "v4" if tool_format == "v3.2" else "v3.2"  # the other model's block is not this one's call
    assert split_tool_calls(completion(other, "x", [("f", {})]), tool_format) is None


def test_arguments_always_parse():
    """A non-string parameter that is not JSON (a model's unquoted word) becomes a string; parameter
    markup never reaches the arguments."""
    reply = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
             '<｜DSML｜parameter name="unit" string="false">celsius</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="n" string="false"> 2 </｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="s" string="true">a</b></｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    _, (call,) = split_tool_calls(reply, "v4")
    assert json.loads(call.arguments) == {"unit": "celsius", "n": 2, "s": "a</b>"}


@pytest.mark.parametrize("tool_format", ["v3.2", "v4"])
def test_a_call_block_ends_the_reasoning_when_think_is_not_closed(tool_format):
    """Thinking mode: reasoning then, without `</think>`, the call block: the reasoning stops before
    it and the call is parsed from the content, streamed or whole; with `</think>` the same."""
    reply = completion(tool_format, "", [("get_weather", {"city": "Rome", "days": 2})], thinking="I should look.")
    assert "</think>" in reply
    rng = np.random.default_rng(1)
    for text in (reply, reply.replace("</think>", "")):
        reasoning, content = split_reply(text, thinking=True)
        assert reasoning == "I should look."
        whole, (call,) = split_tool_calls(content, tool_format)
        assert whole == "" and json.loads(call.arguments) == {"city": "Rome", "days": 2}
        for _ in range(50):
            cuts = np.sort(rng.integers(0, len(text) + 1, size=6))
            splitter, caller, joined = ReasoningSplitter(True), ToolCallSplitter(tool_format), ["", "", ""]
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            for k, piece in enumerate(pieces):
                last = k == len(pieces) - 1
                parts = splitter.push(piece)
                if last:
                    parts = tuple(a + b for a, b in zip(parts, splitter.finish()))
                shown, deltas = caller.push(parts[1], final=last)
                joined[0] += parts[0]
                joined[1] += shown
                joined[2] += "".join(d["function"]["arguments"] for d in deltas)
            assert joined == ["I should look.", "", call.arguments]


@pytest.fixture(scope="module")
def release_folders(tmp_path_factory):
    """The demo model's tokenizer in folders whose config.json names V3.2 and V4 (no template: their
    releases ship none)."""
    folders = {}
    for model_type in ("deepseek_v32", "deepseek_v4"):
        folder = tmp_path_factory.mktemp(model_type)
        shutil.copy(dsr1.demo_checkpoint() / "tokenizer.json", folder / "tokenizer.json")
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        folders[model_type] = folder
    return folders


def test_format_chosen_from_config_and_chat_requests(release_folders):
    v32, v4 = (load_tokenizer(release_folders[t]) for t in ("deepseek_v32", "deepseek_v4"))
    assert (v32.chat_format, v4.chat_format) == ("deepseek-v3.2", "deepseek-v4")
    limits = Limits("m", 4096, v4.vocab_size, 64, 16)
    ask = [{"role": "user", "content": "Weather in Rome?"}]

    def prompt(tokenizer, **fields):
        plan = plan_chat(ChatCompletionRequest(model="m", messages=ask, **fields), tokenizer, limits)
        return plan, tokenizer.decode(plan.prompts[0])

    plan, text = prompt(v32, tools=TOOLS, chat_template_kwargs={"thinking": True})
    tools = [{"role": "system", "content": "", "tools": TOOLS}]
    assert plan.tool_format == "v3.2" and text == encoder_v32.encode_messages(tools + ask, "thinking")
    plan, text = prompt(v4, tools=TOOLS, thinking={"type": "enabled"}, reasoning_effort="max")
    assert plan.tool_format == "v4" and text == encoder_v4.encode_messages(tools + ask, "thinking",
                                                                           reasoning_effort="max")
    assert text.startswith("<｜begin▁of▁sentence｜>" + encoder_v4.REASONING_EFFORT_MAX)
    _, text = prompt(v4)
    assert text.endswith("<｜Assistant｜></think>")  # chat mode by default
    back = [*ask, {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    plan = plan_chat(ChatCompletionRequest(model="m", messages=back, tools=TOOLS,
                                           chat_template_kwargs={"thinking": True}), v4, limits)
    text = v4.decode(plan.prompts[0])  # the reasoning passed back is rendered (tools keep it)
    assert "Look it up.</think>" in text and text.endswith("<tool_result>Sunny</tool_result><｜Assistant｜><think>")
    two = [{"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for k in (1, 2)]
    answered = [*ask, {"role": "assistant", "content": "", "tool_calls": two},
                {"role": "tool", "tool_call_id": "c2", "content": "B"},
                {"role": "tool", "tool_call_id": "c1", "content": "A"},
                {"role": "latest_reminder", "content": "Today is Tuesday."}, {"role": "user", "content": "And?"}]
    text = v4.decode(plan_chat(ChatCompletionRequest(model="m", messages=answered), v4, limits).prompts[0])
    assert text == encoder_v4.encode_messages(answered, "chat")
    assert "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>" in text  # in the calls' order
    assert text.endswith("<｜latest_reminder｜>Today is Tuesday.<｜User｜>And?<｜Assistant｜></think>")
    with pytest.raises(APIError, match="messages cannot be rendered") as info:
        plan_chat(ChatCompletionRequest(model="m", messages=answered), v32, limits)
    assert info.value.status == 400


GRAMMAR_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}},  # open: extra keys allowed
    {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"labels": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 2}}, "required": ["labels"]}}}]


@pytest.mark.parametrize("tool_format", ["v3.2", "v4"])
def test_required_and_named_grammars_write_calls_that_parse(tool_format, release_folders):
    """A random walk through the grammar of `tool_choice` required / named (what a random model
    under it writes) is a DSML block of valid calls that ends, in chat and thinking mode."""
    import jsonschema

    from dsr1.server.tools import parse_tools, tool_call_grammar
    from tests.test_tool_formats import walk

    tokenizer = load_tokenizer(release_folders["deepseek_v32" if tool_format == "v3.2" else "deepseek_v4"])
    tools, schemas = parse_tools(GRAMMAR_TOOLS), {t["function"]["name"]: t["function"]["parameters"]
                                                  for t in GRAMMAR_TOOLS}
    for seed, (choice, reasoning) in enumerate([("required", None), ("get_weather", None), ("note", None),
                                                ("tag", 0), ("required", 0), ("required", None)]):
        text = walk(tokenizer, tool_call_grammar(tools, choice, tokenizer, reasoning, tool_format), seed)
        block = f"<｜DSML｜{'function_calls' if tool_format == 'v3.2' else 'tool_calls'}>\n"
        if reasoning is not None:  # `</think>` then at most the blank line
            assert text.startswith("</think>") and text.removeprefix("</think>").lstrip("\n").startswith(block)
            text = text.removeprefix("</think>")
        else:
            assert text.startswith("\n\n" + block)
        content, calls = split_tool_calls(text, tool_format)
        assert content == "" and calls and (choice == "required" or [c.name for c in calls] == [choice])
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
