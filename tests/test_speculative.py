"""MTP speculative decoding in `dsr1.generate(..., draft_tokens=k)`.

Random tiny models draft badly (acceptance near zero), which exercises rejection and rollback on
every step; an oracle drafter (the test replaces the MTP module's logits) exercises acceptance.
Greedy output must equal greedy without drafts token for token; sampled output must follow the
model's distribution (`assert_follows`, as the sampling tests check it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1 import Sampling
from dsr1.generation.batch import generate
from dsr1.generation.sampling import batch_sampling
from dsr1.programs import speculative
from dsr1.programs.sampling import apply_filters

from .test_sampling import assert_follows

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
BUDGETS = [Sampling(max_new_tokens=14), Sampling(max_new_tokens=5), Sampling(max_new_tokens=11)]


@pytest.fixture(scope="module")
def cfg():
    return dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=256, num_hidden_layers=2,
                               num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def mtp_model(cfg):
    return dsr1.init_random(cfg, seed=3, dtype="float32", mtp=True)


@pytest.fixture(scope="module")
def baseline(mtp_model):
    return [c.tokens for c in generate(mtp_model, PROMPTS, sampling=BUDGETS).completions]


def _oracle(monkeypatch, sequences: np.ndarray) -> None:
    """Make the MTP module a perfect greedy drafter: at MTP position i its logits pick
    `sequences[b, i + 2]` (the greedy continuation). Programs are retraced (caches cleared)."""
    table = jnp.asarray(sequences)
    original = speculative.run_mtp

    def oracle(params, cache, hidden, next_tokens, last, **kw):
        logits, x, new_cache = original(params, cache, hidden, next_tokens, last, **kw)
        positions = jnp.clip(cache.lengths + last + 2, 0, table.shape[1] - 1)
        wanted = jnp.take_along_axis(table, positions[:, None], axis=1)[:, 0]
        return 50.0 * jax.nn.one_hot(wanted, logits.shape[-1]), x, new_cache

    jax.clear_caches()
    monkeypatch.setattr(speculative, "run_mtp", oracle)


@pytest.mark.parametrize("k", [1, 2])  # k = 3: the int8 and perfect-drafter tests
@pytest.mark.slow
def test_greedy_with_drafts_equals_greedy(mtp_model, baseline, k):
    result = generate(mtp_model, PROMPTS, sampling=BUDGETS, draft_tokens=k)
    assert [c.tokens for c in result.completions] == baseline
    assert [len(t) for t in baseline] == [14, 5, 11]
    assert 0.0 <= result.draft_acceptance <= 1.0
    assert result.decode_tokens == sum(len(t) for t in baseline) - len(PROMPTS)


@pytest.mark.slow
def test_int8_cache_and_stop_token(cfg, mtp_model, baseline):
    int8 = dataclasses.replace(mtp_model, kv_cache_dtype="int8")
    stop = baseline[0][6]
    sampling = [dataclasses.replace(s, stop_token_ids=(stop,)) for s in BUDGETS]
    want = [c.tokens for c in generate(int8, PROMPTS, sampling=sampling).completions]
    got = generate(int8, PROMPTS, sampling=sampling, draft_tokens=3, chunk_size=4)
    assert [c.tokens for c in got.completions] == want
    assert len(want[0]) <= 6 and stop not in want[0]  # the stop token ends row 0 (it is not output)
    assert got.completions[0].finish_reason == "stop"


@pytest.mark.slow
def test_perfect_drafter_accepts_everything(mtp_model, baseline, monkeypatch):
    width = 64
    sequences = np.zeros((len(PROMPTS), width), np.int32)
    for row, (prompt, out) in enumerate(zip(PROMPTS, baseline)):
        sequences[row, :len(prompt) + len(out)] = prompt + out
    _oracle(monkeypatch, sequences)
    try:
        result = generate(mtp_model, PROMPTS, sampling=BUDGETS, draft_tokens=3)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert [c.tokens for c in result.completions] == baseline
    assert result.draft_acceptance > 0.8  # all but the drafts cut off by a row's budget


def _verified(cfg, dtype: str, kv_cache_dtype: str | None = None,
              forms: tuple[str, ...] = ("verify", "verify_per_position", "verify_by_steps")):
    """Logits and hidden states of verifying 3 tokens per row after a prompt, by forms of
    `dsr1.core.model` (`verify`, `verify_per_position`, `verify_by_steps`), and their caches' lengths."""
    from dsr1.core import model as core

    model = dsr1.init_random(cfg, seed=5, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    _, cache = model.prefill(np.array([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]), np.array([5, 3]), max_len=16)
    fed = jnp.array([[20, 21, 22], [30, 31, 32]])
    out = {}
    for form in forms:
        logits, hidden, verified = jax.jit(getattr(core, form), static_argnames=("cfg", "mesh", "rules"))(
            model.params, cache, fed, **model.program_kwargs)
        out[form] = (np.asarray(logits), np.asarray(hidden), np.asarray(verified.lengths))
    return out


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
@pytest.mark.slow
def test_per_position_verification_is_decode_bit_for_bit_in_bf16(cfg, kv_cache_dtype):
    """The batch-invariant form runs each position in decode's shapes within one pass over the layers:
    its logits are those of decode steps (`verify_by_steps`) bit for bit; the one-pass form's equal
    them up to bf16 rounding."""
    out = _verified(cfg, "bfloat16", kv_cache_dtype)
    for got, want in zip(out["verify_per_position"], out["verify_by_steps"]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(out["verify"][0], out["verify_by_steps"][0], atol=0.1)
    np.testing.assert_array_equal(out["verify"][2], [8, 6])


@pytest.mark.slow
def test_one_pass_verification_equals_decode_in_float32(cfg):
    out = _verified(cfg, "float32", forms=("verify", "verify_by_steps"))
    np.testing.assert_allclose(out["verify"][0], out["verify_by_steps"][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["verify"][1], out["verify_by_steps"][1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_batch_invariant_greedy_with_drafts_equals_greedy(mtp_model, baseline):
    result = generate(mtp_model, PROMPTS, sampling=BUDGETS, draft_tokens=2, batch_invariant=True)
    assert [c.tokens for c in result.completions] == [c.tokens for c in generate(
        mtp_model, PROMPTS, sampling=BUDGETS, batch_invariant=True).completions]


def test_needs_mtp_params(mtp_model):
    plain = dataclasses.replace(mtp_model, params={k: v for k, v in mtp_model.params.items() if k != "mtp"})
    with pytest.raises(ValueError, match="mtp=True"):
        generate(plain, PROMPTS[:1], max_new_tokens=3, draft_tokens=1)
    with pytest.raises(ValueError, match="draft_tokens"):
        generate(plain, PROMPTS[:1], max_new_tokens=3, draft_tokens=-1)


def _filtered_probs(logits: np.ndarray, setting: Sampling) -> np.ndarray:
    arrays = batch_sampling([setting] * logits.shape[0])
    return np.asarray(jax.nn.softmax(apply_filters(jnp.asarray(logits), arrays), axis=-1), np.float64)


@pytest.mark.slow
def test_sampling_with_drafts_follows_the_model(mtp_model, monkeypatch):
    """Joint distribution of the first two tokens (the second is a verified one) with a drafter that
    is far from the model: half its mass on a token the model likes, half on one it never samples."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    setting = Sampling(temperature=1.0, top_k=6)
    first_logits = np.asarray(mtp_model.forward(np.array([prompt])))[0, -1:]
    p0 = _filtered_probs(first_logits, setting)[0]
    support = np.flatnonzero(p0)
    rows = np.array([prompt + [int(t)] for t in support])
    p1 = _filtered_probs(np.asarray(mtp_model.forward(rows))[:, -1], setting)
    joint = np.zeros((p0.size, p0.size))
    joint[support] = p0[support, None] * p1
    liked = int(np.argmax(p1[np.argmax(p0[support])]))
    never = int(np.flatnonzero(joint.sum(0) == 0)[0])
    crafted = np.zeros(p0.size, np.float32)
    crafted[[liked, never]] = 8.0

    original = speculative.run_mtp

    def drafter(params, cache, hidden, next_tokens, last, **kw):
        logits, x, new_cache = original(params, cache, hidden, next_tokens, last, **kw)
        return jnp.broadcast_to(jnp.asarray(crafted), logits.shape), x, new_cache

    jax.clear_caches()
    monkeypatch.setattr(speculative, "run_mtp", drafter)
    n = 3000
    try:
        result = generate(mtp_model, [prompt] * n, draft_tokens=1,
                          sampling=[dataclasses.replace(setting, seed=i, max_new_tokens=2) for i in range(n)])
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    pairs = np.array([c.tokens for c in result.completions])
    assert pairs.shape == (n, 2)
    counts = np.zeros(joint.size)
    np.add.at(counts, pairs[:, 0] * p0.size + pairs[:, 1], 1)
    assert_follows(counts, joint.reshape(-1), "first two tokens with drafts")
    assert 0.05 < result.draft_acceptance < 0.95  # both acceptance and correction were exercised


MESH_SCRIPT = """
import dataclasses, json, sys
import dsr1
from dsr1 import Sampling
from dsr1.generation.batch import generate
cfg = dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=256, num_hidden_layers=2, num_nextn_predict_layers=1)
model = dsr1.init_random(cfg, seed=3, dtype="float32", mtp=True, mesh=dsr1.make_mesh(expert=2, tensor=4),
                         kv_cache_dtype="int8")
prompts, budgets = json.loads(sys.argv[1])
sampling = [Sampling(max_new_tokens=b) for b in budgets]
plain = generate(model, prompts, sampling=sampling)
drafted = generate(model, prompts, sampling=sampling, draft_tokens=2)
print(json.dumps([[c.tokens for c in plain.completions], [c.tokens for c in drafted.completions],
                  drafted.draft_acceptance]))
"""


@pytest.mark.slow
def test_greedy_with_drafts_on_a_mesh():
    """8 fake devices (2-way expert x 4-way tensor parallel), int8 cache: drafts change nothing."""
    import json
    import subprocess
    import sys

    from .harness import subprocess_env

    args = json.dumps([PROMPTS, [s.max_new_tokens for s in BUDGETS]])
    run = subprocess.run([sys.executable, "-c", MESH_SCRIPT, args], env=subprocess_env(8), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    plain, drafted, acceptance = json.loads(run.stdout.strip().splitlines()[-1])
    assert drafted == plain and [len(t) for t in plain] == [14, 5, 11]
    assert 0.0 <= acceptance <= 1.0
