"""The OpenAI-compatible server (`dsr1.server`) on the tiny random model in float32, driven by the
official `openai` client on loopback: chat and completions, whole and streamed, equal
`dsr1.generate`'s greedy text; usage and metrics add up; 64 concurrent streams all complete and
correct; 10 of 64 clients killed mid-stream are cancelled and their pages freed; a corpus of bad
requests gets OpenAI-style errors; a full queue answers 429; the API key guards the server; a
non-loopback bind without a key is refused; SIGTERM drains and exits 0.

One server (engine, app, uvicorn thread) serves the whole module; every engine here has the same
shapes, so their programs compile once. References come from one `dsr1.generate` call: a greedy
output with a budget of k tokens is the first k tokens of the reference (or all of them, ending
with "stop", when the reference hit EOS earlier).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dsr1
from dsr1.generation.output import split_reasoning
from dsr1.generation.sampling import Sampling
from dsr1.server import BackgroundServer, ServerConfig, create_app
from dsr1.server.lifecycle import free_port
from dsr1.server.options import bind_refusal
from dsr1.server.protocol import parse_request
from dsr1.server.reasoning import ReasoningSplitter, split_reply
from dsr1.server.responses import ResponseStore, Stored
from dsr1.server.runner import ABORT, EngineFailed, EngineRunner, QueueFull, Update
from dsr1.serving import Engine, EngineStats, Request

pytestmark = pytest.mark.slow  # its module fixtures start servers or engines: out of the quick tier

SHAPES = dict(max_seqs=16, page_size=16, num_pages=256, prefill_chunk=32, prefill_rows=2, max_seq_len=256)
MODEL = "tiny"
REF_BUDGET = 12  # tokens of every reference; requests ask for at most this many
LONG_BUDGET = 200  # for requests meant to be cancelled before they finish

CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "你好，请介绍一下你自己。"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primes."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "What did I say first?"}],
    [{"role": "user", "content": "Write a haiku about JAX."}],
    [{"role": "user", "content": "2 + 2 = ?"}],
    [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Good morning"}],
    [{"role": "user", "content": [{"type": "text", "text": "Parts "}, {"type": "text", "text": "joined."}]}],
]
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,",
         "DeepSeek-R1 is", "Hello", "日本の首都は", "import jax.numpy as jnp\n"]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the server gives the chat template: `developer` as system, text parts joined."""
    out = []
    for m in messages:
        content = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


class References:
    """Greedy `dsr1.generate` outputs of every prompt above (one batch), and the expected reply to a
    request with a smaller budget, its text without special tokens (the server's default, as vLLM's)."""

    def __init__(self, model: dsr1.Model, tokenizer: dsr1.Tokenizer):
        self.tokenizer = tokenizer
        prompts = [template_messages(c) for c in CHATS] + TEXTS
        result = dsr1.generate(model, prompts, max_new_tokens=REF_BUDGET, tokenizer=tokenizer)
        self.chat = result.completions[:len(CHATS)]
        self.text = result.completions[len(CHATS):]

    def _cut(self, completion: dsr1.Completion, budget: int) -> tuple[list[int], str]:
        tokens = completion.tokens[:budget]
        return tokens, "stop" if len(completion.tokens) < budget else "length"

    def chat_reply(self, i: int, budget: int = REF_BUDGET) -> tuple[str, str, str, int]:
        """(reasoning, content, finish_reason, completion_tokens) of chat `i` with `budget` tokens."""
        tokens, finish = self._cut(self.chat[i], budget)
        reasoning, answer = split_reasoning(self.tokenizer.decode(tokens, skip_special_tokens=True), thinking=True)
        return reasoning, answer, finish, len(tokens)

    def text_reply(self, i: int, budget: int = REF_BUDGET) -> tuple[str, str, int]:
        """(text, finish_reason, completion_tokens) of text prompt `i` with `budget` tokens."""
        tokens, finish = self._cut(self.text[i], budget)
        return self.tokenizer.decode(tokens, skip_special_tokens=True), finish, len(tokens)


