"""The server for real clients (`dsr1.server`), driven by the official `openai` client: tool calls
(whole and streamed, `required` and named constrained by a grammar), structured outputs
(`response_format` json_schema validating in 50 of 50 requests on the demo model and on a
random-weight model, free neighbours unchanged), prompt log-probabilities (`echo` as
lm-evaluation-harness sends it, equal to `Model.forward`'s), vLLM's sampling parameters honoured
or refused, `/tokenize`, `/detokenize`, `/version`, CORS, `/health` on a stalled engine and while
draining, vLLM's metric names, the body limit and the size check before tokenization.

The tool and JSON paths run on the demo model (a small DeepSeek-V3 trained by the project, vocabulary
of 4,096) and on random weights of the same shapes: its small vocabulary keeps the grammar masks
cheap. Tests of engine features (grammars, prompt log-probabilities, the newer sampling fields) are
skipped on an engine that lacks them.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import socket
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dsr1
from dsr1.generation.sampling import Sampling
from dsr1.generation.tokenizer import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP
from dsr1.server import BackgroundServer, ServerConfig, create_app
from dsr1.server.guided import constraint_of, reasoning_budget
from dsr1.server.options import origins
from dsr1.server.prepare import Limits, bad_words_ids, plan_chat
from dsr1.server.protocol import ChatCompletionRequest
from dsr1.server.runner import EngineRunner
from dsr1.server.schema_bounds import SchemaBounds, bounded_schema, fitting_bounds, longest_output
from dsr1.server.tools import ToolCallSplitter, parse_tools, split_tool_calls, tool_call_grammar
from dsr1.serving import Engine, EngineStats, Request

pytestmark = pytest.mark.slow  # its module fixtures start servers or engines: out of the quick tier

MODEL = "demo"
SHAPES = dict(max_seqs=16, page_size=16, num_pages=512, prefill_chunk=64, prefill_rows=2, max_seq_len=1024)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10}},
                   "required": ["word"], "additionalProperties": False}}}
TOOLS = [WEATHER, LOOKUP]
# Extra properties allowed (`additionalProperties` absent or true), strings and integers without bounds.
NOTE = {"type": "function", "function": {
    "name": "take_note", "description": "Write a note down, with any fields it needs.",
    "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "pages": {"type": "integer"}},
                   "required": ["title", "pages"]}}}
REMEMBER = {"type": "function", "function": {
    "name": "remember", "description": "Keep any facts for later.",
    "parameters": {"type": "object", "properties": {"about": {"type": "string"}, "facts": {"type": "array"}},
                   "additionalProperties": True}}}
OPEN_TOOLS = [NOTE, REMEMBER]
OPEN_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in OPEN_TOOLS}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["king", "queen", "fool"]},
    "loyal": {"type": "boolean"}},
    "required": ["name", "age", "role", "loyal"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What weather will Verona have, and who is the king?"}]


# ---- parsing, grammars, checks (no server) ----------------------------------------------------
def test_tool_calls_parse_whole_and_streamed_alike():
    calls = (f'Let me look.{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{{"city": "Rome", '
             f'"days": 2}}\n```{CALL_END}\n{CALL_BEGIN}function{TOOL_SEP}lookup\n```json\n{{"word": "a`b"}}\n```'
             f'{CALL_END}{CALLS_END}')
    content, found = split_tool_calls(calls)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in found] == [("get_weather", {"city": "Rome", "days": 2}),
                                                                   ("lookup", {"word": "a`b"})]
    assert split_tool_calls("no calls here") is None
    cut, partial = split_tool_calls(f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}f\n```json\n{{")  # max_tokens
    assert cut == "" and [(c.name, c.arguments, c.complete) for c in partial] == [("f", "{", False)]
    rng = np.random.default_rng(0)
    for _ in range(300):
        cuts = np.sort(rng.integers(0, len(calls) + 1, size=int(rng.integers(0, 8))))
        pieces = [calls[a:b] for a, b in zip([0, *cuts], [*cuts, len(calls)])]
        splitter, text, assembled = ToolCallSplitter(), "", {}
        for k, piece in enumerate(pieces):
            delta, deltas = splitter.push(piece, final=k == len(pieces) - 1)
            text += delta
            for d in deltas:  # as the openai client joins them
                call = assembled.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += d["function"].get("name") or ""
                call["arguments"] += d["function"]["arguments"]
                assert ("id" in d) == (d["function"].get("name") is not None)
        assert text == content
        assert [(c["name"], c["arguments"]) for c in assembled.values()] == [(c.name, c.arguments) for c in found]


def masked_walk(tokenizer: dsr1.Tokenizer, grammar: str, seed: int, budget: int = 400) -> str:
    """A random token walk through a grammar's masks (what a random model under the constraint does)."""
    import llguidance.numpy
    from llguidance import LLMatcher, LLTokenizer

    lltok = LLTokenizer(str(dsr1.demo_checkpoint() / "tokenizer.json"))
    matcher, rng = LLMatcher(lltok, grammar), np.random.default_rng(seed)
    mask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
    out = []
    for _ in range(budget):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:lltok.vocab_size])
        token = int(rng.choice(allowed))
        if tokenizer.think_end_id in allowed and rng.random() < 0.2:
            token = tokenizer.think_end_id
        if lltok.eos_token in allowed and rng.random() < 0.5:
            token = lltok.eos_token
        assert matcher.consume_token(token), matcher.get_error()
        if token == lltok.eos_token:
            return tokenizer.decode(out)
        out.append(token)
        if matcher.is_stopped():
            return tokenizer.decode(out)
    raise AssertionError("the walk did not end")


