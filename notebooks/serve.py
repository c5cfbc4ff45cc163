# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # dsr1 OpenAI-compatible server on the cluster
#
# The server of `python -m dsr1 serve` (`dsr1.server`), started from this notebook on every JAX
# process: **process 0 serves HTTP** and decides each step of the serving engine; every other process
# runs the same programs on process 0's schedule (`engine.follow()`). Both run in **background
# threads**, so every cell returns and the notebook stays usable while the server runs: requests go
# out with the official `openai` client from a cell here, a live view polls the server's metrics, and
# a last cell stops it all cleanly.
#
# Start the cluster first, as for `main.ipynb`: `./mcjax_setup.sh` on a real cluster, or
# `./mcjax_setup.sh --local 4` for a simulated one on this machine. `DSR1_CHECKPOINT` picks the model
# as there (unset: the embedded demo model, a small DeepSeek-V3 trained on Shakespeare).

# %%
# Connects to the cluster (cluster.json): restarts engines that cannot join this kernel (after "Restart
# kernel"), numbers the processes (PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere: kernel-last, the
# kernel last; platform on TPU pods and Slurm, JAX numbers them and the kernel is process 0) and defines
# the `%%everywhere` magic. With MCJAX_SINGLE=1 (one host) this kernel is the only process.
import os

import dsr1.workbench as mcjax

cluster = mcjax.connect()
layout = cluster.layout
print(cluster.summary())
assert NUM_PROCESSES == len(layout.engines) + 1 and PROCESS_ID == layout.kernel_process_id

# %% [markdown]
# ## Where the server listens
# Process 0 serves: this kernel under platform numbering, the engine of host 1 under kernel-last.
# It binds the address on which the kernel's host reaches it: loopback when it is this kernel, else
# its host's internal address (on the simulated cluster both are 127.0.0.1), never all interfaces.
# A bind other than loopback needs an API key (`dsr1.server.options.bind_refusal`), so the notebook
# always sets one: `$DSR1_API_KEY`, else a random key for this session. `SERVE_PORT = 0` takes the
# first free port of the cluster's one range (`MCJAX_PORTS`, 8476-8575; any free one on the simulated
# cluster); pick a fixed one (e.g. 8000) to reach the server through an ssh port-forward (see the end).

# %%
import secrets
from pathlib import Path

from dsr1.server.options import bind_refusal

CHECKPOINT = os.environ.get("DSR1_CHECKPOINT")   # None: the embedded demo model
MODEL_NAME = Path(CHECKPOINT).resolve().name if CHECKPOINT else "dsr1-demo"
QUANT = KV_CACHE_DTYPE = "auto"   # the capacity plan's form for these devices (int8 where bf16 does not fit)
leader_engine = next((e for e in layout.engines if e.process_id == 0), None)
SERVE_HOST = leader_engine.address if leader_engine else "127.0.0.1"
SERVE_PORT = 0
API_KEY = os.environ.get("DSR1_API_KEY") or secrets.token_urlsafe(16)
if refusal := bind_refusal(SERVE_HOST, API_KEY):   # as `python -m dsr1 serve` refuses it
    raise ValueError(refusal)
settings = dict(CHECKPOINT=CHECKPOINT, MODEL_NAME=MODEL_NAME, SERVE_HOST=SERVE_HOST, SERVE_PORT=SERVE_PORT,
                API_KEY=API_KEY, QUANT=QUANT, KV_CACHE_DTYPE=KV_CACHE_DTYPE)
cluster.client[:].push(settings, block=True)
print(f"model {MODEL_NAME!r} ({CHECKPOINT or 'the embedded demo model'}); process 0 "
      f"({leader_engine.describe() if leader_engine else 'this kernel'}) will serve on {SERVE_HOST}")

# %% [markdown]
# ## Initialize `jax.distributed` in every process

# %%
import jax

mcjax.initialize_everywhere(cluster)   # on every engine (submitted first) and here; waits for all N processes
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
      f"{jax.device_count()} in all")

