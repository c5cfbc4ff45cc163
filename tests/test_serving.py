"""The serving engine (`dsr1.serving.Engine`) against `dsr1.generate`, on the tiny random model in
float32: greedy outputs equal generate's for every request whatever joins, leaves, shares prefixes
or gets its cached pages evicted to host memory and reloaded; a seeded request samples the same
tokens in any company and at any arrival; nothing compiles after warm-up; requests wait for pages
and all complete; cancel frees pages; stop strings and streaming; stats.

Every engine here has the same shapes (slots, page size, pool, chunk), so its programs compile
once for the whole module; the page allocator is checked against every holder after each test.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import dsr1
from dsr1.generation.sampling import Sampling
from dsr1.serving import Engine, Request

from .harness import TINY
from .test_paged import counting_compilations

SHAPES = dict(max_seqs=4, page_size=4, num_pages=40, prefill_chunk=8, prefill_rows=2)  # 39 usable pages
REFERENCE_BUDGET = 12  # generate's budget for the references; requests take the first max_new_tokens
HOST_CACHE = 1 << 24


@pytest.fixture(scope="module")
def tiny():
    return dsr1.init_random(TINY, seed=0, dtype="float32")


def checked_engines(model: dsr1.Model, shapes: dict):
    """A `make_engine` fixture's body: yields `make(**options)`, an engine of `shapes`; after the test
    each must pass the allocator check with its holders (running requests and the prefix cache),
    and an idle one must hold only cached pages."""
    engines: list[Engine] = []

    def make(**options) -> Engine:
        engines.append(Engine(model, **{**shapes, **options}))
        return engines[-1]

    yield make
    for engine in engines:
        engine.check()
        if not engine.has_work:
            assert engine.stats().pages_used == engine.stats().pages_cached


@pytest.fixture
def make_engine(tiny):
    """Engines of the module's shapes, checked after the test (`checked_engines`)."""
    yield from checked_engines(tiny, SHAPES)


Arrival = tuple[int, Any, dict]  # (step, prompt, submit options)


def run_arrivals(engine: Engine, arrivals: Sequence[Arrival], stats: list | None = None) -> list[Request]:
    """Submit each prompt when the engine reaches its step; step until everything is done (appending
    `engine.stats()` after every step to `stats`)."""
    requests: list[Request | None] = [None] * len(arrivals)
    step = 0
    while step <= max(a[0] for a in arrivals) or engine.has_work:
        for i, (at, prompt, options) in enumerate(arrivals):
            if at == step:
                requests[i] = engine.submit(prompt, **options)
        engine.step()
        if stats is not None:
            stats.append(engine.stats())
        step += 1
    return requests