def test_grammars_only_allow_valid_calls_and_json():
    tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())
    tools = parse_tools(TOOLS)
    for seed in range(20):
        choice = "required" if seed % 2 else "lookup"
        text = masked_walk(tokenizer, tool_call_grammar(tools, choice, tokenizer, reasoning=16), seed)
        reasoning, _, answer = text.partition("</think>")
        content, calls = split_tool_calls(answer.lstrip("\n"))
        assert content == "" and calls and (choice == "required" or [c.name for c in calls] == ["lookup"])
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    one = [t for t in tools if t.name == "lookup"]  # "required" with a single tool: exactly one call
    _, calls = split_tool_calls(masked_walk(tokenizer, tool_call_grammar(one, "required", tokenizer, None), 0))
    assert [c.name for c in calls] == ["lookup"]
    body = ChatCompletionRequest(model="m", messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for seed in range(20):
        text = masked_walk(tokenizer, constraint_of(body).grammar(tokenizer, None), seed)
        jsonschema.validate(json.loads(text), PERSON)
    choice = ChatCompletionRequest(model="m", messages=ASK, guided_choice=["yes", "no"])
    assert {masked_walk(tokenizer, constraint_of(choice).grammar(tokenizer, None), s) for s in range(8)} <= {
        "yes", "no"}


def test_open_schemas_are_bounded_to_fit_the_budget():
    """Schemas that allow extra properties and unbounded strings get bounded keys, values and lengths:
    random walks through the grammar end within the budget, valid against the original schemas."""
    tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())
    schema = OPEN_SCHEMAS["take_note"]
    assert bounded_schema(SCHEMAS["get_weather"]) == SCHEMAS["get_weather"]  # closed and bounded already
    roomy = bounded_schema(schema)
    assert roomy["properties"]["title"]["maxLength"] == SchemaBounds().string_length
    assert roomy["maxProperties"] == 2 + SchemaBounds().extra_properties
    assert bounded_schema(OPEN_SCHEMAS["remember"])["additionalProperties"] is False  # optional ones: no extras
    assert longest_output(roomy) is not None and longest_output(bounded_schema({"$ref": "#/x"})) is None
    for budget in (120, 400, 4000):
        bounds = fitting_bounds(list(OPEN_SCHEMAS.values()), budget)
        assert max(longest_output(bounded_schema(s, bounds)) for s in OPEN_SCHEMAS.values()) <= budget
        assert (bounds.extra_properties > 0) == (budget > 1000)
    tools = parse_tools(OPEN_TOOLS)
    for seed in range(12):
        grammar = tool_call_grammar(tools, "required" if seed % 2 else "take_note", tokenizer, None, budget=150)
        _, calls = split_tool_calls(masked_walk(tokenizer, grammar, seed, budget=150))
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), OPEN_SCHEMAS[call.name])
    walks = [json.loads(split_tool_calls(masked_walk(tokenizer, tool_call_grammar(
        tools[:1], "take_note", tokenizer, None), s, budget=6000))[1][0].arguments) for s in range(4)]
    assert all(len(walk) <= 6 and all(len(key) <= 32 for key in walk) for walk in walks)
    assert any(set(walk) - {"title", "pages"} for walk in walks)  # extra properties stay possible


def test_reasoning_is_bounded_so_the_constrained_answer_always_comes():
    """A model that never closes its reasoning (the demo model) still answers: `</think>` is forced
    after the budget; budget 0 forces it first."""
    from llguidance import LLMatcher, LLTokenizer

    tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())
    lltok = LLTokenizer(str(dsr1.demo_checkpoint() / "tokenizer.json"))
    body = ChatCompletionRequest(model="m", messages=ASK, guided_choice=["yes", "no"])
    for budget in (0, 1, 9):
        matcher = LLMatcher(lltok, constraint_of(body).grammar(tokenizer, budget))
        rng, out = np.random.default_rng(0), []
        while not matcher.is_stopped():
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                                   bitorder="little")[:lltok.vocab_size])
            shunned = allowed[(allowed != tokenizer.think_end_id) & (allowed != lltok.eos_token)]
            token = int(rng.choice(shunned if len(shunned) else allowed))  # reason as long as allowed
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
            assert len(out) < 64
        assert out.index(tokenizer.think_end_id) == budget
        assert tokenizer.decode(out[budget + 1:]).strip("\n") in ("yes", "no")
    assert reasoning_budget(None, 512, 200) == 50 and reasoning_budget(7, 512, 200) == 7
    limits = Limits(MODEL, 1024, 4096, 64, 16, max_reasoning_tokens=30)
    for requested, expected in ((None, 30), (7, 7), (0, None), (500, 50)):
        asked = body.model_copy(update={"model": MODEL, "max_tokens": 200, "max_reasoning_tokens": requested})
        grammar = plan_chat(asked, tokenizer, limits).grammars[0]
        assert (f"reasoning[max_tokens={expected}]" in grammar) if expected else "reasoning" not in grammar
    assert reasoning_budget(None, 16, 200) == 16 and reasoning_budget(0, 512, 200) == 0


