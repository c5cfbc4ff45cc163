"""The server's side of the V3 line's chat formats, without a server: both tool-call formats (V3-0324's /
R1's and V3.1's) parsed whole and streamed at random chunk boundaries, the grammar of `tool_choice`
required / named writing the model's own format, `chat_template_kwargs` in a chat request, and the
reasoning split in V3.1's two modes."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsr1
from dsr1.generation.output import opens_thinking
from dsr1.generation.tokenizer import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP, Tokenizer
from dsr1.server.errors import APIError
from dsr1.server.prepare import Limits, plan_chat, plan_tokenize
from dsr1.server.protocol import ChatCompletionRequest, TokenizeRequest
from dsr1.server.reasoning import ReasoningSplitter, split_reply
from dsr1.server.tools import ToolCallSplitter, parse_tools, split_tool_calls, tool_call_grammar, tools_system_prompt

CALLS = [("get_weather", {"city": "Rome", "days": 2}), ("lookup", {"word": "a`b<｜x"})]
ARGS = [(n, json.dumps(a, ensure_ascii=False)) for n, a in CALLS]
REPLIES = {  # what each format's model writes: content, then two calls
    "v3": (f"Let me look.{CALLS_BEGIN}"
           + "\n".join(f"{CALL_BEGIN}function{TOOL_SEP}{n}\n```json\n{a}\n```{CALL_END}" for n, a in ARGS) + CALLS_END),
    "v3.1": (f"Let me look.{CALLS_BEGIN}" + "".join(f"{CALL_BEGIN}{n}{TOOL_SEP}{a}{CALL_END}" for n, a in ARGS)
             + CALLS_END),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                               "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "lookup", "description": "A word in the dictionary.",
                                           "parameters": {"type": "object", "properties": {
                                               "word": {"type": "string", "maxLength": 10}},
                                               "required": ["word"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Rome?"}]


def streamed(text: str, tool_format: str, rng: np.random.Generator) -> tuple[str, list[tuple[str, str]]]:
    """`text` pushed through a `ToolCallSplitter` in random pieces; the content and the calls as the
    openai client joins the deltas."""
    cuts = np.sort(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter, content, joined = ToolCallSplitter(tool_format), "", {}
    for k, piece in enumerate(pieces):
        delta, deltas = splitter.push(piece, final=k == len(pieces) - 1)
        content += delta
        for d in deltas:
            call = joined.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d["function"].get("name") or ""
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in joined.values()]


@pytest.mark.parametrize("tool_format", sorted(REPLIES))
def test_calls_parse_whole_and_streamed_alike(tool_format):
    reply = REPLIES[tool_format]
    content, found = split_tool_calls(reply, tool_format)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in found] == CALLS
    assert split_tool_calls("no calls", tool_format) is None
    half, partial = split_tool_calls(reply[:len(reply) // 2], tool_format)  # cut short: no markup in the content
    assert half == "Let me look." and not partial[-1].complete
    rng = np.random.default_rng(1)
    for _ in range(300):
        text, calls = streamed(reply, tool_format, rng)
        assert "｜" not in text and text == content
        assert calls == [(c.name, c.arguments) for c in found]
    # A reply that ends inside its first call (max_tokens) keeps the markup out of its content, whole
    # and streamed; V3.1's call was sent as soon as its name was known (its arguments cut short),
    # R1's / V3-0324's name comes with its JSON block.
    cut = reply[:reply.index(TOOL_SEP) + len(TOOL_SEP) + 5]
    whole, cut_calls = split_tool_calls(cut, tool_format)
    splitter = ToolCallSplitter(tool_format)
    content, deltas = splitter.push(cut)
    rest, _ = splitter.push("", final=True)
    assert whole == content + rest == "Let me look."
    assert [c.name for c in cut_calls] == [d["function"]["name"] for d in deltas if "id" in d]
    assert bool(deltas) == (tool_format == "v3.1")


def test_unknown_tool_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call format 'v9'"):
        ToolCallSplitter("v9")


@pytest.fixture(scope="module")
def demo_tokenizers() -> dict[str, Tokenizer]:
    """The demo model's vocabulary (small: cheap grammar masks; R1's special tokens) in each chat format."""
    r1 = dsr1.load_tokenizer(dsr1.demo_checkpoint())
    return {name: Tokenizer(r1.backend, name) for name in ("deepseek-r1", "deepseek-v3.1")}


def walk(tokenizer: Tokenizer, grammar: str, seed: int) -> str:
    """A random token walk through the grammar's masks (what a random model under the constraint writes)."""
    import llguidance.numpy
    from llguidance import LLMatcher, LLTokenizer

    lltok = LLTokenizer(str(dsr1.demo_checkpoint() / "tokenizer.json"))
    matcher, rng = LLMatcher(lltok, grammar), np.random.default_rng(seed)
    mask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
    out = []
    while not matcher.is_stopped() and len(out) < 400:
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:lltok.vocab_size])
        token = lltok.eos_token if lltok.eos_token in allowed else int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        if token == lltok.eos_token:
            break
        out.append(token)
    return tokenizer.decode(out)


