"""EleutherAI's lm-evaluation-harness against `dsr1 serve`: every choice's log-likelihood equals
`Model.forward`'s within 1e-4 (float32).

lm-eval's `local-completions` scores a multiple-choice question by sending, per batch of choices,
`{"prompt": [context + continuation token ids, ...], "echo": true, "logprobs": 1, "max_tokens": 1,
"temperature": 0, "seed": 1234}` to `/v1/completions` and reading each choice (sorted by `index`)
as `sum(token_logprobs[ctxlen:-1])`, greedy when every one of those values is the largest of its
`top_logprobs`. The CI tests send exactly those requests and parse them exactly so; the extended
test runs the real harness (the `eval` extra) on a small local task against a `python -m dsr1 serve`
process, with the tokenizer read from the checkpoint folder and with the server's own (`/tokenize`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import dsr1
from dsr1.server import BackgroundServer, ServerConfig, create_app
from dsr1.serving import Engine

from .harness import start_demo_server, stop_server

MODEL = "demo"
# Small shapes: few programs to compile (each on its first request) for prompts of a few dozen tokens.
SHAPES = dict(max_seqs=4, page_size=16, num_pages=64, prefill_chunk=32, prefill_rows=1, max_seq_len=128)
PAYLOAD = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # lm-eval's, but model/prompt

# (context, continuation) as a multiple-choice task hands them to the model: the question, each answer.
QUESTIONS = [
    ("Who loves Juliet?", ["Romeo", "Hamlet", "Falstaff", "Lear"], 0),
    ("Who is the Prince of Denmark?", ["Macbeth", "Hamlet", "Othello"], 1),
    ("To be, or not to", ["be", "go", "sleep"], 0),
    ("GLOUCESTER:\nNow is the winter of our", ["discontent", "summer", "cheese"], 0),
    ("KING HENRY:\nOnce more unto the breach, dear", ["friends", "cousins", "Romans, countrymen"], 0),
]


def encode_pair(tokenizer: dsr1.Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `TemplateLM._encode_pair` for a causal model (no BOS, `add_bos_token=False` being its
    default): a context's trailing spaces move to the continuation, and the continuation's tokens are
    the whole text's past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def parse_logprobs(reply: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's `LocalCompletionsAPI.parse_logprobs`: per choice the continuation's summed
    log-probability (the echoed prompt's values past the context, less the generated token's) and
    whether each continuation token is the most likely one."""
    out = []
    for choice, ctxlen in zip(sorted(reply["choices"], key=itemgetter("index")), ctxlens, strict=True):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(values), all(v == max(top.values()) for v, top in zip(values, tops, strict=True))))
    return out


def forward_loglikelihood(model: dsr1.Model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood and greediness from `Model.forward`'s logits (float64 softmax)."""
    ids = context + continuation
    logits = np.asarray(model.forward(np.array([ids], np.int32)))[0].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    positions = range(len(context), len(ids))
    return (float(sum(logp[k - 1, ids[k]] for k in positions)),
            all(int(logp[k - 1].argmax()) == ids[k] for k in positions))


@pytest.fixture(scope="module")
def tokenizer() -> dsr1.Tokenizer:
    return dsr1.load_tokenizer(dsr1.demo_checkpoint())


@pytest.fixture(scope="module")
def model() -> dsr1.Model:
    return dsr1.load(dsr1.demo_checkpoint(), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def url(model, tokenizer):
    engine = Engine(model, **SHAPES, tokenizer=tokenizer)
    server = BackgroundServer(create_app(engine, ServerConfig(model_name=MODEL)), shutdown_timeout=5.0).start()
    yield server.url
    server.stop()


def complete(url: str, prompts: list[list[int]], **extra: Any) -> dict[str, Any]:
    reply = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompts, **PAYLOAD, **extra},
                       timeout=900)
    assert reply.status_code == 200, reply.text
    return reply.json()