class Served:
    """An engine, its app and a uvicorn thread serving it."""

    def __init__(self, model: dsr1.Model, tokenizer: dsr1.Tokenizer, **config: Any):
        self.engine = Engine(model, **SHAPES, tokenizer=tokenizer)
        self.engine.warm_up()
        self.app = create_app(self.engine, ServerConfig(model_name=MODEL, **config))
        self.server = BackgroundServer(self.app, shutdown_timeout=config.get("shutdown_timeout", 5.0)).start()
        self.url = self.server.url

    def client(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=options.pop("api_key", "unused"), max_retries=0,
                             timeout=120.0, **options)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until nothing is in flight, then check the pages: every one accounted for, and only
        the prefix cache holding any."""
        runner = self.app.state.runner
        deadline = time.monotonic() + timeout
        # Idle, and the runner's statistics snapshot (what /metrics reports) taken after the last step.
        while runner.in_flight or self.engine.has_work or runner.stats.steps != self.engine.stats().steps:
            assert time.monotonic() < deadline, f"still busy: {self.engine.stats()}"
            time.sleep(0.05)
        self.engine.check()
        stats = self.engine.stats()
        assert stats.running == stats.waiting == 0
        assert stats.pages_used == stats.pages_cached, stats

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of `/metrics`, parsed with prometheus_client's parser."""
        text = httpx.get(self.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def tiny() -> dsr1.Model:
    return dsr1.init_random(dsr1.Config.preset("tiny"), seed=0, dtype="float32")


@pytest.fixture(scope="module")
def tokenizer() -> dsr1.Tokenizer:
    return dsr1.load_tokenizer()


@pytest.fixture(scope="module")
def refs(tiny, tokenizer) -> References:
    return References(tiny, tokenizer)


@pytest.fixture(scope="module")
def served(tiny, tokenizer):
    served = Served(tiny, tokenizer, max_waiting=100, default_max_tokens=REF_BUDGET)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def guarded(tiny, tokenizer):
    """A second server with an API key and no queue beyond its batch slots."""
    served = Served(tiny, tokenizer, api_key="s3cret", max_waiting=0)
    yield served
    served.stop()


@pytest.fixture
def client(served) -> openai.OpenAI:
    yield served.client()
    served.wait_idle()  # after every test: nothing left running, no page leaked


# ---- requests that work ------------------------------------------------------------------------
def reasoning_of(message: Any) -> str | None:
    """`reasoning_content`: not a field of the openai client's types, so it is kept as an extra."""
    return getattr(message, "reasoning_content", None)


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(served.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("i", [0, 1, 2, 6, 7])
def test_chat_equals_generate(client, refs, tokenizer, i):
    reply = client.chat.completions.create(model=MODEL, messages=CHATS[i], max_tokens=REF_BUDGET, temperature=0)
    reasoning, content, finish, tokens = refs.chat_reply(i)
    choice = reply.choices[0]
    assert (reasoning_of(choice.message), choice.message.content, choice.finish_reason) == (reasoning, content, finish)
    assert choice.message.role == "assistant" and reply.model == MODEL and reply.id.startswith("chatcmpl-")
    prompt = len(tokenizer.apply_chat_template(template_messages(CHATS[i])))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        prompt, tokens, prompt + tokens)


@pytest.mark.parametrize("i", [0, 3, 4])
def test_chat_stream_joins_to_the_whole_reply(client, refs, i):
    whole = client.chat.completions.create(model=MODEL, messages=CHATS[i], max_completion_tokens=9, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHATS[i], max_completion_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(reasoning_of(d) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    message = whole.choices[0].message
    assert (reasoning, content) == (reasoning_of(message), message.content) == refs.chat_reply(i, 9)[:2]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens_details.cached_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_server_sent_events_ending_with_done(served, client):
    body = {"model": MODEL, "messages": CHATS[5], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    assert len({json.loads(line[6:])["id"] for line in events[:-1]}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(client, refs, tokenizer, stream):
    for i in (0, 2, 6):
        reply = client.completions.create(model=MODEL, prompt=TEXTS[i], max_tokens=REF_BUDGET, temperature=0,
                                          stream=stream, stream_options={"include_usage": True} if stream else None)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            text, finish, usage = reply.choices[0].text, [reply.choices[0].finish_reason], reply.usage
        expected, expected_finish, tokens = refs.text_reply(i)
        assert (text, finish) == (expected, [expected_finish])
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokenizer.encode(TEXTS[i], add_bos=True)), tokens)


def test_completions_token_ids_batches_and_n(client, refs, tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_bos=True)
    reply = client.completions.create(model=MODEL, prompt=[TEXTS[0], ids], max_tokens=6, temperature=0, n=2)
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert texts == [refs.text_reply(0, 6)[0]] * 2 + [refs.text_reply(1, 6)[0]] * 2
    prompt = len(tokenizer.encode(TEXTS[0], add_bos=True)) + len(ids)  # each prompt once, whatever n
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt, 24)


def test_stop_strings_cut_the_text(client, refs):
    full, _, _ = refs.text_reply(2)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    reply = client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=REF_BUDGET, temperature=0,
                                      stop=[stop, "never appears"])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (full[:full.find(stop)], "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=REF_BUDGET, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:full.find(stop)]


def test_seeded_sampling_repeats_and_settings_apply(client):
    # No top-k or top-p in the repeated pair: their sort of the whole vocabulary is slow on a CPU.
    settings = dict(model=MODEL, messages=CHATS[0], max_tokens=8, temperature=0.9, seed=1234, n=2,
                    presence_penalty=0.5, frequency_penalty=0.3)
    first, second = (client.chat.completions.create(**settings) for _ in range(2))
    texts = [reasoning_of(c.message) for c in first.choices]
    assert texts == [reasoning_of(c.message) for c in second.choices]
    assert texts[0] != texts[1]  # seeds seed and seed + 1
    other = client.chat.completions.create(**{**settings, "seed": 99, "n": 1, "max_tokens": 3, "top_p": 0.9},
                                           extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    assert other.usage.completion_tokens == 3


def test_default_budget_and_reasoning_split(client, refs):
    """Without max_tokens a chat request gets the server's default budget (REF_BUDGET here)."""
    reply = client.chat.completions.create(model=MODEL, messages=CHATS[1], temperature=0)
    assert reply.usage.completion_tokens == refs.chat_reply(1)[3]
    text = refs.tokenizer.decode(refs.chat[1].tokens)
    assert (reasoning_of(reply.choices[0].message), reply.choices[0].message.content) == split_reply(text, True)


# ---- load, disconnects, queue ------------------------------------------------------------------
def stream_reply(client: openai.OpenAI, job: dict[str, Any], kill_after: int | None = None) -> dict[str, Any]:
    """Run one streaming request; with `kill_after`, close the connection after that many chunks."""
    chat = job["kind"] == "chat"
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": CHATS[job["i"]]} if chat else {"prompt": TEXTS[job["i"]]}
    stream = create(model=MODEL, **prompt, max_tokens=job["budget"], temperature=0, stream=True)
    out: dict[str, Any] = {"reasoning": "", "content": "", "finish": [], "ids": set()}
    for n, chunk in enumerate(stream):
        out["ids"].add(chunk.id)
        for choice in chunk.choices:
            if chat:
                out["reasoning"] += reasoning_of(choice.delta) or ""
                out["content"] += choice.delta.content or ""
            else:
                out["content"] += choice.text
            if choice.finish_reason:
                out["finish"].append(choice.finish_reason)
        if kill_after is not None and n + 1 >= kill_after:
            stream.close()
            break
    return out


def expected_reply(refs: References, job: dict[str, Any]) -> dict[str, Any]:
    if job["kind"] == "chat":
        reasoning, content, finish, _ = refs.chat_reply(job["i"], job["budget"])
        return {"reasoning": reasoning, "content": content, "finish": [finish]}
    text, finish, _ = refs.text_reply(job["i"], job["budget"])
    return {"reasoning": "", "content": text, "finish": [finish]}


def mixed_jobs(n: int) -> list[dict[str, Any]]:
    """Chat and completions, every prompt, budgets 1..REF_BUDGET."""
    return [{"kind": "chat" if j % 2 else "text", "i": (j // 2) % 8, "budget": 1 + (j * 5) % REF_BUDGET}
            for j in range(n)]


def run_clients(count: int, work: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(work, range(count)))


def test_64_concurrent_streams_all_complete_and_correct(served, client, refs):
    jobs = mixed_jobs(64)
    before = served.metrics()
    replies = run_clients(64, lambda j: stream_reply(client, jobs[j]))
    for job, reply in zip(jobs, replies):
        assert len(reply.pop("ids")) == 1
        assert reply == expected_reply(refs, job), job
    served.wait_idle()
    after = served.metrics()
    finished = sum(v - before.get(k, 0) for k, v in after.items() if k[0] == "dsr1_requests_finished_total")
    assert finished == 64  # none lost, none duplicated


def test_killed_clients_are_cancelled_and_free_their_pages(served, client, refs):
    jobs = mixed_jobs(64)
    killed = set(range(3, 64, 6)[:10])
    for j in killed:
        jobs[j] = {**jobs[j], "budget": LONG_BUDGET}  # would run for LONG_BUDGET steps if not cancelled
    before = served.metrics()
    start = time.monotonic()
    replies = run_clients(64, lambda j: stream_reply(client, jobs[j], kill_after=2 if j in killed else None))
    served.wait_idle(timeout=60.0)
    elapsed = time.monotonic() - start
    for j, (job, reply) in enumerate(zip(jobs, replies)):
        reply.pop("ids")
        if j not in killed:
            assert reply == expected_reply(refs, job), job
    after = served.metrics()

    def delta(reason: str) -> float:
        key = ("dsr1_requests_finished_total", (("endpoint", "chat"), ("finish_reason", reason)))
        other = ("dsr1_requests_finished_total", (("endpoint", "completions"), ("finish_reason", reason)))
        return sum(after.get(k, 0) - before.get(k, 0) for k in (key, other))

    assert delta("abort") == len(killed)
    assert delta("length") + delta("stop") == 64 - len(killed)
    steps = after[("dsr1_engine_steps_total", ())] - before[("dsr1_engine_steps_total", ())]
    assert steps < LONG_BUDGET, f"{steps} steps in {elapsed:.1f} s: the killed requests ran on"


def test_a_non_streaming_client_that_leaves_is_cancelled(served, client):
    """A client that stops waiting for a non-streaming answer cancels its request. It waits 0.2 s for
    240 tokens, which took the tiny model between 0.2 and 1 s on a 2-core Zen 5 (a 1 s wait saw them
    all)."""
    before = served.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + TEXT, json=with_(OK_TEXT, max_tokens=240), timeout=httpx.Timeout(60.0, read=0.2))
    served.wait_idle(timeout=20.0)
    key = ("dsr1_requests_finished_total", (("endpoint", "completions"), ("finish_reason", "abort")))
    assert served.metrics()[key] - before.get(key, 0) == 1


def test_full_queue_answers_429_with_retry_after(guarded, tokenizer):
    """`guarded` admits as many requests in flight as the engine has batch slots, and no more."""
    client = guarded.client(api_key="s3cret")
    slots = SHAPES["max_seqs"] + SHAPES["prefill_rows"]
    streams = [client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=LONG_BUDGET, stream=True)
               for _ in range(slots)]
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "queue_full"
    finally:
        for stream in streams:
            stream.close()
    guarded.wait_idle()
    assert client.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=2).usage.completion_tokens == 2


# ---- bad requests ------------------------------------------------------------------------------
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_TEXT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
LONG_PROMPT = "word " * 400  # > 256 tokens, the served context


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


BAD_REQUESTS: list[tuple[str, str, str, Any, int, str | None]] = [
    # (name, method, path, body (bytes are sent as they are), status, param)
    ("malformed JSON", "POST", CHAT, b'{"model": "tiny", "messages": [', 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("not an object", "POST", CHAT, b"[1, 2]", 400, None),
    ("unknown model", "POST", CHAT, with_(OK_CHAT, model="gpt-4"), 404, "model"),
    ("missing model", "POST", CHAT, {"messages": OK_CHAT["messages"]}, 400, "model"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", "POST", CHAT, with_(OK_CHAT, messages=[]), 400, "messages"),
    ("unknown role", "POST", CHAT, with_(OK_CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role"),
    ("content of the wrong type", "POST", CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": 42}]), 400,
     "messages[0].content"),
    ("user message without content", "POST", CHAT, with_(OK_CHAT, messages=[{"role": "user"}]), 400,
     "messages[0].content"),
    ("image content", "POST", CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content[0].type"),
    ("messages not a list", "POST", CHAT, with_(OK_CHAT, messages="hi"), 400, "messages"),
    ("max_tokens a string", "POST", CHAT, with_(OK_CHAT, max_tokens="10"), 400, "max_tokens"),
    ("max_tokens a float", "POST", CHAT, with_(OK_CHAT, max_tokens=2.5), 400, "max_tokens"),
    ("negative max_tokens", "POST", CHAT, with_(OK_CHAT, max_tokens=-1), 400, "max_tokens"),
    ("zero max_completion_tokens", "POST", CHAT, with_(OK_CHAT, max_completion_tokens=0), 400,
     "max_completion_tokens"),
    ("huge max_tokens", "POST", CHAT, with_(OK_CHAT, max_tokens=10**12), 400, "max_tokens"),
    ("prompt longer than the context", "POST", CHAT,
     with_(OK_CHAT, messages=[{"role": "user", "content": LONG_PROMPT}]), 400, "messages"),
    ("temperature too high", "POST", CHAT, with_(OK_CHAT, temperature=3), 400, "temperature"),
    ("temperature a string", "POST", CHAT, with_(OK_CHAT, temperature="hot"), 400, "temperature"),
    ("top_p zero", "POST", CHAT, with_(OK_CHAT, top_p=0), 400, "top_p"),
    ("min_p one", "POST", CHAT, with_(OK_CHAT, min_p=1.0), 400, "min_p"),
    ("presence_penalty out of range", "POST", CHAT, with_(OK_CHAT, presence_penalty=2.5), 400, "presence_penalty"),
    ("n zero", "POST", CHAT, with_(OK_CHAT, n=0), 400, "n"),
    ("stream not a bool", "POST", CHAT, with_(OK_CHAT, stream="yes"), 400, "stream"),
    ("stream_options without stream", "POST", CHAT, with_(OK_CHAT, stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("empty stop string", "POST", CHAT, with_(OK_CHAT, stop=["ok", ""]), 400, "stop[1]"),
    ("stop of the wrong type", "POST", CHAT, with_(OK_CHAT, stop=[1, 2]), 400, "stop[0]"),
    ("seed out of range", "POST", CHAT, with_(OK_CHAT, seed=2**64), 400, "seed"),
    ("a tool without a name", "POST", CHAT, with_(OK_CHAT, tools=[{"type": "function", "function": {}}]), 400,
     "tools[0].function.name"),
    ("tool_choice naming no tool", "POST", CHAT, with_(OK_CHAT, tools=[{"type": "function", "function": {
        "name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool_choice required without tools", "POST", CHAT, with_(OK_CHAT, tool_choice="required"), 400, "tool_choice"),
    ("unknown response format", "POST", CHAT, with_(OK_CHAT, response_format={"type": "yaml"}), 400,
     "response_format.type"),
    ("two output constraints", "POST", CHAT, with_(OK_CHAT, response_format={"type": "json_object"},
                                                   guided_regex="[a-z]+"), 400, "guided_regex"),
    ("chat max_tokens 0", "POST", CHAT, with_(OK_CHAT, max_tokens=0), 400, "max_tokens"),
    ("chat echo", "POST", CHAT, with_(OK_CHAT, echo=True), 400, "echo"),
    ("beam search", "POST", CHAT, with_(OK_CHAT, use_beam_search=True), 400, "use_beam_search"),
    ("length_penalty", "POST", TEXT, with_(OK_TEXT, length_penalty=0.5), 400, "length_penalty"),
    ("best_of other than n", "POST", TEXT, with_(OK_TEXT, best_of=3), 400, "best_of"),
    ("logits_processors", "POST", TEXT, with_(OK_TEXT, logits_processors=["x"]), 400, "logits_processors"),
    ("spaces_between_special_tokens", "POST", TEXT, with_(OK_TEXT, spaces_between_special_tokens=False), 400,
     "spaces_between_special_tokens"),
    ("min_tokens over max_tokens", "POST", TEXT, with_(OK_TEXT, min_tokens=5), 400, "min_tokens"),
    ("stop_token_ids outside the vocabulary", "POST", TEXT, with_(OK_TEXT, stop_token_ids=[10**7]), 400,
     "stop_token_ids"),
    ("logit_bias key not a token id", "POST", TEXT, with_(OK_TEXT, logit_bias={"abc": 1}), 400, "logit_bias.abc"),
    ("logit_bias out of range", "POST", TEXT, with_(OK_TEXT, logit_bias={"5": 101}), 400, "logit_bias.5"),
    ("n x prompts over what the server admits", "POST", TEXT, with_(OK_TEXT, prompt=["a", "b", "c", "d", "e"],
                                                                    n=64), 400, "n"),
    ("top_logprobs without logprobs", "POST", CHAT, with_(OK_CHAT, top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs over 20", "POST", CHAT, with_(OK_CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("completions: missing prompt", "POST", TEXT, {"model": MODEL}, 400, "prompt"),
    ("completions: empty token list", "POST", TEXT, with_(OK_TEXT, prompt=[]), 400, "prompt"),
    ("completions: token id outside the vocabulary", "POST", TEXT, with_(OK_TEXT, prompt=[1, 10**7]), 400,
     "prompt"),
    ("completions: negative token id", "POST", TEXT, with_(OK_TEXT, prompt=[[5, -3]]), 400, "prompt"),
    ("completions: prompt longer than the context", "POST", TEXT, with_(OK_TEXT, prompt=LONG_PROMPT), 400,
     "prompt"),
    ("completions: prompt + max_tokens over the context", "POST", TEXT, with_(OK_TEXT, max_tokens=255), 400,
     "max_tokens"),
    ("completions: max_tokens 0 without echo", "POST", TEXT, with_(OK_TEXT, max_tokens=0), 400, "max_tokens"),
    ("completions: logprobs over 20", "POST", TEXT, with_(OK_TEXT, logprobs=21), 400, "logprobs"),
    ("completions: unknown model", "POST", TEXT, with_(OK_TEXT, model="davinci"), 404, "model"),
    ("unknown path", "POST", "/v1/embeddings", OK_TEXT, 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("unknown model id", "GET", "/v1/models/gpt-4", None, 404, "model"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, client):
    assert len(BAD_REQUESTS) >= 25
    for name, method, path, body, status, param in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        response = httpx.request(method, served.url + path, content=content,
                                 headers={"Content-Type": "application/json"})
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert isinstance(error["message"], str) and error["message"], name
        assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), name
        assert error["param"] == param, (name, error)
    reply = client.chat.completions.create(**OK_CHAT)
    assert reply.usage.completion_tokens == 2


def test_error_messages_name_the_numbers(served):
    response = httpx.post(served.url + CHAT, json=with_(OK_CHAT, messages=[{"role": "user", "content": LONG_PROMPT}]))
    prompt_tokens = int(response.json()["error"]["message"].split("has ")[1].split(" tokens")[0])
    assert prompt_tokens > 256 and "256" in response.json()["error"]["message"]
    response = httpx.post(served.url + TEXT, json=with_(OK_TEXT, max_tokens=255))
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert all(str(n) in response.json()["error"]["message"] for n in (256, 255, 257))
    error = httpx.post(served.url + CHAT, json=with_(OK_CHAT, logprobs=True, top_logprobs=21)).json()["error"]
    assert "20" in error["message"] and "21" in error["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            **with_(OK_CHAT, model="gpt-4"))


def test_parse_errors_name_the_field():
    from dsr1.server.errors import APIError
    from dsr1.server.protocol import ChatCompletionRequest

    with pytest.raises(APIError) as info:
        parse_request(json.dumps(with_(OK_CHAT, stop=["a", 3])).encode(), ChatCompletionRequest)
    assert info.value.param == "stop[1]" and "stop[1]" in info.value.message


# ---- Anthropic's Messages API --------------------------------------------------------------------------
MESSAGES = "/v1/messages"
OK_MESSAGES = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"name": "f", "input_schema": {"type": "object"}}
IMAGE = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}


def turn(*content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(content)}]


BAD_MESSAGES: list[tuple[str, str, Any, int, str]] = [
    # (name, path, body (bytes are sent as they are), status, what the message names)
    ("malformed JSON", MESSAGES, b'{"model": "tiny", "messages": [', 400, "JSON"),
    ("not an object", MESSAGES, b"[1]", 400, "object"),
    ("missing max_tokens", MESSAGES, {"model": MODEL, "messages": OK_MESSAGES["messages"]}, 400, "max_tokens"),
    ("zero max_tokens", MESSAGES, with_(OK_MESSAGES, max_tokens=0), 400, "max_tokens"),
    ("max_tokens a string", MESSAGES, with_(OK_MESSAGES, max_tokens="2"), 400, "max_tokens"),
    ("missing messages", MESSAGES, {"model": MODEL, "max_tokens": 2}, 400, "messages"),
    ("missing model", MESSAGES, {"max_tokens": 2, "messages": OK_MESSAGES["messages"]}, 400, "model"),
    ("empty messages", MESSAGES, with_(OK_MESSAGES, messages=[]), 400, "messages"),
    ("a system role", MESSAGES, with_(OK_MESSAGES, messages=[{"role": "system", "content": "hi"}]), 400,
     "messages[0].role"),
    ("content a number", MESSAGES, with_(OK_MESSAGES, messages=[{"role": "user", "content": 7}]), 400,
     "messages[0].content"),
    ("empty content", MESSAGES, with_(OK_MESSAGES, messages=turn()), 400, "messages[0].content"),
    ("an image block", MESSAGES, with_(OK_MESSAGES, messages=turn(IMAGE)), 400, "messages[0].content[0]"),
    ("a text block without text", MESSAGES, with_(OK_MESSAGES, messages=turn({"type": "text"})), 400,
     "messages[0].content[0].text"),
    ("a tool_result without tool_use_id", MESSAGES, with_(OK_MESSAGES, messages=turn(
        {"type": "tool_result", "content": "ok"})), 400, "messages[0].content[0].tool_use_id"),
    ("an image in a tool_result", MESSAGES, with_(OK_MESSAGES, messages=turn(
        {"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]})), 400, "messages[0].content[0].content[0]"),
    ("a tool_use in a user turn", MESSAGES, with_(OK_MESSAGES, messages=turn(
        {"type": "tool_use", "id": "t", "name": "f", "input": {}})), 400, "messages[0].content[0]"),
    ("a tool_use without input", MESSAGES, with_(OK_MESSAGES, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                                               "name": "f"}]},
        {"role": "user", "content": "go on"}]), 400, "messages[1].content[0].input"),
    ("a final assistant turn", MESSAGES, with_(OK_MESSAGES, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]), 400, "messages[1]"),
    ("a block of the wrong type", MESSAGES, with_(OK_MESSAGES, messages=turn({"type": 3})), 400,
     "messages[0].content[0].type"),
    ("system a number", MESSAGES, with_(OK_MESSAGES, system=5), 400, "system"),
    ("an image in system", MESSAGES, with_(OK_MESSAGES, system=[IMAGE]), 400, "system[0]"),
    ("temperature over 1", MESSAGES, with_(OK_MESSAGES, temperature=1.5), 400, "temperature"),
    ("top_p zero", MESSAGES, with_(OK_MESSAGES, top_p=0), 400, "top_p"),
    ("negative top_k", MESSAGES, with_(OK_MESSAGES, top_k=-1), 400, "top_k"),
    ("an empty stop sequence", MESSAGES, with_(OK_MESSAGES, stop_sequences=["ok", ""]), 400, "stop_sequences[1]"),
    ("a stop sequence not a string", MESSAGES, with_(OK_MESSAGES, stop_sequences=[1]), 400, "stop_sequences[0]"),
    ("stream not a bool", MESSAGES, with_(OK_MESSAGES, stream="yes"), 400, "stream"),
    ("a tool without input_schema", MESSAGES, with_(OK_MESSAGES, tools=[{"name": "f"}]), 400,
     "tools[0].input_schema"),
    ("a tool without a name", MESSAGES, with_(OK_MESSAGES, tools=[{"input_schema": {}}]), 400, "tools[0].name"),
    ("a tool name with a newline", MESSAGES, with_(OK_MESSAGES, tools=[with_(TOOL, name="a\nb")]), 400,
     "tools[0].name"),
    ("input_schema not an object", MESSAGES, with_(OK_MESSAGES, tools=[with_(TOOL, input_schema=[1])]), 400,
     "tools[0].input_schema"),
    ("two tools of one name", MESSAGES, with_(OK_MESSAGES, tools=[TOOL, TOOL]), 400, "unique"),
    ("a server tool", MESSAGES, with_(OK_MESSAGES, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     400, "tools[0]"),
    ("tool_choice any without tools", MESSAGES, with_(OK_MESSAGES, tool_choice={"type": "any"}), 400,
     "tool_choice"),
    ("tool_choice naming no tool", MESSAGES, with_(OK_MESSAGES, tools=[TOOL], tool_choice={"type": "tool",
                                                                                          "name": "g"}), 400,
     "tool_choice"),
    ("tool_choice of no known type", MESSAGES, with_(OK_MESSAGES, tool_choice={"type": "maybe"}), 400,
     "tool_choice.type"),
    ("thinking of no known type", MESSAGES, with_(OK_MESSAGES, thinking={"type": "deep"}), 400, "thinking.type"),
    ("budget_tokens not under max_tokens", MESSAGES, with_(OK_MESSAGES, thinking={"type": "enabled",
                                                                                  "budget_tokens": 2}), 400,
     "thinking.budget_tokens"),
    ("budget_tokens with thinking disabled", MESSAGES, with_(OK_MESSAGES, max_tokens=9, thinking={
        "type": "disabled", "budget_tokens": 2}), 400, "thinking.budget_tokens"),
    ("a prompt longer than the context", MESSAGES, with_(OK_MESSAGES, messages=[
        {"role": "user", "content": LONG_PROMPT}]), 400, "context"),
    ("max_tokens over the context", MESSAGES, with_(OK_MESSAGES, max_tokens=256), 400, "max_tokens"),
    ("an unknown model", MESSAGES, with_(OK_MESSAGES, model="claude-x"), 404, "claude-x"),
    ("count_tokens: missing messages", MESSAGES + "/count_tokens", {"model": MODEL}, 400, "messages"),
    ("count_tokens: an image block", MESSAGES + "/count_tokens", {"model": MODEL, "messages": turn(IMAGE)}, 400,
     "messages[0].content[0]"),
    ("count_tokens: an unknown model", MESSAGES + "/count_tokens", {"model": "claude-x", "messages": turn(
        {"type": "text", "text": "hi"})}, 404,
     "claude-x"),
]


def test_bad_messages_get_anthropic_errors_and_the_server_keeps_serving(served, client):
    kinds = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}
    for name, path, body, status, named in [*BAD_MESSAGES, ("wrong method", MESSAGES, None, 405, "GET")]:
        content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        response = httpx.request("GET" if body is None else "POST", served.url + path, content=content,
                                 headers={"Content-Type": "application/json"})
        assert response.status_code == status, (name, response.text)
        assert response.json()["type"] == "error" and set(response.json()["error"]) == {"type", "message"}, name
        assert response.json()["error"]["type"] == kinds[status], name
        assert named in response.json()["error"]["message"], (name, response.text)
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages.create(
            **with_(OK_MESSAGES, max_tokens=0))
    url = httpx.URL(served.url)
    with socket.create_connection((url.host, url.port), timeout=30) as conn:  # declares more than it sends
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{}" % (65 << 20))
        reply = b""
        while b"request_too_large" not in reply and (piece := conn.recv(4096)):
            reply += piece
    assert reply.split(b" ")[1] == b"413" and b'"type":"request_too_large"' in reply
    reply = httpx.post(served.url + MESSAGES, json=OK_MESSAGES).json()
    assert reply["usage"]["output_tokens"] == 2 and reply["stop_reason"] == "max_tokens"


def test_a_messages_stream_left_early_is_cancelled(served, client):
    before = served.metrics()
    messages = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages
    with messages.stream(**with_(OK_MESSAGES, max_tokens=LONG_BUDGET)) as stream:
        next(iter(stream))
    served.wait_idle(timeout=20.0)
    key = ("dsr1_requests_finished_total", (("endpoint", "messages"), ("finish_reason", "abort")))
    assert served.metrics()[key] - before.get(key, 0) == 1


def test_messages_take_the_key_as_x_api_key_and_share_the_queue(guarded):
    url = guarded.url + MESSAGES
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        denied = httpx.post(url, json=OK_MESSAGES, headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=OK_MESSAGES, headers={"x-api-key": "s3cret"}).json()["usage"]["output_tokens"] == 2
    assert httpx.get(guarded.url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    messages = anthropic.Anthropic(base_url=guarded.url, api_key="s3cret", max_retries=0).messages
    slots = SHAPES["max_seqs"] + SHAPES["prefill_rows"]
    streams = [messages.create(**with_(OK_MESSAGES, max_tokens=LONG_BUDGET), stream=True) for _ in range(slots)]
    try:
        with pytest.raises(anthropic.RateLimitError) as info:
            messages.create(**OK_MESSAGES)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["error"]["type"] == "rate_limit_error"
    finally:
        for stream in streams:
            stream.close()
    guarded.wait_idle()


# ---- OpenAI's Responses API ---------------------------------------------------------------------
RESPONSES = "/v1/responses"
OK_RESPONSE = {"model": MODEL, "max_output_tokens": 2, "input": "hi"}
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def output_texts(response: Any) -> tuple[str, str]:
    """(reasoning, message text) of a Responses reply's output items."""
    reasoning = "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or ())
    text = "".join(c.text for item in response.output if item.type == "message" for c in item.content)
    return reasoning, text


def test_responses_whole_and_streamed_equal_generate_and_are_stored(served, client, refs):
    settings = dict(model=MODEL, input=CHATS[0][0]["content"], max_output_tokens=9, temperature=0)
    whole = client.responses.create(**settings)
    reasoning, content, finish, tokens = refs.chat_reply(0, 9)
    assert output_texts(whole) == (reasoning, content) and whole.output_text == content
    assert whole.status == ("incomplete" if finish == "length" else "completed")
    assert (whole.usage.output_tokens, whole.usage.total_tokens) == (tokens, whole.usage.input_tokens + tokens)
    with client.responses.stream(**settings) as stream:
        events = list(stream)
        streamed = stream.get_final_response() if whole.status == "completed" else events[-1].response
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(whole.output)
    assert output_texts(streamed) == (reasoning, content) and streamed.usage.output_tokens == tokens
    assert [(i.type, getattr(i, "status", None)) for i in streamed.output] == [
        (i.type, getattr(i, "status", None)) for i in whole.output]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    kept = client.responses.retrieve(streamed.id)
    assert kept.id == streamed.id and output_texts(kept) == (reasoning, content)
    # The stored conversation goes on: its prompt is the first turn, its reply and the new input.
    follow = client.responses.create(**{**settings, "input": "And at night?"}, previous_response_id=whole.id)
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        *CHATS[0], {"role": "assistant", "content": content}, {"role": "user", "content": "And at night?"}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens and follow.previous_response_id == whole.id
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    unstored = client.responses.create(**settings, store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(**settings, previous_response_id=unstored.id)


def test_the_response_store_evicts_the_least_recently_used():
    store = ResponseStore(capacity=3, chars=10_000)
    kept = [Stored({"id": str(i)}, ({"role": "user", "content": "x" * 100},)) for i in range(5)]
    for i in range(3):
        store.put(str(i), kept[i])
    assert store.get("0") is kept[0]  # "0" used: "1" is now the oldest
    store.put("3", kept[3])
    assert (store.get("1"), len(store)) == (None, 3) and store.get("0") is kept[0]
    small = ResponseStore(capacity=10, chars=2 * kept[0].size)
    for i in range(5):
        small.put(str(i), kept[i])
    assert [small.get(str(i)) is not None for i in range(5)] == [False, False, False, True, True]
    assert small.delete("4") and not small.delete("4") and len(small) == 1


def item(**fields: Any) -> dict[str, Any]:
    return with_(OK_RESPONSE, input=[fields])


BAD_RESPONSES: list[tuple[str, Any, int, str]] = [
    # (name, body (bytes are sent as they are), status, the param at fault)
    ("malformed JSON", b'{"model": "tiny", "input": [', 400, None),
    ("missing input", {"model": MODEL}, 400, "input"),
    ("input a number", with_(OK_RESPONSE, input=3), 400, "input"),
    ("empty input", with_(OK_RESPONSE, input=[]), 400, "input"),
    ("a message without a role", item(content="hi"), 400, "input[0].role"),
    ("an image part", item(role="user", content=[{"type": "input_image", "image_url": "http://x/y.png"}]), 400,
     "input[0].content[0].type"),
    ("a function_call without call_id", item(type="function_call", name="f", arguments="{}"), 400,
     "input[0].call_id"),
    ("function_call arguments not JSON", item(type="function_call", call_id="c", name="f", arguments="{"), 400,
     "input[0].arguments"),
    ("a function_call_output without output", item(type="function_call_output", call_id="c"), 400,
     "input[0].output"),
    ("an item of an unknown type", item(type="web_search_call"), 400, "input[0].type"),
    ("zero max_output_tokens", with_(OK_RESPONSE, max_output_tokens=0), 400, "max_output_tokens"),
    ("max_output_tokens over the context", with_(OK_RESPONSE, max_output_tokens=400), 400, "max_output_tokens"),
    ("temperature over 2", with_(OK_RESPONSE, temperature=3), 400, "temperature"),
    ("a hosted tool", with_(OK_RESPONSE, tools=[{"type": "web_search"}]), 400, "tools[0].type"),
    ("a function without a name", with_(OK_RESPONSE, tools=[{"type": "function"}]), 400, "tools[0].name"),
    ("tool_choice required without tools", with_(OK_RESPONSE, tool_choice="required"), 400, "tool_choice"),
    ("tool_choice naming no tool", with_(OK_RESPONSE, tools=[FUNCTION], tool_choice={"type": "function",
                                                                                    "name": "g"}), 400,
     "tool_choice"),
    ("tool_choice of a hosted tool", with_(OK_RESPONSE, tool_choice={"type": "file_search"}), 400,
     "tool_choice.type"),
    ("json_schema without a schema", with_(OK_RESPONSE, text={"format": {"type": "json_schema", "name": "x"}}), 400,
     "text.format.schema"),
    ("a reasoning effort of no known kind", with_(OK_RESPONSE, reasoning={"effort": "huge"}), 400,
     "reasoning.effort"),
    ("an unknown previous_response_id", with_(OK_RESPONSE, previous_response_id="resp_x"), 400,
     "previous_response_id"),
    ("background", with_(OK_RESPONSE, background=True), 400, "background"),
    ("a prompt longer than the context", with_(OK_RESPONSE, input=LONG_PROMPT), 400, "input"),
    ("an unknown model", with_(OK_RESPONSE, model="gpt-x"), 404, "model"),
]


def test_bad_responses_get_openai_errors_and_the_server_keeps_serving(served, client):
    # With the Messages corpus: at least 60 malformed requests across the two newer APIs, each a 400.
    assert sum(status == 400 for *_, status, _ in BAD_RESPONSES) + sum(
        status == 400 for *_, status, _ in BAD_MESSAGES) >= 60
    for name, body, status, param in BAD_RESPONSES:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(served.url + RESPONSES, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (name, error)
        assert error["type"] == "invalid_request_error", (name, error)
        assert isinstance(error["message"], str) and error["message"], name
    assert httpx.get(served.url + RESPONSES + "/resp_x").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**with_(OK_RESPONSE, max_output_tokens=0))
    assert client.responses.create(**OK_RESPONSE).usage.output_tokens == 2


def test_a_responses_stream_left_early_is_cancelled_and_the_key_is_checked(served, client, guarded):
    before = served.metrics()
    with client.responses.stream(**with_(OK_RESPONSE, max_output_tokens=LONG_BUDGET)) as stream:
        next(iter(stream))
    served.wait_idle(timeout=20.0)
    key = ("dsr1_requests_finished_total", (("endpoint", "responses"), ("finish_reason", "abort")))
    assert served.metrics()[key] - before.get(key, 0) == 1
    denied = httpx.post(guarded.url + RESPONSES, json=OK_RESPONSE)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    kept = guarded.client(api_key="s3cret").responses.create(**OK_RESPONSE)
    assert httpx.get(guarded.url + RESPONSES + "/" + kept.id, headers={"x-api-key": "s3cret"}).json()["id"] == kept.id


# ---- metrics -------------------------------------------------------------------------------------
def test_metrics_parse_and_count_what_was_sent(served, client):
    before = served.metrics()
    usages = [client.chat.completions.create(model=MODEL, messages=CHATS[i], max_tokens=3 + i, temperature=0).usage
              for i in range(3)]
    usages += [client.completions.create(model=MODEL, prompt=TEXTS[i], max_tokens=2, temperature=0, n=2).usage
               for i in range(2)]
    long_chat = [{"role": "user", "content": "Count the words of this sentence, please: " + "one two three " * 12}]
    usages += [client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=2, temperature=0).usage
               for _ in range(2)]
    for _ in range(2):
        httpx.post(served.url + CHAT, json=with_(OK_CHAT, model="nope"))
    served.wait_idle()
    after = served.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    usages = usages[:3] + usages[5:] + usages[3:5]  # chat first, then completions
    chats, texts, choices = usages[:5], usages[5:], 9
    assert delta("dsr1_http_requests_total", endpoint=CHAT, status="200") == 5
    assert delta("dsr1_http_requests_total", endpoint=TEXT, status="200") == 2
    assert delta("dsr1_http_requests_total", endpoint=CHAT, status="404") == 2
    assert delta("dsr1_requests_accepted_total", endpoint="chat") == 5
    assert delta("dsr1_requests_accepted_total", endpoint="completions") == 2
    assert delta("dsr1_requests_rejected_total", reason="invalid") == 2
    assert delta("dsr1_prompt_tokens_total", endpoint="chat") == sum(u.prompt_tokens for u in chats)
    assert delta("dsr1_prompt_tokens_total", endpoint="completions") == sum(u.prompt_tokens for u in texts)
    assert delta("dsr1_generation_tokens_total", endpoint="chat") == sum(u.completion_tokens for u in chats)
    assert delta("dsr1_generation_tokens_total", endpoint="completions") == sum(u.completion_tokens for u in texts)
    assert delta("dsr1_requests_finished_total", endpoint="chat", finish_reason="length") == 5
    assert delta("dsr1_requests_finished_total", endpoint="completions", finish_reason="length") == 4
    assert delta("dsr1_time_to_first_token_seconds_count") == choices  # one per choice
    assert delta("dsr1_inter_token_latency_seconds_count") == sum(u.completion_tokens for u in usages) - choices
    assert delta("dsr1_request_duration_seconds_count") == choices
    assert delta("dsr1_prefix_hit_tokens_total") >= 48  # the long prompt's full pages, the second time
    assert usages[4].prompt_tokens_details.cached_tokens >= 48
    stats = served.engine.stats()
    for name, value in [("dsr1_requests_running", 0), ("dsr1_requests_waiting", 0),
                        ("dsr1_pages_used", stats.pages_used), ("dsr1_pages_cached", stats.pages_cached),
                        ("dsr1_prefix_hit_tokens_total", stats.prefix_hit_tokens),
                        ("dsr1_engine_generated_tokens_total", stats.generated_tokens)]:
        assert after[(name, ())] == value, name


# ---- access, binding, shutdown --------------------------------------------------------------------
def test_api_key_is_required_when_set(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    response = httpx.get(guarded.url + "/v1/models")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded.url + "/metrics").status_code == 401
    assert httpx.get(guarded.url + "/health").status_code == 200  # probes need no key
    client = guarded.client(api_key="s3cret")
    assert client.chat.completions.create(**OK_CHAT).usage.completion_tokens == 2
    assert httpx.get(guarded.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_non_loopback_bind_without_a_key_is_refused(monkeypatch, capsys):
    from dsr1.__main__ import main

    monkeypatch.delenv("DSR1_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "refusing to serve on '0.0.0.0' without an API key" in capsys.readouterr().err
    assert bind_refusal("127.0.0.1", None) is None and bind_refusal("::1", None) is None
    assert bind_refusal("localhost", None) is None and bind_refusal("0.0.0.0", "key") is None
    assert bind_refusal("192.168.1.5", None) and bind_refusal("example.com", None)


def test_drain_refuses_new_requests_and_cancels_after_the_timeout(tiny, tokenizer):
    # A short timeout: on a fast CPU the tiny model finished LONG_BUDGET tokens within 1 s (a flaky 'length').
    served = Served(tiny, tokenizer, shutdown_timeout=0.2)
    client = served.client()
    try:
        stream = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=LONG_BUDGET, stream=True)
        chunks = iter(stream)
        next(chunks)
        events = iter(anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages.create(
            **with_(OK_MESSAGES, max_tokens=LONG_BUDGET), stream=True))
        next(events)
        served.app.state.runner.drain()
        response = httpx.post(served.url + CHAT, json=OK_CHAT)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "shutting_down"
        response = httpx.post(served.url + MESSAGES, json=OK_MESSAGES)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "overloaded_error"
        health = httpx.get(served.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        stopping = threading.Thread(target=served.stop)
        stopping.start()
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):
            list(events)  # a Messages stream cut short ends with an error event
        stopping.join(30)
        assert finishes == ["abort"] and not stopping.is_alive()
    finally:
        served.stop()
    served.engine.check()
    assert served.engine.stats().running == 0 and not served.engine.has_work


def test_a_failing_engine_ends_its_requests_and_refuses_new_ones():
    """The runner against an engine whose step raises: requests end as cancelled, health is lost."""

    class BrokenEngine:
        has_work = False

        def stats(self) -> EngineStats:
            return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})

        def submit(self, prompt, *, sampling, on_text, logprobs) -> Request:
            self.has_work = True
            return Request(0, prompt, sampling, None, on_text=on_text, top_logprobs=logprobs)

        def step(self) -> None:
            raise RuntimeError("the device is on fire")

    runner = EngineRunner(BrokenEngine(), capacity=2)
    with pytest.raises(QueueFull):
        runner.submit([[1]] * 3, [Sampling()] * 3, print)
    updates: list[Update] = []
    runner.start()
    try:
        (request,) = runner.submit([[1, 2]], [Sampling()], updates.append)
        assert request.wait(10.0) and request.finish_reason == ABORT
        assert updates[-1].done and isinstance(runner.error, RuntimeError)
        with pytest.raises(EngineFailed):
            runner.submit([[1]], [Sampling()], updates.append)
    finally:
        runner.stop()


def test_import_dsr1_does_not_load_the_http_stack():
    code = ("import sys, dsr1, dsr1.__main__, dsr1.server, dsr1.server.options; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette', 'uvicorn')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def wait_for_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not come up within {timeout} s")


@pytest.mark.slow
def test_sigterm_drains_cancels_and_exits_0(tmp_path):
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "DSR1_API_KEY"}
    # A random model: the stream runs into the drain's timeout, not into an end-of-sequence token.
    cmd = [sys.executable, "-m", "dsr1", "serve", "--preset", "tiny", "--dtype", "float32", "--port", str(port),
           "--max-seqs", "4", "--page-size", "16", "--num-pages", "64", "--prefill-chunk", "32",
           "--max-seq-len", "256", "--shutdown-timeout", "0.5", "--log-level", "warning",  # before 200 tokens
           "--no-warmup"]  # the programs this request runs compile as it runs: the drain is the point here
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_health(url, proc, timeout=420)  # start-up compiles; a busy machine is slow
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=LONG_BUDGET, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        # Draining: the listener stays open while the stream runs on; load balancers see 503 "draining".
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)  # 503
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert rest[-1].choices[0].finish_reason == "abort" and text
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "server stopped" in err


# ---- reasoning split ---------------------------------------------------------------------------
def test_reasoning_splitter_streams_exactly_the_whole_split():
    rng = np.random.default_rng(0)
    alphabet = ["<think>", "</think>", "\n", "a", "b c", "<", "</", "think", ">", "</thi", "nk>"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 12))))
        thinking = bool(rng.integers(2))
        if thinking or text.startswith("<think>"):
            assert split_reply(text, thinking) == split_reasoning(text, True), text
        else:
            assert split_reply(text, thinking) == ("", text)
        cuts = np.sort(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 6))))
        splitter, reasoning, content = ReasoningSplitter(thinking), "", ""
        for piece in np.split(np.array(list(text), dtype=object), cuts):
            r, c = splitter.push("".join(piece))
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert (reasoning + r, content + c) == split_reply(text, thinking), text


# ---- logprobs ------------------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_chat_logprobs_equal_forward_log_softmax(client, tiny, tokenizer, refs):
    messages = CHATS[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    prompt = tokenizer.apply_chat_template(template_messages(messages))
    generated = refs.chat[0].tokens[:6]
    assert len(content) == len(generated) == reply.usage.completion_tokens
    logp = log_softmax(np.asarray(tiny.forward(np.array([prompt + generated], np.int32)))[0])
    for k, (entry, token) in enumerate(zip(content, generated)):
        position = len(prompt) - 1 + k
        assert bytes(entry.bytes) == tokenizer.token_bytes(token)
        assert abs(entry.logprob - logp[position, token]) < 1e-4
        assert len(entry.top_logprobs) == 3
        best = np.argsort(-logp[position])[:3]
        for alternative, want in zip(entry.top_logprobs, best):
            assert bytes(alternative.bytes) == tokenizer.token_bytes(int(want))
            assert abs(alternative.logprob - logp[position, want]) < 1e-4
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == tokenizer.decode(generated)


def test_chat_logprobs_stream_equal_whole(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHATS[2], max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHATS[2], max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens


def test_chat_without_logprobs_has_none(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHATS[5], max_tokens=2, temperature=0)
    assert reply.choices[0].logprobs is None


def test_completions_logprobs_whole_and_stream(client, tiny, tokenizer, refs):
    whole = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4, temperature=0, logprobs=2)
    logprobs = whole.choices[0].logprobs
    generated = refs.text[0].tokens[:4]
    prompt = tokenizer.encode(TEXTS[0], add_bos=True)
    logp = log_softmax(np.asarray(tiny.forward(np.array([prompt + generated], np.int32)))[0])
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    for k, token in enumerate(generated):
        assert abs(logprobs.token_logprobs[k] - logp[len(prompt) - 1 + k, token]) < 1e-4
        assert len(logprobs.top_logprobs[k]) <= 2 and max(logprobs.top_logprobs[k].values()) == pytest.approx(
            logp[len(prompt) - 1 + k].max(), abs=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:k]) for k in range(4)]
    chunks = list(client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [lp for s in streamed for lp in s.token_logprobs] == logprobs.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text



def test_serve_draft_tokens_runs_the_engine_with_mtp_drafts():
    """`python -m dsr1 serve --draft-tokens 1` loads the demo model with its MTP module and drafts; the
    metrics count the drafts verified and accepted."""
    from dsr1.__main__ import _parser
    from dsr1.server.cli import build_engine
    from dsr1.server.metrics import Metrics

    args = _parser().parse_args(["serve", "--draft-tokens", "1", "--dtype", "float32", "--max-seqs", "2",
                                 "--num-pages", "32", "--max-seq-len", "128", "--no-warmup"])
    engine = build_engine(args)
    assert engine.config.draft_tokens == 1 and "mtp" in engine.model.params
    request = engine.submit("To be, or not to be,", sampling=Sampling(temperature=0.0), max_new_tokens=12)
    while engine.step():
        pass
    stats = engine.stats()
    assert request.finished_at is not None and stats.drafted_tokens > 0 and stats.accepted_drafts > 0
    text = Metrics(engine.stats, lambda: 0).render().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["dsr1_spec_decode_draft_tokens_total"] == stats.drafted_tokens
    assert samples["dsr1_spec_decode_accepted_tokens_total"] == stats.accepted_drafts