def test_bad_words_are_tokenized_as_vllm_does():
    tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())
    ids = bad_words_ids(["king", " queen"], tokenizer)
    assert tuple(tokenizer.encode("king")) in ids and tuple(tokenizer.encode("queen")) in ids
    spaced = tuple(tokenizer.encode(" king"))
    assert (spaced in ids) == (len(spaced) == len(tokenizer.encode("king")) and spaced[0] != ids[0][0])


def test_allowed_origins_parse_as_json_or_commas():
    assert origins('["*"]') == ["*"] and origins("http://a.example, http://b.example") == [
        "http://a.example", "http://b.example"]


def test_a_stalled_engine_is_reported():
    """The runner against an engine whose step hangs: `stalled` turns true once the time passes."""
    release = threading.Event()

    class HangingEngine:
        has_work = False

        def stats(self) -> EngineStats:
            return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})

        def submit(self, prompt, *, sampling, on_text, logprobs) -> Request:
            self.has_work = True
            return Request(0, prompt, sampling, None, on_text=on_text, top_logprobs=logprobs)

        def step(self) -> None:
            release.wait(30)
            self.has_work = False

    runner = EngineRunner(HangingEngine(), capacity=2)
    runner.start()
    try:
        time.sleep(0.3)
        assert not runner.stalled(0.2)  # idle: no work, no stall
        runner.submit([[1, 2]], [Sampling()], lambda update: None)
        assert not runner.stalled(0.2)
        time.sleep(0.4)
        assert runner.stalled(0.2) and not runner.stalled(30)
    finally:
        release.set()
        runner.stop()


# ---- one server on the demo model --------------------------------------------------------------
class Served:
    def __init__(self, model: dsr1.Model, tokenizer: dsr1.Tokenizer, shapes: dict[str, int] | None = None,
                 **config: Any):
        self.engine = Engine(model, **(shapes or SHAPES), tokenizer=tokenizer)
        self.engine.warm_up()
        self.app = create_app(self.engine, ServerConfig(model_name=MODEL, **config))
        self.server = BackgroundServer(self.app, shutdown_timeout=5.0).start()
        self.url = self.server.url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300.0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def tokenizer() -> dsr1.Tokenizer:
    return dsr1.load_tokenizer(dsr1.demo_checkpoint())


@pytest.fixture(scope="module")
def demo_model() -> dsr1.Model:
    return dsr1.load(dsr1.demo_checkpoint(), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def demo(demo_model, tokenizer):
    served = Served(demo_model, tokenizer, max_waiting=200, default_max_tokens=64,
                    allowed_origins=("http://notebook.example",))
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def noise(tokenizer):
    """Random weights in the demo model's shapes: only the grammar can make its output valid."""
    model = dsr1.init_random(dsr1.Config.from_hf(dsr1.demo_checkpoint()), seed=3, dtype="float32")
    served = Served(model, tokenizer, max_waiting=200, default_max_tokens=64)
    yield served
    served.server.stop()


def run_all(count: int, work) -> list[Any]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(work, range(count)))