# ---- the requests lm-eval sends, parsed as lm-eval parses them ----------------------------------
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.slow
def test_loglikelihood_requests_equal_forward(url, model, tokenizer, batch):
    """Every (context, choice) pair, batched as `--batch_size` batches them (longest first, a list
    of token-id prompts per request), scores as `Model.forward` does, greediness included."""
    pairs = [encode_pair(tokenizer, q + (" " if k % 2 else ""), " " + c if not k % 2 else c)
             for k, (q, choices, _) in enumerate(QUESTIONS) for c in choices]
    pairs.sort(key=lambda p: -len(p[0] + p[1]))
    scored = []
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        reply = complete(url, [c + d for c, d in chunk])
        assert [c["index"] for c in reply["choices"]] == list(range(len(chunk)))
        scored += parse_logprobs(reply, [len(c) for c, _ in chunk])
    greedy = 0
    for (context, continuation), (logprob, is_greedy) in zip(pairs, scored, strict=True):
        want, want_greedy = forward_loglikelihood(model, context, continuation)
        assert abs(logprob - want) < 1e-4, (tokenizer.decode(context + continuation), logprob, want)
        assert is_greedy == want_greedy
        greedy += is_greedy
    assert 0 < greedy < len(pairs)  # both kinds occur, so the greedy check was tested both ways


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_a_choice_whose_next_token_is_eos_keeps_its_last_token(url, model, tokenizer, stream):
    """`[ctxlen:-1]` drops the generated token: when that token is EOS (or a stop token id) it must
    still be listed, or the continuation's last token would be dropped instead."""
    context, continuation = encode_pair(tokenizer, "ROMEO:\nBut soft, what light", " through yonder window")
    prompt = context + continuation
    for stop in ({"logit_bias": {str(tokenizer.eos_id): 100}}, {"stop_token_ids": [prompt[-1]],
                                                                 "logit_bias": {str(prompt[-1]): 100}}):
        if stream:
            chunks = [json.loads(line[6:]) for line in httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": [prompt], **PAYLOAD, **stop, "stream": True},
                timeout=900).text.splitlines() if line.startswith("data: {")]
            parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
            logprobs = {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs")}
            reply = {"choices": [{"index": 0, "logprobs": logprobs, "finish_reason": chunks[-1]["choices"][0][
                "finish_reason"]}]}
        else:
            reply = complete(url, [prompt], **stop)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
        (logprob, _), = parse_logprobs(reply, [len(context)])
        assert abs(logprob - forward_loglikelihood(model, context, continuation)[0]) < 1e-4


def test_remote_tokenizer_endpoints(url, tokenizer):
    """lm-eval's `tokenizer_backend=remote` (chosen by `auto` when these answer): `/tokenizer_info`
    has the special tokens as text, and `/tokenize` without special tokens turns them into their ids."""
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["model_max_length"] == SHAPES["max_seq_len"]
    assert "<｜Assistant｜>" in info["chat_template"]
    for name, want in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        reply = httpx.post(url + "/tokenize", json={"prompt": info[name], "add_special_tokens": False}).json()
        assert reply["tokens"] == [want]
    text = "HAMLET:\nTo be, or not to be"
    assert httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == \
        tokenizer.encode(text)


# ---- the real harness ---------------------------------------------------------------------------------
TASK = """\
task: dsr1_shakespeare_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: Path) -> None:
    """A multiple-choice task on local data (`dataset_path: json`), found with `--include_path folder`."""
    data = folder / "shakespeare_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "shakespeare_mc.yaml").write_text(TASK.format(data=data))


@pytest.fixture(scope="module")
def served_process(tmp_path_factory):
    process, url = start_demo_server(tmp_path_factory.mktemp("serve") / "serve.log", "--max-seqs", "8",
                                     "--max-seq-len", "512")
    yield url
    stop_server(process)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_multiple_choice_end_to_end(served_process, model, tokenizer, tmp_path, backend):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")
    write_task(tmp_path)
    args = f"base_url={served_process}/v1/completions,model={MODEL},tokenizer_backend={backend}"
    # The checkpoint's tokenizer.json, one request at a time; or the server's /tokenize, two in flight.
    args += f",tokenizer={dsr1.demo_checkpoint()}" if backend == "huggingface" else ",num_concurrent=2"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                          "--tasks", "dsr1_shakespeare_mc", "--include_path", str(tmp_path), "--batch_size", "4",
                          "--output_path", str(tmp_path / "out"), "--log_samples"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_*.jsonl")
               for line in path.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(QUESTIONS)))
    correct = 0
    for sample in samples:
        question, choices, answer = QUESTIONS[sample["doc_id"]]
        wanted = []
        for arguments, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            assert arguments["arg_0"] == question
            (logprob, is_greedy), = response
            want, want_greedy = forward_loglikelihood(model, *encode_pair(tokenizer, question, arguments["arg_1"]))
            assert abs(float(logprob) - want) < 1e-4, (question, arguments["arg_1"], logprob, want)
            assert is_greedy == str(want_greedy)
            wanted.append(want)
        assert len(wanted) == len(choices)
        assert sample["acc"] == float(int(np.argmax(wanted)) == answer)
        correct += sample["acc"]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["results"]["dsr1_shakespeare_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
