"""The clients agents are built with, unchanged, against `python -m dsr1 serve` on the demo model:
the OpenAI Agents SDK (its default Responses model and its chat-completions model), pydantic-ai,
langchain-openai, the anthropic SDK and the openai SDK's Responses calls. Each flow completes, its
structured outputs validating against their pydantic models and its tool calls against their
schemas; a tool conversation (call, result, answer) round-trips on the chat, Responses and Messages
APIs with the reasoning passed back as each carries it (`reasoning_content`, reasoning items,
thinking blocks), read from the requests the clients sent: on R1's format (the served process), and
on V3.1's (the demo model behind V3.1's template, in process), thinking switched on per API.

The tools are declared as a user would (plain `str` arguments, the SDKs' own schema settings): the
server's grammar bounds what their schemas leave open. The output types bound their strings, as a
JSON-schema reply (`response_format`, `text.format`) is held to its schema as given. The server is
served as `deepseek-demo`, a name the Agents SDK's chat model recognizes as DeepSeek's (it passes
the reasoning back to DeepSeek models only). The clients are the `clients` extra (`pip install -e
'.[clients]'`); a test whose client is missing is skipped. The flows are in the extended tier;
what the SDKs send that the server had to learn is checked without a server.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

import dsr1
from dsr1.server.errors import APIError
from dsr1.server.prepare import Limits, plan_chat
from dsr1.server.protocol import ChatCompletionRequest

from .harness import start_demo_server, stop_server

MODEL = "deepseek-demo"
ASK = "What weather will Verona have?"
BRIEF = "Answer briefly."  # (the demo model's reasoning is empty without a system turn here)
FORECAST = "rain, then sun"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Forecast(BaseModel):
    """The weather of a city."""

    city: str = Field(max_length=20)
    rain: bool


class Person(BaseModel):
    """A person of the play."""

    name: str = Field(max_length=12)
    age: int
    role: Literal["king", "queen", "fool"]


def get_weather(city: str) -> str:
    """The weather forecast of a city."""
    return FORECAST


def test_a_text_format_beside_a_required_call_is_checked_and_shapes_nothing():
    """Agent SDKs send their output type's format on every turn, the turns that force a call included
    (openai-agents: `tool_choice` required with `text.format` / `response_format`): the reply is the
    calls, under the same grammar as without the format; a malformed format is still a 400."""
    tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())
    limits = Limits("m", 1024, tokenizer.vocab_size, 64, 16)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": Forecast.model_json_schema()}}

    def plan(**fields: Any) -> Any:
        return plan_chat(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": ASK}], tools=tools,
                                               **fields), tokenizer, limits)

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert plan(tool_choice=choice, response_format=fmt).grammars == plan(tool_choice=choice).grammars
    assert plan(tool_choice="auto", response_format=fmt).grammars != plan(tool_choice="auto").grammars
    with pytest.raises(APIError) as info:
        plan(tool_choice="required", response_format={"type": "json_schema", "json_schema": {"schema": "x"}})
    assert info.value.status == 400 and info.value.param.startswith("response_format")


class Recorder:
    """Event hooks for an SDK's HTTP client (its `DefaultHttpxClient`) that keep the JSON body of
    every request the SDK sends."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def _keep(self, request: Any) -> None:
        if request.content:
            self.bodies.append(json.loads(request.content))

    def hooks(self) -> dict[str, list[Any]]:
        return {"request": [self._keep]}

    def async_hooks(self) -> dict[str, list[Any]]:
        async def keep(request: Any) -> None:
            self._keep(request)

        return {"request": [keep]}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    process, url = start_demo_server(tmp_path_factory.mktemp("serve") / "serve.log", "--max-seqs", "4",
                                     "--max-seq-len", "2048", name=MODEL)
    yield url
    stop_server(process)


def openai_client(url: str, recorder: Recorder, asynchronous: bool = False) -> Any:
    import openai

    if asynchronous:
        http = openai.DefaultAsyncHttpxClient(timeout=600, event_hooks=recorder.async_hooks())
        return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    http = openai.DefaultHttpxClient(timeout=600, event_hooks=recorder.hooks())
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)


