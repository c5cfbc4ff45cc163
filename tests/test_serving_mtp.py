"""MTP speculative decoding in the serving engine (`dsr1.serving.Engine(..., draft_tokens=k)`), on a small
random float32 model with its MTP module.

Random models draft badly (acceptance near zero): rejection and rollback run on every iteration,
and greedy output must equal the engine's without drafts and `dsr1.generate`'s, whatever joins,
leaves or shares prefixes. The MTP module's paged latents are checked exactly against
`mtp_forward` over the whole sequence. An oracle drafter (the test replaces the drafting
function) exercises acceptance: several tokens per iteration, budgets and stop tokens in the
middle of accepted drafts. Nothing compiles after warm-up; the page allocator's invariants hold
after every test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.core.model import forward_hidden
from dsr1.core.mtp import mtp_forward
from dsr1.generation.sampling import Sampling
from dsr1.programs import speculative
from dsr1.serving import Engine

from .test_paged import counting_compilations
from .test_serving import checked_engines, run_arrivals

pytestmark = pytest.mark.slow  # its module fixtures start servers or engines: out of the quick tier

SHAPES = dict(max_seqs=4, page_size=4, num_pages=48, prefill_chunk=8, prefill_rows=2, decode_steps=2)
VOCAB = 256


@pytest.fixture(scope="module")
def cfg():
    return dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=VOCAB, num_hidden_layers=2,
                               num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def mtp_model(cfg):
    return dsr1.init_random(cfg, seed=3, dtype="float32", mtp=True)


@pytest.fixture
def make_engine(mtp_model):
    """Engines of the module's shapes, checked after the test (`checked_engines`)."""
    yield from checked_engines(mtp_model, SHAPES)