def test_tokenize_detokenize_version(demo, tokenizer):
    text = "To be, or not to be"
    reply = httpx.post(demo.url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert reply["tokens"] == tokenizer.encode(text, add_bos=True) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == SHAPES["max_seq_len"] and "".join(reply["token_strs"][1:]) == text
    chat = httpx.post(demo.url + "/tokenize", json={"messages": ASK}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(ASK)
    assert httpx.post(demo.url + "/detokenize", json={"tokens": reply["tokens"][1:]}).json() == {"prompt": text}
    bad = httpx.post(demo.url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(demo.url + "/version").json() == {"version": dsr1.__version__}


def test_cors_preflight_and_headers(demo):
    preflight = httpx.options(demo.url + "/v1/chat/completions", headers={
        "Origin": "http://notebook.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://notebook.example"
    other = httpx.options(demo.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                             "Access-Control-Request-Method": "GET"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    listed = httpx.get(demo.url + "/v1/models", headers={"Origin": "http://notebook.example"})
    assert listed.headers["access-control-allow-origin"] == "http://notebook.example"


@pytest.mark.slow
def test_a_huge_prompt_is_refused_without_stalling_the_server(demo):
    """8 MB of prompt: refused by its size before tokenization; /health answers fast meanwhile."""
    body = json.dumps({"model": MODEL, "prompt": "word " * ((8 << 20) // 5), "max_tokens": 1}).encode()
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        demo.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=120)))
    probe = httpx.Client(base_url=demo.url, timeout=10)  # connected before the prompt is sent
    assert probe.get("/health").status_code == 200
    sender.start()
    latencies = []
    while sender.is_alive():
        start = time.perf_counter()
        assert probe.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.01)
    sender.join()
    probe.close()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < 0.1, latencies


def test_the_body_limit_is_enforced_while_reading(demo):
    # A raw socket: an HTTP client refuses to declare more bytes than it sends.
    url = httpx.URL(demo.url)
    with socket.create_connection((url.host, url.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{}" % (65 << 20))
        assert conn.recv(4096).split(b" ")[1] == b"413"  # answered without waiting for the declared bytes
    sent = 0

    def chunks():  # no Content-Length: the server counts what arrives
        nonlocal sent
        while sent < (80 << 20):
            sent += 1 << 20
            yield b" " * (1 << 20)

    try:
        response = httpx.post(demo.url + "/v1/completions", content=chunks(), timeout=60)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
        pass  # the server answered and closed before the client finished sending


def test_vllm_metric_names_with_the_model_label(demo):
    client = demo.client()
    reply = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, temperature=0)
    samples = demo.metrics()
    label = (("model_name", MODEL),)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert (name, label) in samples, name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert samples[(name + "_count", label)] >= 1, name
    assert samples[("vllm:request_prompt_tokens_sum", label)] >= reply.usage.prompt_tokens
    assert 0 <= samples[("vllm:kv_cache_usage_perc", label)] <= 1
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))] >= 1


# ---- vLLM's sampling parameters -------------------------------------------------------------------
def greedy(client: openai.OpenAI, **extra: Any) -> Any:
    body = {k: extra.pop(k) for k in list(extra) if k in ("stop", "logit_bias", "n")}
    return client.completions.create(model=MODEL, prompt=extra.pop("prompt", "ROMEO:\n"), temperature=0,
                                     max_tokens=extra.pop("max_tokens", 12), extra_body=extra or None, **body
                                     ).choices[0]


def chat_greedy(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Good morrow."}],
                                          temperature=0, max_tokens=extra.pop("max_tokens", 60),
                                          extra_body=extra or None)


def test_stop_token_ids_stop(demo, tokenizer):
    client = demo.client()
    free = greedy(client)
    ids = tokenizer.encode(free.text)
    stopped = greedy(client, stop_token_ids=[ids[3]])
    assert stopped.finish_reason == "stop" and tokenizer.encode(stopped.text) == ids[:ids.index(ids[3])]


def test_ignore_eos_and_min_tokens_run_past_the_end(demo):
    client = demo.client()
    natural = chat_greedy(client)
    assert natural.choices[0].finish_reason == "stop"  # the demo model ends its replies
    tokens = natural.usage.completion_tokens
    ignored = chat_greedy(client, ignore_eos=True)
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 60
    longer = chat_greedy(client, min_tokens=tokens + 5)
    assert longer.usage.completion_tokens >= tokens + 5


def test_logit_bias_and_allowed_token_ids_steer_every_token(demo, tokenizer):
    client = demo.client()
    target = tokenizer.encode(" crown")[0]
    assert greedy(client, logit_bias={str(target): 100}).text == tokenizer.decode([target] * 12)
    allowed = tokenizer.encode(" the king")
    text = greedy(client, allowed_token_ids=allowed).text
    assert set(tokenizer.encode(text)) <= set(allowed) and text


def test_bad_words_never_appear(demo, tokenizer):
    client = demo.client()
    free = greedy(client, max_tokens=30).text
    word = free.split()[0]
    banned = greedy(client, max_tokens=30, bad_words=[word]).text
    assert banned != free
    for ids in bad_words_ids([word], tokenizer):
        found = tokenizer.encode(banned)
        assert not any(found[k:k + len(ids)] == list(ids) for k in range(len(found))), (word, banned)


def test_include_stop_str_in_output_keeps_the_stop(demo):
    client = demo.client()
    free = greedy(client, max_tokens=30).text
    stop = free[10:13]
    assert greedy(client, max_tokens=30, stop=[stop]).text == free[:free.index(stop)]
    assert greedy(client, max_tokens=30, stop=[stop], include_stop_str_in_output=True).text == free[
        :free.index(stop) + len(stop)]


def test_skip_special_tokens_drops_them_from_the_text(demo, tokenizer):
    client = demo.client()
    user = tokenizer.backend.token_to_id("<｜User｜>")
    kept = greedy(client, max_tokens=3, logit_bias={str(user): 100}, skip_special_tokens=False).text
    assert kept == "<｜User｜>" * 3
    assert greedy(client, max_tokens=3, logit_bias={str(user): 100}).text == ""  # vLLM's default skips them


# ---- prompt log-probabilities -----------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_as_lm_eval_sends_them_equal_forward(demo, demo_model, tokenizer, max_tokens):
    """lm-evaluation-harness `local-completions` scores a choice from `echo: true, logprobs: 1` over
    token-id prompts: the sum of `token_logprobs[ctxlen:-1]` (with max_tokens 1)."""
    context = tokenizer.encode("KING HENRY:\nOnce more unto the breach,", add_bos=True)
    choices = [tokenizer.encode(" dear friends"), tokenizer.encode(" good cheese"), tokenizer.encode(" once more")]
    body = {"model": MODEL, "prompt": [context + c for c in choices], "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "echo": True, "seed": 1234}
    reply = httpx.post(demo.url + "/v1/completions", json=body, timeout=120).json()
    for choice, continuation in zip(sorted(reply["choices"], key=lambda c: c["index"]), choices):
        prompt = context + continuation
        logp = log_softmax(np.asarray(demo_model.forward(np.array([prompt], np.int32)))[0])
        values = choice["logprobs"]["token_logprobs"]
        assert len(values) == len(prompt) + max_tokens and values[0] is None
        assert choice["text"].startswith(tokenizer.decode(prompt))
        want = [logp[k - 1, prompt[k]] for k in range(1, len(prompt))]
        assert np.allclose(values[1:len(prompt)], want, atol=1e-4)
        scored = values[len(context):len(prompt)]
        assert abs(sum(scored) - sum(want[len(context) - 1:])) < 1e-4 * len(scored)
        for k, top in enumerate(choice["logprobs"]["top_logprobs"][1:len(prompt)], start=1):
            assert max(top.values()) == pytest.approx(logp[k - 1].max(), abs=1e-4)
    assert reply["usage"]["completion_tokens"] == max_tokens * len(choices)


def test_vllm_prompt_logprobs(demo, demo_model, tokenizer):
    prompt = tokenizer.encode("To be, or not to be", add_bos=True)
    reply = httpx.post(demo.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                           "temperature": 0, "prompt_logprobs": 2}).json()
    entries = reply["choices"][0]["prompt_logprobs"]
    logp = log_softmax(np.asarray(demo_model.forward(np.array([prompt], np.int32)))[0])
    assert len(entries) == len(prompt) and entries[0] is None
    for k in range(1, len(prompt)):
        assert abs(entries[k][str(prompt[k])]["logprob"] - logp[k - 1, prompt[k]]) < 1e-4
        ranked = sorted((v["rank"], int(t)) for t, v in entries[k].items() if v["rank"] is not None)
        assert [t for _, t in ranked][:2] == list(np.argsort(-logp[k - 1])[:2])


# ---- tool calls -----------------------------------------------------------------------------------
def assemble_stream(stream) -> dict[str, Any]:
    """A streamed chat reply joined as the openai client's users join it (tool calls by index)."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        for choice in chunk.choices:
            out["content"] += choice.delta.content or ""
            out["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""
            for call in choice.delta.tool_calls or []:
                joined = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                joined["id"] = joined["id"] or call.id
                joined["name"] += call.function.name or ""
                joined["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(demo, stream):
    """Call (named: the demo model would not call on its own), the tool's result, then the answer."""
    client = demo.client()
    settings = dict(model=MODEL, tools=TOOLS, temperature=0, max_tokens=120)
    named = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        joined = assemble_stream(client.chat.completions.create(messages=ASK, tool_choice=named, stream=True,
                                                                **settings))
        calls = [(c["id"], c["name"], c["arguments"]) for c in joined["calls"].values()]
        finish, content = joined["finish"], joined["content"]
    else:
        reply = client.chat.completions.create(messages=ASK, tool_choice=named, **settings)
        message = reply.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
        finish, content = reply.choices[0].finish_reason, message.content
    assert finish == "tool_calls" and len(calls) == 1 and not content
    call_id, name, arguments = calls[0]
    assert name == "get_weather" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": '{"forecast": "rain, then sun"}'}]
    answer = client.chat.completions.create(messages=turn, **settings)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls
    rendered = dsr1.load_tokenizer(dsr1.demo_checkpoint()).render_chat(
        [*ASK, turn[1], {"role": "tool", "content": turn[2]["content"]}])
    assert "<｜tool▁output▁begin｜>" in rendered and rendered.endswith("<｜tool▁outputs▁end｜>")
    tokens = httpx.post(demo.url + "/tokenize", json={"messages": [*ASK, turn[1], {"role": "tool", "content": turn[2][
        "content"]}], "add_generation_prompt": True}).json()["count"]
    assert answer.usage.prompt_tokens > tokens  # the rendered turns plus the tools' description


@pytest.mark.extended
@pytest.mark.slow
def test_required_and_named_calls_validate_50_of_50(demo):
    client = demo.client()

    def call(j: int) -> tuple[str, list[tuple[str, str]]]:
        choice = "required" if j % 2 else {"type": "function", "function": {"name": "lookup"}}
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=j, max_tokens=200)
        return reply.choices[0].finish_reason, [(c.function.name, c.function.arguments)
                                                for c in reply.choices[0].message.tool_calls]

    for j, (finish, calls) in enumerate(run_all(50, call)):
        assert finish == "tool_calls" and calls, (j, finish)
        assert j % 2 or [name for name, _ in calls] == ["lookup"]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.extended
@pytest.mark.slow
def test_required_calls_on_open_schemas_end_valid_50_of_50_and_a_cut_call_leaks_no_markup(demo):
    """Schemas allowing extra properties (the demo model would write one property name until
    max_tokens): every reply ends with valid calls; a reply cut inside its call has no markup as content."""
    client = demo.client()
    ask = [{"role": "user", "content": "Note down what the king said, and keep the facts."}]

    def call(j: int) -> Any:
        choice = "required" if j % 2 else {"type": "function", "function": {"name": "take_note"}}
        return client.chat.completions.create(model=MODEL, messages=ask, tools=OPEN_TOOLS, tool_choice=choice,
                                              temperature=1.0, seed=j, max_tokens=200).choices[0]

    for j, choice in enumerate(run_all(50, call)):
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls and not choice.message.content, (j, choice)
        assert j % 2 or [c.function.name for c in calls] == ["take_note"]
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), OPEN_SCHEMAS[c.function.name])
    for stream in (False, True):
        settings = dict(model=MODEL, messages=ask, tools=OPEN_TOOLS, tool_choice="required", temperature=0,
                        max_tokens=16, extra_body={"max_reasoning_tokens": 4})
        if stream:
            joined = assemble_stream(client.chat.completions.create(stream=True, **settings))
            finish, content = joined["finish"], joined["content"]
        else:
            reply = client.chat.completions.create(**settings).choices[0]
            finish, content = reply.finish_reason, reply.message.content
        assert finish == "length" and not content and "｜" not in (content or ""), (stream, content)