# ---- the OpenAI Agents SDK ------------------------------------------------------------------------------------------
async def run_agent(agents: Any, agent: Any, streamed: bool) -> Any:
    """`Runner.run`'s result, or `Runner.run_streamed`'s once its events are read."""
    config = agents.RunConfig(tracing_disabled=True)
    if not streamed:
        return await agents.Runner.run(agent, ASK, max_turns=3, run_config=config)
    result = agents.Runner.run_streamed(agent, ASK, max_turns=3, run_config=config)
    kinds = {event.type async for event in result.stream_events()}
    assert {"raw_response_event", "run_item_stream_event"} <= kinds, kinds
    return result


@pytest.mark.parametrize("api,streamed", [("responses", False), ("responses", True), ("chat", False),
                                          ("chat", True)])
@pytest.mark.slow
@pytest.mark.extended
def test_agents_sdk_calls_the_tool_then_answers_in_its_output_type(url, api, streamed):
    """A required first call (the SDK resets `tool_choice` after it), the tool's result, then the
    final output as `output_type`'s JSON, run whole or streamed; the reasoning of the call's turn is
    passed back."""
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed: pip install -e '.[clients]'")
    recorder = Recorder()
    client = openai_client(url, recorder, asynchronous=True)
    model = (agents.OpenAIResponsesModel(MODEL, client) if api == "responses"
             else agents.OpenAIChatCompletionsModel(MODEL, client))
    agent = agents.Agent(name="forecaster", instructions=BRIEF, model=model, output_type=Forecast,
                         tools=[agents.function_tool(get_weather)],
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=300, temperature=0))
    result = asyncio.run(run_agent(agents, agent, streamed))
    assert isinstance(result.final_output, Forecast)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds.count("ToolCallItem") == kinds.count("ToolCallOutputItem") >= 1, kinds
    assert len(recorder.bodies) == len(result.raw_responses) == 2
    first, second = recorder.bodies
    assert first["tool_choice"] == "required" and "tool_choice" not in second
    assert first.get("stream", False) == streamed
    if api == "responses":
        reasoning = [item for item in result.raw_responses[0].output if item.type == "reasoning"]
        passed = [item for item in second["input"] if item.get("type") == "reasoning"]
        assert reasoning and [p["content"] for p in passed] == [[c.model_dump() for c in r.content] for r in reasoning]
        assert any(item.get("type") == "function_call_output" and item["output"] == FORECAST
                   for item in second["input"])
    else:
        turn = next(m for m in second["messages"] if m["role"] == "assistant")
        assert turn["tool_calls"] and turn.get("reasoning_content"), turn
        assert any(m["role"] == "tool" and m["content"] == FORECAST for m in second["messages"])