def shared_prefix_workload(rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    """`n` prompts of 17..32 tokens (one `generate` bucket): most extend one of four shared prefixes
    (13 to 20 tokens: 3 to 5 pages of 4), some share nothing."""
    prefixes = [rng.integers(2, vocab, size).tolist() for size in (13, 16, 18, 20)]
    prompts = []
    for i in range(n):
        if i % 6 == 5:
            prompts.append(rng.integers(2, vocab, int(rng.integers(17, 33))).tolist())
        else:
            prefix = prefixes[i % 4]
            suffix = int(rng.integers(max(1, 17 - len(prefix)), 33 - len(prefix)))
            prompts.append(prefix + rng.integers(2, vocab, suffix).tolist())
    return prompts


def greedy_reference(model, prompt: list[int]) -> list[int]:
    return dsr1.generate(model, [prompt], max_new_tokens=REFERENCE_BUDGET).completions[0].tokens


@pytest.mark.slow
def test_greedy_equals_generate_alone_with_shared_prefixes_and_offload(tiny, make_engine):
    rng = np.random.default_rng(0)
    prompts = shared_prefix_workload(rng, 36, TINY.vocab_size)
    budgets = rng.integers(2, REFERENCE_BUDGET + 1, len(prompts)).tolist()
    steps = np.sort(rng.integers(0, 40, len(prompts))).tolist()
    engine = make_engine(host_cache_bytes=HOST_CACHE)
    snapshots: list = []
    requests = run_arrivals(engine, [(at, p, dict(max_new_tokens=b)) for at, p, b in zip(steps, prompts, budgets)],
                            snapshots)
    stats = engine.stats()
    print(f"\n[engine] {len(prompts)} requests in {stats.steps} steps: {stats}")
    for request, prompt, budget in zip(requests, prompts, budgets):
        expected = greedy_reference(tiny, prompt)[:budget]
        assert request.tokens == expected, f"request {request.id} differs from generate alone"
        assert request.finish_reason == ("length" if len(expected) == budget else "stop")
    assert stats.prefix_hit_tokens > 0 and stats.offloaded_pages > 0 and stats.reloaded_pages > 0
    # Prompts were prefilled ahead of a free decode row (more requests ran than rows), and requests waited.
    assert max(s.running for s in snapshots) > SHAPES["max_seqs"] and max(s.waiting for s in snapshots) > 0
    # Stats of the finished run.
    capacity = SHAPES["num_pages"] - 1
    assert (stats.running, stats.waiting, stats.finished) == (0, 0, len(prompts))
    assert stats.pages_used + stats.pages_free == capacity and stats.pages_used == stats.pages_cached
    assert stats.prompt_tokens == sum(map(len, prompts)) and stats.generated_tokens == sum(budgets)
    cfg = tiny.cfg
    page_bytes = cfg.num_hidden_layers * SHAPES["page_size"] * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert stats.host_pages > 0 and stats.host_bytes == stats.host_pages * page_bytes
    assert stats.tokens_per_second > 0 and stats.host_ms_per_step > 0 and stats.device_ms_per_step > 0
    assert all(r.time_to_first_token > 0 for r in requests)


@pytest.mark.slow
def test_seeded_request_samples_the_same_in_any_company(tiny, make_engine):
    rng = np.random.default_rng(1)
    prompt = rng.integers(2, TINY.vocab_size, 23).tolist()
    seeded = Sampling(temperature=0.8, top_k=40, repetition_penalty=1.2, presence_penalty=0.5, seed=1234)
    alone = run_arrivals(make_engine(), [(0, prompt, dict(sampling=seeded, max_new_tokens=REFERENCE_BUDGET))])[0]
    busy = [(0, prompt, dict(max_new_tokens=3))]  # the same prompt first: the seeded one reuses its pages
    busy += [(at, p, dict(sampling=Sampling(temperature=1.0, top_p=0.9), max_new_tokens=9))
             for at, p in enumerate(shared_prefix_workload(rng, 6, TINY.vocab_size))]
    busy += [(12, prompt, dict(sampling=seeded, max_new_tokens=REFERENCE_BUDGET)),
             (12, prompt, dict(sampling=Sampling(temperature=0.8, seed=99), max_new_tokens=REFERENCE_BUDGET))]
    late = run_arrivals(make_engine(host_cache_bytes=HOST_CACHE), busy)
    generated = dsr1.generate(tiny, [prompt], sampling=seeded, max_new_tokens=REFERENCE_BUDGET).completions[0].tokens
    assert (alone.cached_tokens, late[-2].cached_tokens) == (0, 20)
    assert late[-2].tokens == alone.tokens == generated
    assert late[-1].tokens != alone.tokens, "another seed samples other tokens"


@pytest.mark.slow
def test_no_compilation_after_warm_up_during_200_steps(make_engine):
    """Requests of random lengths, budgets and settings join, share prefixes, get cancelled, wait for
    pages, get their prefixes offloaded and reloaded: the programs compiled at warm-up serve it all."""
    rng = np.random.default_rng(2)
    prompts = shared_prefix_workload(rng, 80, TINY.vocab_size)
    engine = make_engine(host_cache_bytes=HOST_CACHE)
    engine.warm_up()
    requests: list[Request] = []
    with counting_compilations() as compiled:
        step = 0
        while engine.has_work or (prompts and engine.stats().steps < 200):
            if step % 3 == 0 and prompts:
                sampling = Sampling(temperature=float(rng.choice([0.0, 0.7])), top_p=float(rng.choice([1.0, 0.8])),
                                    seed=int(rng.integers(1 << 20)))
                requests.append(engine.submit(prompts.pop(), sampling=sampling,
                                              max_new_tokens=int(rng.integers(1, 17))))
            if step % 17 == 0 and requests:
                requests[int(rng.integers(len(requests)))].cancel()
            engine.step()
            step += 1
    stats = engine.stats()
    print(f"\n[engine] {len(requests)} requests, {stats.steps} steps, {len(compiled)} compilations: {stats}")
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert stats.steps >= 200 and stats.offloaded_pages > 0 and stats.reloaded_pages > 0
    assert all(r.done for r in requests) and any(r.finish_reason == "abort" for r in requests)


def test_out_of_pages_requests_wait_and_all_complete(make_engine):
    """Each request may need 15 of the 39 pages: two run at a time, the rest wait their turn."""
    rng = np.random.default_rng(3)
    engine = make_engine()
    requests = [engine.submit(rng.integers(2, TINY.vocab_size, 30).tolist(), max_new_tokens=30) for _ in range(5)]
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (2, 3)
    most = 0
    while engine.step():
        most = max(most, engine.stats().running)
        engine.check()
    assert most == 2
    assert [len(r.tokens) for r in requests] == [30] * 5 and {r.finish_reason for r in requests} == {"length"}


def test_cancel_frees_pages_and_slots(make_engine):
    rng = np.random.default_rng(4)
    engine = make_engine(prefix_caching=False)
    requests = [engine.submit(rng.integers(2, TINY.vocab_size, 20).tolist(), max_new_tokens=16) for _ in range(5)]
    running, waiting = requests[0], requests[4]
    while not running.tokens:  # mid-flight: the first request is decoding, the fifth waits for a slot
        engine.step()
    assert engine.stats().running == 4 and engine.stats().waiting == 1
    used = engine.stats().pages_used
    running.cancel()
    waiting.cancel()
    engine.step()
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert 0 < len(running.tokens) < 16 and waiting.tokens == []
    assert engine.stats().pages_used < used, "the cancelled request's pages are free again"
    engine.check()
    engine.run()
    assert [r.finish_reason for r in requests[1:4]] == ["length"] * 3


def test_stop_strings_cut_exactly_and_streams_join_to_the_text(make_engine):
    tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())  # TINY's vocabulary
    engine = make_engine(tokenizer=tokenizer)
    free = engine.submit("The quick brown fox", max_new_tokens=40)
    engine.run()
    assert len(free.text) > 30
    stop = free.text[20:24]
    pieces: list[str] = []
    cut = engine.submit("The quick brown fox", max_new_tokens=40, on_text=pieces.append,
                        sampling=Sampling(stop_strings=("zzzz-never", stop)))
    streamed: list[str] = []
    reader = threading.Thread(target=lambda: streamed.extend(cut.stream(timeout=60)))
    reader.start()
    engine.run()
    reader.join(timeout=60)
    assert cut.text == free.text[:free.text.index(stop)] and cut.finish_reason == "stop"
    assert "".join(pieces) == "".join(streamed) == "".join(cut) == cut.text
    assert len(pieces) > 1, "text is streamed as it comes, not all at the end"
    chat = engine.submit([{"role": "user", "content": "Why is the sky blue?"}], max_new_tokens=6)
    engine.run()
    completion = chat.completion()
    assert completion.reasoning == completion.text.strip("\n") and completion.answer == ""