def test_v31_grammar_writes_v31_calls(demo_tokenizers):
    tokenizer, tools = demo_tokenizers["deepseek-v3.1"], parse_tools(TOOLS)
    for seed, choice in enumerate(["required", "lookup", "required", "get_weather"]):
        text = walk(tokenizer, tool_call_grammar(tools, choice, tokenizer, None, "v3.1"), seed)
        assert text.startswith(CALLS_BEGIN + CALL_BEGIN) and "```" not in text and "function" + TOOL_SEP not in text
        content, calls = split_tool_calls(text, "v3.1")
        assert content == "" and calls and (choice == "required" or [c.name for c in calls] == [choice])
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)


def test_v31_chat_requests(demo_tokenizers):
    tokenizer = demo_tokenizers["deepseek-v3.1"]
    limits = Limits("m", 1024, tokenizer.vocab_size, 64, 16)

    def plan(**fields):
        return plan_chat(ChatCompletionRequest(model="m", messages=ASK, **fields), tokenizer, limits)

    chat, thinking = plan(), plan(chat_template_kwargs={"thinking": True})
    assert tokenizer.decode(chat.prompts[0]).endswith("<｜Assistant｜></think>")
    assert tokenizer.decode(thinking.prompts[0]).endswith("<｜Assistant｜><think>")
    assert not opens_thinking(chat.prompts[0], tokenizer) and opens_thinking(thinking.prompts[0], tokenizer)
    assert plan(chat_template_kwargs={"thinking": False}).prompts == chat.prompts
    asked = TokenizeRequest(messages=ASK, chat_template_kwargs={"thinking": True})
    assert plan_tokenize(asked, tokenizer, limits) == thinking.prompts[0]
    calls = plan(tools=TOOLS, tool_choice="required")
    assert calls.tool_format == "v3.1" and calls.grammars[0]
    system = tokenizer.decode(calls.prompts[0])
    assert tools_system_prompt(parse_tools(TOOLS), "v3.1") in system
    assert "chain them directly without separators" in system and "```json" not in system
    with pytest.raises(APIError) as info:
        plan(chat_template_kwargs={"thinking": "on"})
    assert info.value.status == 400 and info.value.param == "chat_template_kwargs.thinking"
    r1 = plan_chat(ChatCompletionRequest(model="m", messages=ASK, tools=TOOLS), demo_tokenizers["deepseek-r1"],
                   limits)
    assert r1.tool_format == "v3" and "```json" in demo_tokenizers["deepseek-r1"].decode(r1.prompts[0])
    with pytest.raises(APIError) as info:
        plan_chat(ChatCompletionRequest(model="m", messages=ASK, chat_template_kwargs={"thinking": True}),
                  demo_tokenizers["deepseek-r1"], limits)
    assert info.value.param == "chat_template_kwargs.thinking"
    unknown = Tokenizer(tokenizer.backend)
    unknown.chat_format, unknown.template_error = None, "x/tokenizer_config.json: chat_template: not DeepSeek's"
    with pytest.raises(APIError, match="messages cannot be rendered: x/tokenizer_config.json") as info:
        plan_chat(ChatCompletionRequest(model="m", messages=ASK, tools=TOOLS), unknown, limits)
    assert info.value.status == 400 and info.value.param == "messages"