# ---- pydantic-ai ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.extended
def test_pydantic_ai_tool_round_trip_and_structured_output(url):
    """The tool forced on the first step, then the output tool's `Forecast`; pydantic-ai sends the
    call's reasoning back in the field it came in (`reasoning_content`)."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -e '.[clients]'")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    recorder = Recorder()
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=openai_client(url, recorder, True)))

    def settings(ctx: Any) -> dict[str, Any]:
        first = {"tool_choice": ["get_weather"]} if ctx.run_step == 1 else {}
        return {"max_tokens": 300, "temperature": 0, **first}

    agent = Agent(model, output_type=Forecast, tools=[get_weather], model_settings=settings)
    result = agent.run_sync(ASK)
    assert isinstance(result.output, Forecast)
    calls = [part.tool_name for m in result.all_messages() for part in m.parts if part.part_kind == "tool-call"]
    assert calls[0] == "get_weather" and calls[-1] == "final_result", calls
    turn = next(m for m in recorder.bodies[1]["messages"] if m["role"] == "assistant")
    assert turn["tool_calls"][0]["function"]["name"] == "get_weather" and turn.get("reasoning_content"), turn
    assert any(m["role"] == "tool" and m["content"] == FORECAST for m in recorder.bodies[1]["messages"])


@pytest.mark.slow
@pytest.mark.extended
def test_pydantic_ai_structured_output_alone(url):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -e '.[clients]'")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=openai_client(url, Recorder(), True)))
    result = Agent(model, output_type=Person, model_settings={"max_tokens": 300}).run_sync("Who is the king?")
    assert isinstance(result.output, Person)


# ---- langchain-openai -----------------------------------------------------------------------------------------------
def chat_openai(url: str, recorder: Recorder, **settings: Any) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai",
                                           reason="langchain-openai is not installed: pip install -e '.[clients]'")
    import openai

    return langchain_openai.ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", max_retries=0,
                                       http_client=openai.DefaultHttpxClient(timeout=600, event_hooks=recorder.hooks()),
                                       **settings)


@pytest.mark.slow
@pytest.mark.extended
def test_langchain_with_structured_output(url):
    llm = chat_openai(url, Recorder(), max_tokens=300, temperature=1.0)
    assert isinstance(llm.with_structured_output(Person).invoke("Who is the king?"), Person)


@pytest.mark.slow
@pytest.mark.extended
def test_langchain_bind_tools_any_round_trip(url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    recorder = Recorder()
    llm = chat_openai(url, recorder, max_tokens=300, temperature=0)
    weather = tool(get_weather)
    call = llm.bind_tools([weather], tool_choice="any").invoke(ASK)
    assert recorder.bodies[-1]["tool_choice"] == "required"
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] * len(call.tool_calls) and call.tool_calls
    for c in call.tool_calls:
        jsonschema.validate(c["args"], CITY)
    turns = [HumanMessage(ASK), call, *[ToolMessage(weather.invoke(c["args"]), tool_call_id=c["id"])
                                         for c in call.tool_calls]]
    answer = llm.bind_tools([weather]).invoke(turns, max_tokens=40)
    assert answer.content and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.slow
@pytest.mark.extended
def test_langchain_stream_joins_to_the_whole_reply(url):
    llm = chat_openai(url, Recorder(), max_tokens=40, temperature=0)
    chunks = list(llm.stream("Good morrow."))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == llm.invoke("Good morrow.").content
    assert next(c for c in reversed(chunks) if c.response_metadata).response_metadata["finish_reason"] in (
        "stop", "length")


# ---- the anthropic SDK ----------------------------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # (the anthropic SDK's `temperature` argument is gone from its signature)
WEATHER = {"name": "get_weather", "description": "The weather forecast of a city.", "input_schema": CITY}


def claude(url: str, recorder: Recorder) -> Any:
    anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is not installed: pip install -e '.[test]'")
    http = anthropic.DefaultHttpxClient(timeout=600, event_hooks=recorder.hooks())
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, http_client=http)


@pytest.mark.slow
@pytest.mark.extended
def test_anthropic_create_and_stream_agree(url):
    client = claude(url, Recorder())
    settings = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Good morrow."}],
                    extra_body=GREEDY)
    whole = client.messages.create(**settings)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[-1].type == "text"
    with client.messages.stream(**settings) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == whole.content[-1].text and streamed.stop_reason == whole.stop_reason
    assert [b.type for b in streamed.content] == [b.type for b in whole.content]


@pytest.mark.slow
@pytest.mark.extended
def test_anthropic_tool_use_any_round_trip_with_thinking_passed_back(url):
    """`tool_choice` any: a valid `tool_use` after R1's thinking, then its `tool_result` and the
    answer, the first reply passed back as the SDK gives it (`to_param`), its thinking block included."""
    recorder = Recorder()
    client = claude(url, recorder)
    ask = [{"role": "user", "content": ASK}]
    first = client.messages.create(model=MODEL, max_tokens=300, system=BRIEF, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and first.content[0].type == "thinking"
    for use in uses:
        assert use.name == "get_weather"
        jsonschema.validate(use.input, CITY)
    results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": FORECAST}
                                           for u in uses]}
    with client.messages.stream(model=MODEL, max_tokens=40, system=BRIEF, tools=[WEATHER], extra_body=GREEDY,
                                messages=[*ask, first.to_param(), results]) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[-1].type == "text"
    passed = recorder.bodies[-1]["messages"][1]["content"]
    assert passed[0] == {"type": "thinking", "thinking": first.content[0].thinking,
                         "signature": first.content[0].signature}


# ---- the openai SDK: Responses and chat ------------------------------------------------------------------------------
RESPONSE_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast of a city.",
                    "parameters": CITY}


@pytest.mark.slow
@pytest.mark.extended
def test_responses_create_and_stream_agree(url):
    client = openai_client(url, Recorder())
    settings = dict(model=MODEL, input="Good morrow.", max_output_tokens=60, temperature=0)
    whole = client.responses.create(**settings)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    with client.responses.stream(**settings) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    assert streamed.output_text == whole.output_text and streamed.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.slow
@pytest.mark.extended
def test_responses_required_tool_round_trip_with_reasoning_passed_back(url):
    recorder = Recorder()
    client = openai_client(url, recorder)
    first = client.responses.create(model=MODEL, instructions=BRIEF, input=ASK, tools=[RESPONSE_WEATHER],
                                    tool_choice="required", max_output_tokens=300, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls and first.output[0].type == "reasoning"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), CITY)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": FORECAST} for c in calls]
    with client.responses.stream(model=MODEL, instructions=BRIEF,
                                 input=[{"role": "user", "content": ASK}, *first.output, *results],
                                 tools=[RESPONSE_WEATHER], max_output_tokens=40, temperature=0) as stream:
        # (the SDK's get_final_response wants `response.completed`; an answer cut by the budget is incomplete)
        answer = next(e.response for e in stream if e.type in ("response.completed", "response.incomplete"))
    assert answer.output_text and not [item for item in answer.output if item.type == "function_call"]
    assert recorder.bodies[-1]["input"][1] == first.output[0].model_dump(exclude_none=True)


@pytest.mark.slow
@pytest.mark.extended
def test_responses_json_schema_validates(url):
    client = openai_client(url, Recorder())
    settings = dict(model=MODEL, input="Who is the king?", max_output_tokens=300, temperature=1.0)
    parsed = client.responses.parse(text_format=Person, **settings)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    schema = {**Person.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict mode asks
    raw = client.responses.create(text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                   "strict": True}}, **settings)
    jsonschema.validate(json.loads(raw.output_text), schema)


@pytest.mark.slow
@pytest.mark.extended
def test_chat_tool_round_trip_with_reasoning_content_passed_back(url):
    """The chat endpoint's round trip as DeepSeek's API documents it: the assistant's
    `reasoning_content` sent back with its `tool_calls`."""
    client = openai_client(url, Recorder())
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city.",
                                               "parameters": CITY}}]
    messages: list[dict[str, Any]] = [{"role": "system", "content": BRIEF}, {"role": "user", "content": ASK}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                           max_tokens=300, temperature=0).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls
    thought = first.message.model_extra["reasoning_content"]
    assert thought
    messages.append({"role": "assistant", "content": first.message.content, "reasoning_content": thought,
                     "tool_calls": [c.model_dump() for c in first.message.tool_calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": FORECAST} for c in first.message.tool_calls]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=40,
                                            temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls


# ---- V3.1's format: the same round trips with thinking switched on -------------------------------------------------
@pytest.fixture(scope="module")
def v31_url():
    """The demo model behind V3.1's chat template and tool format (thinking switchable), in process:
    the grammar of required calls writes V3.1's markup, which the demo model was not trained on."""
    from dsr1.generation.tokenizer import Tokenizer
    from dsr1.server import BackgroundServer, ServerConfig, create_app
    from dsr1.serving import Engine

    model = dsr1.load(dsr1.demo_checkpoint(), dtype="float32", progress=False)
    tokenizer = Tokenizer(dsr1.load_tokenizer(dsr1.demo_checkpoint()).backend, "deepseek-v3.1")
    engine = Engine(model, max_seqs=2, page_size=16, num_pages=128, prefill_chunk=64, prefill_rows=1,
                    max_seq_len=1024, tokenizer=tokenizer)
    server = BackgroundServer(create_app(engine, ServerConfig(model_name=MODEL)), shutdown_timeout=5.0).start()
    yield server.url
    server.stop()