# %% [markdown]
# ## Mesh and model
# One mesh over every device of every process; weights are created (or read) directly into their shards,
# in the form the capacity plan fits on these devices (`QUANT` and `KV_CACHE_DTYPE` above: "auto", or your own).

# %%
# %%everywhere
import dsr1
from dsr1.workbench.weights_form import weights_form

mesh = dsr1.make_mesh()
path = CHECKPOINT or dsr1.demo_checkpoint()      # the package ships the demo model on every host
form = weights_form(path, mesh, QUANT, KV_CACHE_DTYPE)
model = dsr1.load(path, mesh=mesh, quant=form.quant, kv_cache_dtype=form.kv_cache_dtype,
                  progress=PROCESS_ID == KERNEL_PROCESS_ID)
tokenizer = dsr1.load_tokenizer(path)
print(f"mesh {dict(mesh.shape)}; {form.describe()}")

# %% [markdown]
# ## Start serving in background threads
# Every process builds the same `dsr1.serving.Engine`. The others start `engine.follow()` on a daemon
# thread: it receives each step process 0 decides and runs its programs, until process 0 calls
# `engine.close()`. Process 0 compiles every program first (`warm_up`, which the followers run with
# it), then starts the HTTP server (`BackgroundServer`: uvicorn on a thread of its own, the engine's
# loop on another). The cell returns everywhere while the threads serve.
#
# While the server runs, the processes' devices belong to it: do not run other `%%everywhere` cells
# with JAX work until it is stopped (their collectives would interleave with the engine's).

# %%
# %%everywhere
import threading
from concurrent.futures import Future

from dsr1.serving import Engine


def in_background(work, name: str) -> Future:
    """Run `work()` on a daemon thread (one stuck in a collective never holds up the process's exit);
    the Future gets its result or its exception."""
    done = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the Future
            done.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


engine = Engine(model, max_seqs=4, page_size=16, num_pages=64, prefill_chunk=32, tokenizer=tokenizer)
SERVER_URL = None
if engine.is_leader:
    from dsr1.server import BackgroundServer, ServerConfig, create_app
    from dsr1.workbench.ports import free_port

    engine.warm_up()
    app = create_app(engine, ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, default_max_tokens=64))
    server = BackgroundServer(app, host=SERVE_HOST, port=SERVE_PORT or free_port(SERVE_HOST), shutdown_timeout=30.0)
    server.start()
    SERVER_URL = server.url
    print(f"process {PROCESS_ID} serves '{MODEL_NAME}' on {SERVER_URL}/v1")
else:
    follower = in_background(engine.follow, "dsr1-follow")

# %% [markdown]
# The address is known to process 0 only: here, or pulled from the engines.

# %%
import httpx
import openai

URL = SERVER_URL or next(url for url in cluster.client[:].pull("SERVER_URL", block=True) if url)
client = openai.OpenAI(base_url=URL + "/v1", api_key=API_KEY, max_retries=0, timeout=300.0)
health = httpx.get(URL + "/health", timeout=10).json()
print(URL, health, [m.id for m in client.models.list()])
assert health["status"] == "ok"

# %% [markdown]
# ## A live view of the server
# A thread of this kernel polls `GET /metrics` (Prometheus text) every half second and updates the
# widget below: requests running and waiting, generated tokens per second and the mean time to first
# token of the requests that got theirs (both over the last two seconds), and the prompt tokens
# served from the prefix cache so far. Keep it in view while the next cell sends requests.

# %%
from IPython.display import display

from dsr1.workbench.server_view import LiveMetrics, plot_history, scrape

live = LiveMetrics(URL, API_KEY)
display(live)
live.start()

# %% [markdown]
# ## Send requests with the `openai` client
# Eight at once, from threads, more than the engine's four batch slots (so some wait): chat and plain
# completions, streamed and whole. Six share a long system prompt or text prefix: once one of them
# has prefilled it, the others find its pages in the prefix cache (`cached_tokens` in `usage`).

# %%
from concurrent.futures import ThreadPoolExecutor

SHARED = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
          "that lour'd upon our house in the deep bosom of the ocean buried.\n\n")