@pytest.mark.parametrize("thinking,output,expected", [
    (True, "The sky scatters blue light.\n</think>\n\nRayleigh scattering.",
     ("The sky scatters blue light.", "Rayleigh scattering.")),
    (True, "still thinking", ("still thinking", "")),
    (False, "Rayleigh scattering.", ("", "Rayleigh scattering.")),
    (False, "A plain </think> answer", ("", "A plain </think> answer")),
])
def test_v31_reasoning_split_in_both_modes(thinking, output, expected):
    """Thinking on (the prompt opened `<think>`): reasoning until `</think>`; off: all content."""
    assert split_reply(output, thinking) == expected
    rng = np.random.default_rng(0)
    for _ in range(50):
        cuts = np.sort(rng.integers(0, len(output) + 1, size=4))
        splitter, joined = ReasoningSplitter(thinking), ["", ""]
        for piece in [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]:
            for k, part in enumerate(splitter.push(piece)):
                joined[k] += part
        for k, part in enumerate(splitter.finish()):
            joined[k] += part
        assert tuple(joined) == expected


@pytest.mark.parametrize("chat_format,thinking,kwargs,expected", [
    ("deepseek-v3.1", "enabled", None, {"thinking": True}),
    ("deepseek-v3.1", "disabled", {}, {"thinking": False}),
    ("deepseek-v3.1", "enabled", {"thinking": False}, {"thinking": False}),  # the kwargs decide
    ("deepseek-v3.1", None, None, None),
    ("deepseek-r1", "disabled", None, None),  # R1's template has no switch: it always thinks
    ("deepseek-v3-0324", "enabled", {"x": 1}, {"x": 1}),  # (the template's check refuses "x")
    ("deepseek-v3.2", "enabled", None, {"thinking": True}),
    ("deepseek-v4", "enabled", {"drop_thinking": False}, {"thinking": True, "drop_thinking": False}),
])
def test_deepseeks_thinking_switch_becomes_the_templates(chat_format, thinking, kwargs, expected):
    """A chat request's `thinking: {"type": ...}` (DeepSeek's API) is the template's `thinking` switch
    where the model's template has one, unless `chat_template_kwargs` sets it."""
    from types import SimpleNamespace

    from dsr1.server.prepare import template_switches
    from dsr1.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "chat_template_kwargs": kwargs,
                                                 **({"thinking": {"type": thinking}} if thinking else {})})
    assert template_switches(body, SimpleNamespace(chat_format=chat_format)) == expected


@pytest.mark.parametrize("chat_format,effort,kwargs,expected", [
    ("deepseek-v4", "max", None, {"reasoning_effort": "max"}),
    ("deepseek-v4", "low", None, {"reasoning_effort": "high"}),  # V4 knows high (its default) and max
    ("deepseek-v4", "max", {"reasoning_effort": "high"}, {"reasoning_effort": "high"}),  # the kwargs decide
    ("deepseek-v3.2", "max", None, None),  # V3.2's encoder has no effort
])
def test_reasoning_effort_becomes_v4s_switch(chat_format, effort, kwargs, expected):
    from types import SimpleNamespace

    from dsr1.server.prepare import template_switches

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "chat_template_kwargs": kwargs, "reasoning_effort": effort})
    assert template_switches(body, SimpleNamespace(chat_format=chat_format)) == expected