# ---- structured outputs -----------------------------------------------------------------------------
FREE = ["ROMEO:\n", "First Citizen:\n", "HAMLET:\nTo be", "JULIET:\nO Romeo"]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("which", ["demo", "noise"])
def test_json_schema_validates_50_of_50_beside_unchanged_free_requests(request, which):
    served = request.getfixturevalue(which)
    client = served.client()
    alone = [greedy(client, prompt=p, max_tokens=24, logprobs=0).logprobs.tokens for p in FREE]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def work(j: int) -> Any:
        if j < 50:
            reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1.0,
                                                   seed=j, max_tokens=200)
            return reply.choices[0]
        return greedy(client, prompt=FREE[j % 4], max_tokens=24, logprobs=0).logprobs.tokens

    results = run_all(58, work)
    for j, choice in enumerate(results[:50]):
        assert choice.finish_reason == "stop", (j, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert results[50:] == [alone[j % 4] for j in range(50, 58)]  # the neighbours changed no free token


@pytest.mark.parametrize("field", ["guided_json", "guided_regex", "guided_choice", "structured_outputs"])
def test_vllm_guided_fields(demo, field):
    value = {"guided_json": PERSON, "guided_regex": "[0-9]{3}-[a-z]{2}", "guided_choice": ["Romeo", "Juliet"],
             "structured_outputs": {"choice": ["Romeo", "Juliet"]}}[field]
    text = demo.client().completions.create(model=MODEL, prompt="Who loves Juliet?", max_tokens=60,
                                            extra_body={field: value}).choices[0].text
    if field == "guided_json":
        jsonschema.validate(json.loads(text), PERSON)
    elif field == "guided_regex":
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-"
    else:
        assert text in ("Romeo", "Juliet")


@pytest.mark.extended
@pytest.mark.slow
def test_64_concurrent_streams_mix_tools_schemas_echo_and_chat(demo, tokenizer):
    client = demo.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    plain = [chat_greedy(client, max_tokens=20).choices[0].message.content]

    def work(j: int) -> None:
        kind = j % 4
        if kind == 0:
            joined = assemble_stream(client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=j,
                max_tokens=200, stream=True))
            assert joined["finish"] == "tool_calls" and joined["calls"]
            for call in joined["calls"].values():
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        elif kind == 1:
            joined = assemble_stream(client.chat.completions.create(
                model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, seed=j, max_tokens=200,
                stream=True))
            jsonschema.validate(json.loads(joined["content"]), PERSON)
        elif kind == 2:
            chunks = list(client.completions.create(model=MODEL, prompt="ROMEO:\n", echo=True, logprobs=1,
                                                    max_tokens=4, temperature=0, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            values = [v for c in chunks if c.choices and c.choices[0].logprobs
                      for v in c.choices[0].logprobs.token_logprobs]
            assert text.startswith("ROMEO:\n") and values[0] is None
            assert len(values) == len(tokenizer.encode("ROMEO:\n", add_bos=True)) + 4
        else:
            joined = assemble_stream(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Good morrow."}], temperature=0, max_tokens=20,
                stream=True))
            assert joined["content"] == plain[0]

    run_all(64, work)


# ---- OpenAI's Responses API ---------------------------------------------------------------------
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


class Person(pydantic.BaseModel):
    """PERSON, as a client's `text_format` gives it."""

    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["king", "queen", "fool"]
    loyal: bool


def response_calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


def response_texts(response: Any) -> tuple[str, str]:
    reasoning = "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or ())
    return reasoning, response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_required_tool_round_trip_by_previous_id_and_by_items(demo, stream):
    """`tool_choice` required: valid calls after R1's reasoning, then the results and the answer, the
    conversation carried once by `previous_response_id` and once by passing the output items back."""
    client = demo.client()
    settings = dict(model=MODEL, max_output_tokens=150, tools=RESPONSE_TOOLS, temperature=0)
    if stream:
        with client.responses.stream(input=ASK[0]["content"], tool_choice="required", **settings) as events:
            kinds = [event.type for event in events]
            first = events.get_final_response()
        assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
        assert kinds[-1] == "response.completed"
    else:
        first = client.responses.create(input=ASK[0]["content"], tool_choice="required", **settings)
    calls = response_calls(first)
    assert first.status == "completed" and calls and first.output[0].type == "reasoning"
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT} for c in calls]
    settings["max_output_tokens"] = 40
    by_id = client.responses.create(input=results, previous_response_id=first.id, **settings)
    by_items = client.responses.create(input=[{"role": "user", "content": ASK[0]["content"]}, *first.output, *results],
                                       **settings)
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert response_texts(by_id) == response_texts(by_items) and by_id.output_text
    assert not response_calls(by_id)