def test_submit_refuses_what_can_never_run(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len=156"):
        engine.submit([5] * 150, max_new_tokens=10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([5, -1])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit([])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.submit([5, 6], sampling=Sampling(stop_strings="x"))
    with pytest.raises(ValueError, match="prefill_rows=5 exceeds max_seqs=4"):
        make_engine(prefill_rows=5)


@pytest.mark.slow
def test_decoding_rows_keep_streaming_while_a_long_prompt_is_prefilled(make_engine):
    rng = np.random.default_rng(5)
    engine = make_engine(decode_steps=2)
    short = engine.submit(rng.integers(2, TINY.vocab_size, 10).tolist(), max_new_tokens=40)
    while not short.tokens:
        engine.step()
    long = engine.submit(rng.integers(2, TINY.vocab_size, 100).tolist(), max_new_tokens=2)  # 13 chunks of 8
    produced = []
    for _ in range(10):
        engine.step()
        produced.append(len(short.tokens))
    assert long.tokens == [] and engine.stats().running == 2
    steps = engine.config.decode_steps
    assert np.diff(produced).tolist() == [steps] * 9, "decode_steps tokens every step while the prompt is prefilled"
    engine.run()
    assert len(short.tokens) == 40 and len(long.tokens) == 2


def test_request_handle_is_usable_from_other_threads():
    """The handle alone (no engine, no tokenizer): a stop token ends it, waiters and iterators wake."""
    request = Request(7, [3, 4], Sampling(stop_token_ids=(9,), seed=0), None)
    assert not request.wait(timeout=0.01) and request.finish_reason is None
    with pytest.raises(RuntimeError, match="still running"):
        request.completion()
    finished = threading.Event()
    threading.Thread(target=lambda: request.wait() and finished.set()).start()
    assert request.add_tokens([5, 6]) is False
    assert request.add_tokens([9, 8]) is True, "the stop token ends the output; what follows is dropped"
    request.finish("stop")
    assert finished.wait(timeout=10) and request.tokens == [5, 6] and list(request.stream()) == []
    assert request.completion().finish_reason == "stop" and request.time_to_first_token > 0
    with pytest.raises(ValueError, match="finish reason 'oops'"):
        request.finish("oops")


def test_prefill_call_takes_the_smallest_shape_that_holds_its_rows():
    from dsr1.serving.shapes import SchedulerConfig

    config = SchedulerConfig(max_seqs=8, page_size=16, num_pages=64, prefill_chunk=64, prefill_rows=2, max_seq_len=512)
    assert config.prefill_shapes == ((1, 16), (1, 64), (2, 16), (2, 64))

    def lanes(*counts):
        return [type("Lane", (), {"count": c})() for c in counts]

    assert config.prefill_shape(lanes(64, 1)) == (2, 64)
    assert config.prefill_shape(lanes(16, 3)) == (2, 16)
    assert config.prefill_shape(lanes(17)) == (1, 64)
    assert config.prefill_shape(lanes(5)) == (1, 16)
    small = SchedulerConfig(max_seqs=4, page_size=4, num_pages=40, prefill_chunk=8, prefill_rows=2, max_seq_len=64)
    assert small.prefill_shapes == ((1, 8), (2, 8))


@pytest.mark.slow
def test_a_prompt_is_prefilled_ahead_while_every_row_decodes(tiny, make_engine):
    """Slots beyond the decode rows: a prompt arriving while all `max_seqs` rows decode is prefilled at
    once, waits for a row, and takes the first that frees; no decode call runs more than `max_seqs`
    rows; prefill calls never sample (a prompt's last token is its first decode input)."""
    rng = np.random.default_rng(6)
    engine = make_engine(prefix_caching=False, decode_steps=2)
    plans: list = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    rows = SHAPES["max_seqs"]
    budgets = [REFERENCE_BUDGET] * (rows - 1) + [6]  # the last to start decoding frees its row first
    busy = [engine.submit(rng.integers(2, TINY.vocab_size, 12).tolist(), max_new_tokens=b) for b in budgets]
    while not plans or len(plans[-1].decode) < rows:
        engine.step()
    prompt = rng.integers(2, TINY.vocab_size, 9).tolist()  # 8 tokens to prefill: one chunk
    late = engine.submit(prompt, max_new_tokens=6)
    engine.run()
    assert all(len(plan.decode) <= rows for plan in plans)
    assert not any(lane.sample for plan in plans for lane in plan.prefill)
    late_lanes = [(i, lane) for i, plan in enumerate(plans) for lane in plan.prefill + plan.decode
                  if lane.seq.request is late]
    (prefilled, chunk), (joined, first) = late_lanes[0], late_lanes[1]
    assert (chunk.start, chunk.count) == (0, len(prompt) - 1)
    assert (first.start, first.feed_last, first.sample_index) == (len(prompt) - 1, True, 0)
    assert joined > prefilled + 1, "prefilled ahead: it waited for a row with its prompt done"
    assert len(plans[joined - 1].decode) == rows, "every row decoded while it waited"
    assert late.tokens == greedy_reference(tiny, prompt)[:6]
    for request in busy:
        assert request.tokens == greedy_reference(tiny, request.prompt)[:request.sampling.max_new_tokens]


@pytest.mark.slow
def test_requests_arriving_together_prefill_their_shared_prefix_once(tiny, make_engine):
    """Submitted in one step, requests sharing a 16-token system prompt wait for the first one's pages
    instead of each computing them: the prefix cache serves it to the other three."""
    from dsr1.serving.scheduler import common_pages

    assert common_pages([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9], 2) == 6
    assert common_pages([1, 2, 3], [1, 2, 3, 4], 2) == 2 and common_pages([1, 2], [3, 2], 2) == 0
    rng = np.random.default_rng(7)
    system = rng.integers(2, TINY.vocab_size, 16).tolist()  # 4 whole pages
    prompts = [system + rng.integers(2, TINY.vocab_size, 5).tolist() for _ in range(4)]
    engine = make_engine()
    requests = [engine.submit(p, max_new_tokens=REFERENCE_BUDGET) for p in prompts]
    engine.run()
    assert [r.cached_tokens for r in requests] == [0, 16, 16, 16]
    assert engine.stats().prefix_hit_tokens == 48
    for request, prompt in zip(requests, prompts):
        assert request.tokens == greedy_reference(tiny, prompt)


def test_decode_call_takes_the_fewest_rows_that_hold_its_lanes():
    from dsr1.serving.shapes import SchedulerConfig

    def config(max_seqs):
        return SchedulerConfig(max_seqs=max_seqs, page_size=4, num_pages=40, prefill_chunk=8, prefill_rows=2,
                               max_seq_len=64)

    assert [config(n).decode_shapes for n in (4, 8, 12, 16, 64)] == [(1, 4), (1, 8), (1, 12), (1, 8, 16),
                                                                      (1, 8, 16, 32, 64)]
    wide = config(64)
    assert [wide.decode_shape([None] * n) for n in (1, 2, 8, 9, 17, 33, 64)] == [1, 8, 8, 16, 32, 64, 64]
    invariant = dataclasses.replace(wide, batch_invariant=True)  # a row's products never change shape
    assert invariant.decode_shapes == (64,)
    assert {invariant.decode_shape([None] * n) for n in (1, 9, 64)} == {64}
    assert wide.prefill_shapes == ((1, 8), (2, 8)) and invariant.prefill_shapes == ((2, 8),)


def test_data_parallel_ranks_split_slots_pages_and_call_rows():
    """Four ranks: each holds a quarter of the slots and pages, every call gives each rank the rows the
    busiest one needs, each rank's lanes in its own block of rows."""
    from types import SimpleNamespace

    from dsr1.serving.rows import rank_rows
    from dsr1.serving.shapes import SchedulerConfig

    config = SchedulerConfig(max_seqs=64, page_size=4, num_pages=40, prefill_chunk=8, prefill_rows=4, max_seq_len=64,
                             ranks=4)
    assert (config.rank_slots, config.rank_pages) == (17, 10)
    assert config.decode_shapes == (4, 32, 64) and config.prefill_shapes == ((4, 8),)

    def lanes(*ranks):
        return [SimpleNamespace(seq=SimpleNamespace(rank=r), count=8) for r in ranks]

    two_on_rank_1 = lanes(1, 1, 3)
    assert config.decode_shape(two_on_rank_1) == 32 and config.prefill_shape(lanes(0, 2, 3)) == (4, 8)
    rows = rank_rows(two_on_rank_1, 8, 4)
    assert [None if lane is None else lane.seq.rank for lane in rows] == [None, None, 1, 1, None, None, 3, None]
    with pytest.raises(ValueError, match="prefill_rows=2 must be a multiple of the 4 data-parallel ranks"):
        SchedulerConfig(max_seqs=8, page_size=4, num_pages=40, prefill_chunk=8, prefill_rows=2, max_seq_len=64,
                        ranks=4)


@pytest.mark.slow
def test_sixteen_slots_decode_in_narrower_calls_without_compiling(tiny, make_engine):
    """16 slots: decode calls of 8 rows while at most 8 decode, of 16 beyond; every call shape compiled
    at warm-up; greedy and seeded rows give the tokens they give alone."""
    rng = np.random.default_rng(5)
    prompts = shared_prefix_workload(rng, 14, TINY.vocab_size)
    seeded = Sampling(temperature=0.9, top_k=20, seed=77)
    engine = make_engine(max_seqs=16, num_pages=80)
    engine.warm_up()
    arrivals = [(0, prompts[0], dict(sampling=seeded, max_new_tokens=REFERENCE_BUDGET))]
    arrivals += [(1 + i // 4, p, dict(max_new_tokens=int(rng.integers(3, REFERENCE_BUDGET + 1))))
                 for i, p in enumerate(prompts[1:])]
    snapshots: list = []
    with counting_compilations() as compiled:
        requests = run_arrivals(engine, arrivals, snapshots)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert max(s.running for s in snapshots) > 8, "some steps decode more than 8 rows"
    alone = dsr1.generate(tiny, [prompts[0]], sampling=seeded, max_new_tokens=REFERENCE_BUDGET).completions[0]
    assert requests[0].tokens == alone.tokens
    for request, prompt in zip(requests[1:], prompts[1:]):
        assert request.tokens == greedy_reference(tiny, prompt)[:len(request.tokens)]
        assert request.finish_reason == "length" or len(request.tokens) < REFERENCE_BUDGET


def test_step_rows_pack_round_trip():
    import jax

    from dsr1.programs.step import StepRows

    rng = np.random.default_rng(0)
    rows = StepRows(slots=np.array([2, 4, 0], np.int32), tokens=rng.integers(0, 1000, (3, 5), dtype=np.int32),
                    starts=np.array([7, 0, 3], np.int32), counts=np.array([5, 0, 1], np.int32),
                    feed_last=np.array([False, False, True]), sample=np.array([True, False, True]),
                    sample_index=np.array([0, 0, 9], np.int32), logprobs=np.array([True, False, False]),
                    steps=np.array([1, 4, 2], np.int32), prompt_logprobs=np.array([True, False, False]),
                    mask_row=np.array([-1, -1, 2], np.int32))
    back = jax.jit(StepRows.unpack)(rows.pack())
    for name in ("slots", "tokens", "starts", "counts", "feed_last", "sample", "sample_index", "logprobs", "steps",
                 "prompt_logprobs", "mask_row"):
        want, got = getattr(rows, name), np.asarray(getattr(back, name))
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_sampled_pack_round_trip():
    import jax

    from dsr1.programs.step import Sampled
    from dsr1.serving.scheduler import sampled_logprob

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, 3).astype(np.int32)
    logprobs = -rng.random(3).astype(np.float32)
    top_ids = rng.integers(0, 1000, (3, 20)).astype(np.int32)
    top_logprobs = np.sort(-rng.random((3, 20)).astype(np.float32))[:, ::-1]
    top_logprobs[2, 5:] = -np.inf
    back = Sampled.unpack(np.asarray(jax.jit(Sampled.pack)(tokens, logprobs, top_ids, top_logprobs)))
    for want, got in zip((tokens, logprobs, top_ids, top_logprobs), (back.tokens, back.logprobs, back.top_ids,
                                                                      back.top_logprobs)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert sampled_logprob(back, 0, None) is None
    entry = sampled_logprob(back, 2, 2)
    assert entry.token == tokens[2] and entry.logprob == logprobs[2] and len(entry.top) == 2


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.slow
def test_logprobs_are_the_raw_log_softmax_whatever_the_sampling(tiny, make_engine):
    """Each output token's log-probability and the top alternatives equal the log-softmax of
    `Model.forward`'s logits at its position: before penalties and temperature, for greedy and
    sampled requests running side by side with one that asks for none."""
    engine = make_engine()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, tiny.cfg.vocab_size, n).tolist() for n in (11, 19, 6)]
    settings = [Sampling(), Sampling(temperature=1.3, top_k=50, presence_penalty=1.5, seed=7), Sampling()]
    requests = [engine.submit(p, sampling=s, max_new_tokens=7, logprobs=k)
                for p, s, k in zip(prompts, settings, (5, 0, None))]
    engine.run()
    assert requests[2].logprobs is None
    for prompt, request, top in zip(prompts, requests, (5, 0)):
        logp = log_softmax(np.asarray(tiny.forward(np.array([prompt + request.tokens], np.int32)))[0])
        assert [e.token for e in request.logprobs] == request.tokens and len(request.tokens) == 7
        for k, entry in enumerate(request.logprobs):
            position = len(prompt) - 1 + k
            assert abs(entry.logprob - logp[position, entry.token]) < 1e-4
            assert [t for t, _ in entry.top] == np.argsort(-logp[position], kind="stable")[:top].tolist()
            assert np.allclose([lp for _, lp in entry.top], np.sort(logp[position])[::-1][:top], atol=1e-4)


@pytest.mark.slow
def test_multi_step_decode_equals_one_step_at_a_time(tiny, make_engine):
    """Decode calls of 4 steps (rows with less budget left run fewer) give the tokens of one step per
    call, in fewer engine steps; a request arriving mid-way waits for the call and then joins."""
    rng = np.random.default_rng(5)
    arrivals = [(at, rng.integers(2, tiny.cfg.vocab_size, int(n)).tolist(), {"max_new_tokens": int(m)})
                for at, n, m in zip((0, 0, 3, 9, 9), rng.integers(5, 20, 5), rng.integers(2, 12, 5))]
    runs = {}
    for steps in (1, 4):
        stats: list = []
        requests = run_arrivals(make_engine(decode_steps=steps), arrivals, stats)
        runs[steps] = ([r.tokens for r in requests], stats[-1].steps)
    assert runs[4][0] == runs[1][0] and [len(t) for t in runs[4][0]] == [a[2]["max_new_tokens"] for a in arrivals]
    assert runs[4][1] < runs[1][1]


def test_logprobs_stop_with_the_tokens(tiny, make_engine):
    """A stop token is not an output token, so it has no log-probability; a bad `logprobs` is refused."""
    engine = make_engine()
    prompt = list(range(5, 20))
    free = engine.submit(prompt, max_new_tokens=6, logprobs=1)
    engine.run()
    stop = free.tokens[3]
    stopped = engine.submit(prompt, sampling=Sampling(stop_token_ids=stop), max_new_tokens=6, logprobs=1)
    engine.run()
    assert stopped.tokens == free.tokens[:3] and [e.token for e in stopped.logprobs] == stopped.tokens
    # (the second run reads the prompt from the prefix cache: the same values up to float32 rounding)
    assert np.allclose([e.logprob for e in stopped.logprobs], [e.logprob for e in free.logprobs[:3]], atol=1e-5)
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            engine.submit(prompt, logprobs=bad)


@pytest.mark.parametrize("vocab", [5, 128, 300, 1024])
def test_blocked_argmax_equals_jnp_argmax(vocab):
    """`sampling.argmax` (the serving and generate samplers' greedy pick) gives jnp.argmax's index:
    the first maximum, ties, -inf rows, the first NaN."""
    import jax.numpy as jnp

    from dsr1.programs.sampling import argmax

    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(6, vocab)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[1, [vocab // 2, vocab - 1]] = 10.0  # the first of two maxima
    x[2] = -np.inf
    x[3, [vocab - 1, vocab // 3]] = np.nan
    x[4, -1] = np.inf
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    got = np.asarray(argmax(jnp.asarray(x)))
    assert got.dtype == np.int32 and np.array_equal(got, want)