QUESTIONS = ["What say you, my lord?", "Who comes here?", "Where is the king?"]


Reply = tuple[str, str, int, int]  # text, finish reason, completion tokens, prompt tokens from the prefix cache
USAGE = {"include_usage": True}    # a stream's last chunk carries the usage


def counts(usage) -> tuple[int, int]:
    return usage.completion_tokens, usage.prompt_tokens_details.cached_tokens


def chat_text(message) -> str:
    """A chat message's (or delta's) text: R1's reasoning (`reasoning_content`, an extra field) and answer."""
    return (getattr(message, "reasoning_content", None) or "") + (message.content or "")


def collect(chunks, text_of) -> Reply:
    """A stream's reply; `text_of(choice)` is the new text of a chunk's choice."""
    pieces, finish, usage = [], None, None
    for chunk in chunks:
        for choice in chunk.choices:
            pieces.append(text_of(choice))
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return "".join(pieces), finish, *counts(usage)


def chat(messages: list[dict], stream: bool) -> Reply:
    args = dict(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.0)
    if stream:
        chunks = client.chat.completions.create(**args, stream=True, stream_options=USAGE)
        return collect(chunks, lambda choice: chat_text(choice.delta))
    r = client.chat.completions.create(**args)
    return chat_text(r.choices[0].message), r.choices[0].finish_reason, *counts(r.usage)


def complete(prompt: str, stream: bool) -> Reply:
    args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0.0)
    if stream:
        return collect(client.completions.create(**args, stream=True, stream_options=USAGE), lambda c: c.text)
    r = client.completions.create(**args)
    return r.choices[0].text, r.choices[0].finish_reason, *counts(r.usage)


def with_system(question: str) -> list[dict]:
    return [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]


streams = (True, False, True)
calls = [(f"chat, shared prefix, stream={s}", chat, with_system(q), s) for q, s in zip(QUESTIONS, streams)]
calls += [(f"text, shared prefix, stream={not s}", complete, SHARED + q, not s) for q, s in zip(QUESTIONS, streams)]
calls += [("chat, alone, stream=True", chat, [{"role": "user", "content": "Good morrow, sir."}], True),
          ("text, alone, stream=False", complete, "To be, or not to be,", False)]
with ThreadPoolExecutor(len(calls)) as pool:
    replies = list(pool.map(lambda call: call[1](*call[2:]), calls))
for (label, *_), (text, finish, tokens, cached) in zip(calls, replies):
    print(f"{label:32} {finish:>6} {tokens:2d} tokens, {cached:3d} cached: {text[:40]!r}")
assert all(finish in ("stop", "length") and 0 < tokens <= 16 for _, finish, tokens, _ in replies)
assert sum(cached for *_, cached in replies) > 0

# %% [markdown]
# ## What the server saw
# The live view's last sample, and its whole history as a figure (it stays in the saved notebook).

# %%
import matplotlib.pyplot as plt

live.stop()
last = scrape(URL, API_KEY)
plot_history(plt.figure(figsize=(12, 2.6)), live.history)
print(f"{len(live.history)} samples; {last['dsr1_requests_finished_total']:.0f} requests finished, "
      f"{last['dsr1_engine_generated_tokens_total']:.0f} tokens generated, "
      f"{last['dsr1_prefix_hit_tokens_total']:.0f} prompt tokens from the prefix cache, "
      f"{last['dsr1_engine_steps_total']:.0f} engine steps")
assert len(live.history) >= 2 and last["dsr1_requests_running"] == last["dsr1_requests_waiting"] == 0
# The engine counts every token it sampled; `usage` leaves out a stop token (one per "stop" reply at most).
completion_tokens, stopped = sum(r[2] for r in replies), sum(r[1] == "stop" for r in replies)
assert completion_tokens <= last["dsr1_engine_generated_tokens_total"] <= completion_tokens + stopped
assert last["dsr1_prefix_hit_tokens_total"] > 0 and last["dsr1_requests_finished_total"] == len(calls)