THOUGHT = "The forecast tool knows Verona."  # the reasoning passed back (the demo model's is empty on V3.1)


# Thinking switched on per API (`chat_template_kwargs`, `reasoning.effort`, `thinking`), a required
# call in V3.1's format, then its result with the call's turn passed back carrying reasoning
# (`reasoning_content`, a reasoning item, a thinking block): accepted, and rendered as V3.1's template
# says (it drops earlier turns' reasoning: the prompt is the one without it).
@pytest.mark.slow
@pytest.mark.extended
def test_v31_chat_round_trip_with_reasoning_content_passed_back(v31_url):
    client = openai_client(v31_url, Recorder())
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city.",
                                               "parameters": CITY}}]
    on = {"chat_template_kwargs": {"thinking": True}}
    ask: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    first = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required",
                                           max_tokens=200, temperature=0, extra_body=on).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls
    results = [{"role": "tool", "tool_call_id": c.id, "content": FORECAST} for c in first.message.tool_calls]
    turn = {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in first.message.tool_calls]}
    answers = [client.chat.completions.create(model=MODEL, messages=[*ask, {**turn, **extra}, *results], tools=tools,
                                              max_tokens=30, temperature=0, extra_body=on)
               for extra in ({"reasoning_content": THOUGHT}, {})]
    assert answers[0].choices[0].message.content and not answers[0].choices[0].message.tool_calls
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.extended
def test_v31_responses_round_trip_with_a_reasoning_item_passed_back(v31_url):
    client = openai_client(v31_url, Recorder())
    ask = [{"role": "user", "content": ASK}]
    effort = dict(model=MODEL, tools=[RESPONSE_WEATHER], reasoning={"effort": "low"}, temperature=0)
    response = client.responses.create(input=ASK, tool_choice="required", max_output_tokens=200, **effort)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and calls
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": THOUGHT}]}
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": FORECAST} for c in calls]
    replies = [client.responses.create(input=[*ask, *passed, *calls, *outputs], max_output_tokens=30, **effort)
               for passed in ([thought], [])]
    assert replies[0].output_text and replies[0].usage.input_tokens == replies[1].usage.input_tokens


@pytest.mark.slow
@pytest.mark.extended
def test_v31_messages_round_trip_with_a_thinking_block_passed_back(v31_url):
    messages = claude(v31_url, Recorder())
    ask = [{"role": "user", "content": ASK}]
    thinking = dict(model=MODEL, tools=[WEATHER], thinking={"type": "enabled", "budget_tokens": 20}, extra_body=GREEDY)
    use = messages.messages.create(messages=ask, tool_choice={"type": "any"}, max_tokens=200, **thinking)
    uses = [b.to_dict() for b in use.content if b.type == "tool_use"]
    assert use.stop_reason == "tool_use" and uses
    tool_results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"], "content": FORECAST}
                                                for u in uses]}
    block = {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    said = messages.messages.create(messages=[*ask, {"role": "assistant", "content": [block, *uses]}, tool_results],
                                    max_tokens=30, **thinking)
    unthought = messages.messages.count_tokens(model=MODEL, tools=[WEATHER], thinking=thinking["thinking"], messages=[
        *ask, {"role": "assistant", "content": uses}, tool_results]).input_tokens
    assert said.content[-1].type == "text" and said.content[-1].text
    assert said.usage.input_tokens + (said.usage.cache_read_input_tokens or 0) == unthought