def test_responses_text_format_json_schema_validates(demo):
    client = demo.client()
    settings = dict(model=MODEL, input="Who is the king?", max_output_tokens=200, temperature=1.0)
    response = client.responses.create(**settings, text={"format": {
        "type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    parsed = client.responses.parse(**settings, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.extended
@pytest.mark.slow
def test_responses_required_and_named_calls_validate_50_of_50(demo):
    client = demo.client()

    def call(j: int) -> Any:
        choice = "required" if j % 2 else {"type": "function", "name": "lookup"}
        settings = dict(model=MODEL, input=ASK[0]["content"], max_output_tokens=200, tools=RESPONSE_TOOLS,
                        tool_choice=choice, temperature=1.0)
        if j % 4 < 2:
            with client.responses.stream(**settings) as stream:
                return stream.get_final_response()
        return client.responses.create(**settings)

    for j, response in enumerate(run_all(50, call)):
        calls = response_calls(response)
        assert response.status == "completed" and calls, (j, response)
        assert j % 2 or [c.name for c in calls] == ["lookup"]
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ---- Anthropic's Messages API -------------------------------------------------------------------------
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESULT = '{"forecast": "rain, then sun"}'
# The block events a Messages stream sends (the SDK adds its own: text, thinking, input_json...).
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
              "message_stop"}


def anthropic_client(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=300.0)


def streamed_message(client: anthropic.Anthropic, **settings: Any) -> tuple[Any, list[str]]:
    """`messages.stream`'s final message and the raw events it was made of."""
    with client.messages.stream(**settings) as stream:
        events = [event.type for event in stream if event.type in RAW_EVENTS]
        return stream.get_final_message(), events


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_round_trip_with_thinking_passed_back(demo, stream):
    """`tool_choice` any: a valid call (after R1's thinking), then the tool's result and the answer,
    the first reply passed back as it came (its thinking block included)."""
    client = anthropic_client(demo)
    ask = [{"role": "user", "content": ASK[0]["content"]}]
    settings = dict(model=MODEL, max_tokens=150, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    if stream:
        first, events = streamed_message(client, messages=ask, tool_choice={"type": "any"}, **settings)
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        assert events.count("content_block_start") == events.count("content_block_stop") == len(first.content)
    else:
        first = client.messages.create(messages=ask, tool_choice={"type": "any"}, **settings)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and [b.type for b in first.content[:1]] == ["thinking"]
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, SCHEMAS[use.name])
    results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": RESULT}
                                           for u in uses]}
    turns = [*ask, first.to_param(), results]
    answer = client.messages.create(messages=turns, **{**settings, "max_tokens": 40})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content if b.type != "thinking"] == ["text"] and answer.content[-1].text
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=ANTHROPIC_TOOLS).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    if stream:
        return
    # The same conversation on the chat endpoint renders the same prompt; R1's template drops the thinking.
    chat_turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
        for u in uses]}, *[{"role": "tool", "tool_call_id": u.id, "content": RESULT} for u in uses]]
    chat = demo.client().chat.completions.create(model=MODEL, messages=chat_turns, tools=TOOLS, max_tokens=1)
    assert chat.usage.prompt_tokens == counted
    unthought = [*ask, {"role": "assistant", "content": [b for b in turns[1]["content"] if b.type != "thinking"]},
                 results]
    assert client.messages.count_tokens(model=MODEL, messages=unthought, tools=ANTHROPIC_TOOLS).input_tokens == counted