def workload(seed: int = 0) -> tuple[list[list[int]], list[int], list[int]]:
    """8 prompts of 3..21 tokens, five sharing a 10-token prefix (two of them a 13-token one), their
    budgets and arrival steps."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, VOCAB, 10).tolist()
    longer = prefix + rng.integers(2, VOCAB, 3).tolist()
    prompts = [prefix + rng.integers(2, VOCAB, 5).tolist(), rng.integers(2, VOCAB, 3).tolist(),
               longer + rng.integers(2, VOCAB, 6).tolist(), prefix + rng.integers(2, VOCAB, 2).tolist(),
               rng.integers(2, VOCAB, 21).tolist(), longer + rng.integers(2, VOCAB, 1).tolist(),
               prefix + rng.integers(2, VOCAB, 8).tolist(), rng.integers(2, VOCAB, 9).tolist()]
    budgets = [9, 4, 12, 1, 7, 10, 5, 11]
    arrivals = [0, 0, 3, 4, 4, 9, 12, 15]
    return prompts, budgets, arrivals


def serve(engine: Engine, prompts, budgets, arrivals, **options) -> list:
    return run_arrivals(engine, [(at, p, dict(max_new_tokens=b, **options))
                                 for at, p, b in zip(arrivals, prompts, budgets)])


@pytest.fixture(scope="module")
def plain_outputs(mtp_model):
    """The engine without drafts on the workload, checked against `dsr1.generate` alone."""
    prompts, budgets, arrivals = workload()
    engine = Engine(mtp_model, **SHAPES)
    requests = serve(engine, prompts, budgets, arrivals)
    engine.check()
    tokens = [r.tokens for r in requests]
    reference = dsr1.generate(mtp_model, prompts, sampling=[Sampling(max_new_tokens=b) for b in budgets])
    assert tokens == [c.tokens for c in reference.completions]
    return tokens


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_drafts_equals_without(make_engine, plain_outputs, k):
    prompts, budgets, arrivals = workload()
    engine = make_engine(draft_tokens=k)
    requests = serve(engine, prompts, budgets, arrivals)
    assert [r.tokens for r in requests] == plain_outputs
    stats = engine.stats()
    print(f"\n[drafts k={k}] {stats}")
    assert stats.prefix_hit_tokens > 0 and stats.finished == len(prompts)
    assert stats.drafted_tokens > 0 and 0.0 <= stats.draft_acceptance <= 1.0
    assert all(r.draft_acceptance is None or 0.0 <= r.draft_acceptance <= 1.0 for r in requests)


def test_mtp_latents_equal_the_module_over_the_whole_sequence(mtp_model, make_engine):
    """After prefill chunks (with a prefix hit) and draft iterations, each slot's MTP output at its last
    position equals `mtp_forward` over prompt + output: every latent the module read was right."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(2, VOCAB, 9).tolist()
    prompts = [prefix + rng.integers(2, VOCAB, 10).tolist(), prefix + rng.integers(2, VOCAB, 4).tolist(),
               rng.integers(2, VOCAB, 6).tolist()]
    engine = make_engine(draft_tokens=2)
    requests = serve(engine, prompts, [9, 8, 6], [0, 3, 3])
    assert engine.stats().prefix_hit_tokens >= 8
    state = engine._runner.state
    sequences = [prompt + request.tokens for prompt, request in zip(prompts, requests)]
    tokens = np.zeros((len(sequences), 32), np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = sequence
    lengths = jnp.asarray([len(s) for s in sequences])
    static = tuple(mtp_model.program_kwargs)
    _, hidden = jax.jit(forward_hidden, static_argnames=static)(mtp_model.params, jnp.asarray(tokens), lengths,
                                                                **mtp_model.program_kwargs)
    next_tokens = jnp.asarray(np.roll(tokens, -1, axis=1))
    _, mtp_hidden = jax.jit(mtp_forward, static_argnames=static)(mtp_model.params, hidden, next_tokens, lengths,
                                                                 **mtp_model.program_kwargs)
    for slot, (sequence, request) in enumerate(zip(sequences, requests)):
        if request.finish_reason != "length":  # the device ran past a stop token
            continue
        assert int(state.lengths[slot]) == len(sequence) - 1
        np.testing.assert_allclose(np.asarray(state.mtp_hidden[slot]), np.asarray(mtp_hidden[slot, len(sequence) - 2]),
                                   rtol=1e-4, atol=1e-4)


def test_needs_an_mtp_module(mtp_model):
    plain = dataclasses.replace(mtp_model, params={k: v for k, v in mtp_model.params.items() if k != "mtp"})
    with pytest.raises(ValueError, match="mtp=True"):
        Engine(plain, draft_tokens=1, **SHAPES)
    with pytest.raises(ValueError, match="draft_tokens"):
        Engine(mtp_model, draft_tokens=-1, **SHAPES)
    Engine(plain, **SHAPES)  # no drafts: no MTP module needed


def test_no_compilation_after_warm_up(make_engine):
    engine = make_engine(draft_tokens=2, host_cache_bytes=1 << 22)
    engine.warm_up()
    prompts, budgets, arrivals = workload(seed=5)
    with counting_compilations() as compiled:
        requests = serve(engine, prompts * 2, budgets * 2, arrivals + [a + 20 for a in arrivals])
    assert all(r.done for r in requests)
    assert compiled == [], f"compiled after warm-up: {compiled}"


def test_sampled_requests_complete_with_valid_tokens(make_engine):
    engine = make_engine(draft_tokens=2)
    settings = [Sampling(temperature=1.0, seed=7), Sampling(temperature=0.8, top_k=20, seed=8),
                Sampling(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=9)]
    requests = [engine.submit([5, 6, 7, 8, 9], sampling=s, max_new_tokens=10) for s in settings]
    engine.run()
    for request in requests:
        assert request.done and 1 <= len(request.tokens) <= 10
        assert all(0 <= t < VOCAB for t in request.tokens)
    # The same seed gives the same tokens in another engine.
    again = make_engine(draft_tokens=2)
    twin = again.submit([5, 6, 7, 8, 9], sampling=settings[0], max_new_tokens=10)
    again.run()
    assert twin.tokens == requests[0].tokens


def _oracle(monkeypatch, continuation: list[int]) -> None:
    """Make the drafter perfect for one prompt: drafts are the greedy `continuation` at the row's index
    (every row must serve that prompt). Programs are retraced (caches cleared)."""
    table = jnp.asarray(continuation + [0] * 16, jnp.int32)

    def oracle(q_logits, h, recurse, k, sampling, seen, counts, generated, *token_rules):
        drafts = [table[jnp.minimum(generated + j, table.shape[0] - 1)] for j in range(k)]
        return drafts, [jax.nn.one_hot(d, q_logits.shape[-1]) for d in drafts]

    jax.clear_caches()
    monkeypatch.setattr(speculative, "draft_tokens_recursively", oracle)


def test_perfect_drafter_budgets_and_stop_tokens_in_the_middle_of_drafts(mtp_model, make_engine, monkeypatch):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    full = dsr1.generate(mtp_model, [prompt], max_new_tokens=12).completions[0].tokens
    assert len(full) == 12 and 1 not in full
    stop = full[6]
    assert stop not in full[:6]
    _oracle(monkeypatch, full)
    try:
        engine = make_engine(draft_tokens=2)
        requests = [engine.submit(prompt, max_new_tokens=b) for b in (12, 5, 2)]
        requests.append(engine.submit(prompt, max_new_tokens=12, sampling=Sampling(stop_token_ids=(stop,))))
        engine.run()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert [r.tokens for r in requests] == [full, full[:5], full[:2], full[:6]]
    assert [r.finish_reason for r in requests] == ["length", "length", "length", "stop"]
    stats = engine.stats()
    assert stats.steps < 12 and stats.draft_acceptance > 0.8  # a stop may cut an iteration's drafts
    assert [r.draft_acceptance for r in requests[:3]] == [1.0] * 3
    assert requests[0].accepted_drafts == 8  # 3 + 3 + 3 + 3 tokens: 2 + 2 + 2 + 2 drafts