# %% [markdown]
# ## Tool calls and structured outputs
# The server parses DeepSeek-V3/R1's tool-call format into OpenAI's `tool_calls`. With `tool_choice`
# "required" (or a named function) the engine constrains the reply with a grammar built from the
# tools' JSON schemas, so even this small demo model (which never saw a tool) writes a call whose
# arguments parse and validate. The tool's result goes back as a `tool` message, which the chat
# template renders for the model's answer. `response_format` with a JSON schema constrains an answer
# the same way. R1's reasoning comes first and stays free, but within a budget (`max_reasoning_tokens`,
# at most a quarter of `max_tokens`) after which `</think>` is forced: this demo model never closes its
# reasoning on its own, and the constrained answer must still come.

# %%
import json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
question = [{"role": "user", "content": "Will it rain in Verona these three days?"}]
reply = client.chat.completions.create(model=MODEL_NAME, messages=question, tools=[WEATHER], tool_choice="required",
                                       max_tokens=120, temperature=0.0)
call = reply.choices[0].message.tool_calls[0]
arguments = json.loads(call.function.arguments)
print(reply.choices[0].finish_reason, call.function.name, arguments)
assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
turns = question + [reply.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "rain, then sun"}'}]
answer = client.chat.completions.create(model=MODEL_NAME, messages=turns, tools=[WEATHER], max_tokens=40,
                                        temperature=0.0)
print("answer:", repr(answer.choices[0].message.content))
assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls

# %%
CHARACTER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "role": {"enum": ["king", "queen", "fool", "lover"]},
                                              "age": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["name", "role", "age"], "additionalProperties": False}
structured = client.chat.completions.create(
    model=MODEL_NAME, messages=[{"role": "user", "content": "Describe a character of the play."}], max_tokens=80,
    temperature=0.0, response_format={"type": "json_schema",
                                      "json_schema": {"name": "character", "schema": CHARACTER, "strict": True}},
    extra_body={"max_reasoning_tokens": 16})
character = json.loads(structured.choices[0].message.content)
print(character)
assert set(character) == {"name", "role", "age"} and character["role"] in ("king", "queen", "fool", "lover")

# %% [markdown]
# ## Stop cleanly
# Process 0 stops the HTTP server gracefully (no new connections; requests still in flight get
# `shutdown_timeout` seconds, then are cancelled; the engine's loop ends), then calls `engine.close()`,
# which releases the followers from `follow()`; they wait for their thread to end. Every request has
# finished and no page of the cache leaked (`engine.check()`). Afterwards the processes' devices are
# free for other `%%everywhere` cells again.

# %%
# %%everywhere
if engine.is_leader:
    server.stop()
    engine.close()
    engine.check()
    stats = engine.stats()
    print(f"server stopped: {stats.finished} requests finished, {stats.running} running, {stats.waiting} waiting")
    assert stats.running == stats.waiting == 0 and stats.finished > 0 and not engine.has_work
else:
    follower.result(timeout=120)   # follow() returned (or its error is raised here)

# %% [markdown]
# ## On a real cluster
# - **Who serves**: process 0. Under kernel-last numbering that is the engine of host 1, bound to
#   host 1's internal address; under platform numbering it is this kernel on host 0, bound to
#   127.0.0.1. The API key guards every route but `/health`.
# - **From a laptop**: set `SERVE_PORT` to a fixed port (say 8000), then forward it through host 0,
#   as `cluster_port_forward` does for Jupyter: `ssh -N -L 127.0.0.1:8000:<address>:8000 <host 0>`,
#   where `<address>` is the one printed above (127.0.0.1 when the kernel serves). The laptop then
#   uses `openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=...)` with the notebook's
#   `API_KEY` (set `$DSR1_API_KEY` before starting Jupyter to choose it; else it is random).
# - **As a service** rather than from the notebook: `python -m dsr1 serve` on every process does the
#   same (process 0 serves, the others follow), with `--host`, `--port` and `--api-key` (or
#   `$DSR1_API_KEY`); any address other than loopback is refused without a key.