def test_messages_stop_sequences_max_tokens_and_the_stream_equal_whole(demo):
    client = anthropic_client(demo)
    settings = dict(model=MODEL, messages=[{"role": "user", "content": "Good morrow."}], extra_body={"temperature": 0})
    free = client.messages.create(max_tokens=60, **settings)
    thought = "".join(b.thinking for b in free.content if b.type == "thinking")
    text = "".join(b.text for b in free.content if b.type == "text")
    stop = next(text[k:k + 4] for k in range(len(text) // 2, len(text) - 4) if text[k:k + 4] not in thought)
    cut = client.messages.create(max_tokens=60, stop_sequences=["never said", stop], **settings)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content if b.type == "text") == text[:text.index(stop)]
    streamed, _ = streamed_message(client, max_tokens=60, stop_sequences=["never said", stop], **settings)
    assert [b.model_dump(exclude={"parsed_output"}) for b in streamed.content] == [b.model_dump() for b in cut.content]
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.usage.output_tokens) == (
        cut.stop_reason, stop, cut.usage.output_tokens)
    short = client.messages.create(max_tokens=3, **settings)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert client.messages.count_tokens(model=MODEL, messages=settings["messages"]).input_tokens == \
        short.usage.input_tokens + short.usage.cache_read_input_tokens


def test_messages_output_config_format_is_json_valid_against_its_schema(demo):
    message = anthropic_client(demo).messages.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Who is the king?"}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}}, extra_body={"temperature": 1.0})
    assert message.stop_reason == "end_turn" and message.content[-1].type == "text"
    jsonschema.validate(json.loads(message.content[-1].text), PERSON)


@pytest.mark.extended
@pytest.mark.slow
def test_messages_any_and_named_tool_use_validate_50_of_50(demo):
    client = anthropic_client(demo)

    def call(j: int) -> Any:
        choice = {"type": "any"} if j % 2 else {"type": "tool", "name": "lookup"}
        settings = dict(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": ASK[0]["content"]}],
                        tools=ANTHROPIC_TOOLS, tool_choice=choice, extra_body={"temperature": 1.0})
        return streamed_message(client, **settings)[0] if j % 4 < 2 else client.messages.create(**settings)

    for j, message in enumerate(run_all(50, call)):
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses, (j, message)
        assert j % 2 or [u.name for u in uses] == ["lookup"]
        for use in uses:
            jsonschema.validate(use.input, SCHEMAS[use.name])


def messages_stream(claude: anthropic.Anthropic, **settings: Any) -> dict[str, Any]:
    """A Messages stream's text, tool uses and stop reason, read from its raw events."""
    out: dict[str, Any] = {"text": "", "inputs": [], "names": [], "stop": None}
    for event in claude.messages.create(stream=True, **settings):
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            out["names"].append(event.content_block.name)
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            out["text"] += event.delta.text
        elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            out["inputs"].append(json.loads(event.delta.partial_json))
        elif event.type == "message_delta":
            out["stop"] = event.delta.stop_reason
    return out


def mixed_streams(url: str, count: int = 64) -> None:
    """`count` concurrent streams against the server at `url`, Messages, Responses and chat, tools and
    text, each checked (run in a process of its own, so the clients do not share the server's GIL)."""
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300.0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300.0)
    ask = [{"role": "user", "content": ASK[0]["content"]}]
    plain = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "Good morrow."}],
             "extra_body": {"temperature": 0}}
    alone = "".join(b.text for b in claude.messages.create(**plain).content if b.type == "text")

    def work(j: int) -> None:
        if j % 6 == 0:
            reply = messages_stream(claude, model=MODEL, max_tokens=200, messages=ask, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "any"}, extra_body={"temperature": 1.0})
            assert reply["stop"] == "tool_use" and reply["inputs"]
            for name, value in zip(reply["names"], reply["inputs"], strict=True):
                jsonschema.validate(value, SCHEMAS[name])
        elif j % 6 == 1:
            assert messages_stream(claude, **plain)["text"] == alone
        elif j % 6 == 4:
            with client.responses.stream(model=MODEL, input=ask[0]["content"], tools=RESPONSE_TOOLS,
                                         tool_choice="required", temperature=1.0, max_output_tokens=200) as stream:
                calls = response_calls(stream.get_final_response())
            assert calls and all(jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name]) is None for c in calls)
        elif j % 6 == 5:
            with client.responses.stream(model=MODEL, input="Good morrow.", temperature=0,
                                         max_output_tokens=20) as stream:
                assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == alone
        else:
            joined = assemble_stream(client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=200,
                stream=True) if j % 6 == 2 else client.chat.completions.create(
                model=MODEL, messages=plain["messages"], temperature=0, max_tokens=20, stream=True))
            assert joined["finish"] in ("tool_calls", "stop", "length") and (j % 6 == 3 or joined["calls"])

    run_all(count, work)


@pytest.mark.extended
@pytest.mark.slow
def test_64_concurrent_messages_and_chat_streams_complete_while_health_answers_fast(demo):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(int).result()  # the client process is up before the probing starts
        latencies: list[float] = []
        with httpx.Client(base_url=demo.url, timeout=10) as http:
            load = pool.submit(mixed_streams, demo.url)
            while not load.done():
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)
        load.result()
    assert latencies and max(latencies) < 0.1, sorted(latencies)[-5:]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("chat_format", ["deepseek-v3.2", "deepseek-v4"])
def test_dsml_tool_round_trips_on_three_apis(demo_model, tokenizer, chat_format):
    """The demo model behind V3.2's / V4's encoder (its DSML calls): call, result and answer on the
    chat (thinking on, the reasoning passed back; streamed and whole), Responses and Messages APIs,
    the calls the grammar's, no markup in any text."""
    # The DSML markup and the encoders' tool descriptions are long in the demo model's small vocabulary.
    served = Served(demo_model, dsr1.Tokenizer(tokenizer.backend, chat_format), {**SHAPES, "max_seq_len": 2048},
                    max_waiting=16, default_max_tokens=64)
    try:
        client, named = served.client(), {"type": "function", "function": {"name": "get_weather"}}
        settings = dict(model=MODEL, tools=TOOLS[:1], temperature=0, max_tokens=300,
                        extra_body={"chat_template_kwargs": {"thinking": True}})
        whole = client.chat.completions.create(messages=ASK, tool_choice=named, **settings).choices[0]
        streamed = assemble_stream(client.chat.completions.create(messages=ASK, tool_choice=named, stream=True,
                                                                  **settings))
        (call,) = whole.message.tool_calls
        assert whole.finish_reason == streamed["finish"] == "tool_calls" and not whole.message.content
        assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
            (call.function.name, call.function.arguments)]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        turn = [*ASK, {"role": "assistant", "content": None, "reasoning_content": whole.message.reasoning_content,
                       "tool_calls": [call.model_dump()]}, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        answer = client.chat.completions.create(messages=turn, **{**settings, "max_tokens": 40}).choices[0]
        assert not answer.message.tool_calls and "DSML" not in (answer.message.content or "") + (
            answer.message.reasoning_content or "")
        first = client.responses.create(model=MODEL, input=ASK[0]["content"], tool_choice="required",
                                        tools=RESPONSE_TOOLS[:1], max_output_tokens=300, temperature=0)
        results = [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
                   for c in response_calls(first)]
        assert results and not any("DSML" in t for t in response_texts(first))
        later = client.responses.create(model=MODEL, input=results, previous_response_id=first.id,
                                        tools=RESPONSE_TOOLS[:1], max_output_tokens=30, temperature=0)
        assert later.status in ("completed", "incomplete") and not response_calls(later)
        anthropic = anthropic_client(served)
        ask = [{"role": "user", "content": ASK[0]["content"]}]
        message = anthropic.messages.create(model=MODEL, max_tokens=300, tools=ANTHROPIC_TOOLS[:1], messages=ask,
                                            tool_choice={"type": "any"}, extra_body={"temperature": 0})
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses
        results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": RESULT}
                                               for u in uses]}
        done = anthropic.messages.create(model=MODEL, max_tokens=30, tools=ANTHROPIC_TOOLS[:1], extra_body={
            "temperature": 0}, messages=[*ask, {"role": "assistant", "content": message.content}, results])
        assert done.stop_reason in ("end_turn", "max_tokens") and not any(b.type == "tool_use" for b in done.content)
    finally:
        served.server.stop()
