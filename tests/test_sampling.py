"""Sampling: validation, penalties and filters against numpy, the sampled distribution, seeds, stops, jit."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsr1.generation.sampling import Sampling, batch_sampling, find_stop_string
from dsr1.programs.sampling import (
    SamplingArrays,
    apply_filters,
    apply_penalties,
    init_counts,
    is_stop_token,
    sample,
    update_counts,
)

VOCAB = 50
N_DRAWS = 20_000


# ---------------------------------------------------------------- numpy references


def ref_penalties(logits, seen_prompt, counts, rep, presence, frequency):
    """HF repetition penalty on prompt|output tokens, then OpenAI presence/frequency on output, float64."""
    x = np.asarray(logits, np.float64).copy()
    seen = seen_prompt | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - frequency * counts - presence * (counts > 0)


def ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The exact filtered distribution, in probability space (HF warper order), float64.

    Asserts that no kept/removed decision is within float32 noise of its boundary, so that
    comparing with the float32 sampler is honest.
    """
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_k > 0:
        kth = np.sort(p)[::-1][top_k - 1]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        q = np.sort(p)[::-1]
        cum = np.cumsum(q)
        n = int(np.argmax(cum >= top_p)) + 1  # smallest prefix reaching top_p
        assert abs(cum[n - 1] - top_p) > 1e-4 and (n == 1 or abs(cum[n - 2] - top_p) > 1e-4)
        p = np.where(p >= q[n - 1], p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        threshold = min_p * p.max()
        assert np.all(np.abs(p[p > 0] - threshold) > 1e-4 * p.max())
        p = np.where(p >= threshold, p, 0.0)
        p /= p.sum()
    return p


def top_p_keeping(probs, n):
    """A top_p value that keeps exactly the n most likely tokens, halfway between boundaries."""
    cum = np.cumsum(np.sort(probs)[::-1])
    return float((cum[n - 2] + cum[n - 1]) / 2)


def min_p_keeping(probs, n):
    """A min_p value that keeps exactly the n most likely tokens (geometric midpoint of ratios)."""
    q = np.sort(probs)[::-1] / probs.max()
    return float(math.sqrt(q[n - 1] * q[n]))


def wilson_hilferty(df, z=5.0):
    """Upper chi-square quantile at about z sigma (z=5: p ~ 3e-7), without scipy."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(counts, probs, label):
    """Empirical counts match `probs`: exact support, per-token 5 sigma, pooled chi-square at ~5 sigma."""
    n = counts.sum()
    expected = n * probs
    outside = np.flatnonzero((probs == 0) & (counts > 0))
    assert outside.size == 0, f"{label}: tokens {outside} are outside the support but were drawn"
    missing = np.flatnonzero((expected >= 30) & (counts == 0))
    assert missing.size == 0, f"{label}: likely tokens {missing} never drawn"
    if (probs > 0).sum() == 1:  # deterministic (greedy) row: the support check above says it all
        return
    big = expected >= 5
    sigma = np.sqrt(expected[big] * (1 - probs[big]))
    worst = np.max(np.abs(counts[big] - expected[big]) / sigma)
    assert worst <= 5, f"{label}: a token is {worst:.1f} sigma off"
    small = (~big) & (probs > 0)
    observed = list(counts[big]) + ([counts[small].sum()] if small.any() else [])
    wanted = list(expected[big]) + ([expected[small].sum()] if small.any() else [])
    observed, wanted = np.array(observed, float), np.array(wanted, float)
    stat = float(np.sum((observed - wanted) ** 2 / wanted))
    df = max(len(wanted) - 1, 1)
    assert stat <= wilson_hilferty(df), f"{label}: chi2 {stat:.1f} on {df} df"


# ---------------------------------------------------------------- helpers


ROWS = 8  # every batch is padded to ROWS x VOCAB, so each jitted helper compiles only once
SHORT = 64  # draws per row for the seed tests
STOP_WIDTH = 4  # fixed stop_tokens width, so different stop ids do not change shapes

# Jitted: compiling costs ~1-2 s per shape on CPU, eager op-by-op dispatch costs more.
_sample = jax.jit(sample)
_filters = jax.jit(apply_filters)
_draws = jax.jit(jax.vmap(sample, in_axes=(None, None, None, None, 0)))


def padded(x, settings, seen=None, counts=None, pad=True):
    """Arguments for the sampler with the batch padded to ROWS (greedy rows of zeros) and the
    vocabulary to VOCAB (-inf logits, never seen): padding cannot change the real rows' tokens."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    x = np.tile(x, (len(settings), 1)) if x.shape[0] == 1 else x
    batch, vocab = x.shape
    seen = np.zeros((batch, vocab), bool) if seen is None else np.asarray(seen)
    counts = np.zeros((batch, vocab), np.int32) if counts is None else np.asarray(counts)
    rows, cols = (ROWS - batch, VOCAB - vocab) if pad else (0, 0)
    x = np.pad(np.pad(x, ((0, 0), (0, cols)), constant_values=-np.inf), ((0, rows), (0, 0)))
    seen, counts = (np.pad(a, ((0, rows), (0, cols))) for a in (seen, counts))
    params = batch_sampling(list(settings) + [Sampling()] * rows, stop_width=STOP_WIDTH)
    return jnp.asarray(x), params, jnp.asarray(seen), jnp.asarray(counts)


def draw_many(x, settings, seen=None, counts=None, n=SHORT, pad=True):
    """n draws per row (steps 0..n-1) in one jitted call: [n, B] numpy, padding removed."""
    tokens = _draws(*padded(x, settings, seen, counts, pad), jnp.arange(n))
    return np.asarray(tokens)[:, : len(settings)]


def sample_once(x, settings, seen=None, counts=None, step=0):
    """One jitted `sample` call on the padded batch: [B] numpy."""
    return np.asarray(_sample(*padded(x, settings, seen, counts), jnp.asarray(step)))[: len(settings)]


def filter_once(x, settings):
    """`apply_filters` on the padded batch: [B, V] numpy, padding removed."""
    x = np.atleast_2d(x)
    out = _filters(*padded(x, settings)[:2])
    return np.asarray(out)[: len(settings), : x.shape[-1]]


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=VOCAB).astype(np.float32) * 2


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1.0"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("min_p", -0.01),
        ("min_p", 1.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("max_new_tokens", 0),
        ("max_new_tokens", 3.0),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.5),
        ("stop_token_ids", (-3,)),
        ("stop_token_ids", ("a",)),
        ("stop_strings", ("",)),
        ("stop_strings", (5,)),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"Sampling.{field}") as err:
        Sampling(**{field: value})
    assert repr(value) in str(err.value) or field.startswith("stop")


def test_valid_settings_are_normalized():
    s = Sampling(temperature=1, top_k=np.int64(3), stop_token_ids=[5, 7], stop_strings="</s>", seed=2**63)
    assert s.stop_token_ids == (5, 7) and s.stop_strings == ("</s>",)
    assert Sampling(stop_token_ids=9).stop_token_ids == (9,)
    assert Sampling().greedy and not s.greedy
    hash(s)  # stays a usable frozen value
    with pytest.raises(ValueError, match="at least one"):
        batch_sampling([])
    with pytest.raises(ValueError, match="expected Sampling"):
        batch_sampling([{"temperature": 1.0}])


def test_batch_sampling_layout():
    params = batch_sampling([Sampling(stop_token_ids=(3, 4, 5), max_new_tokens=9), Sampling(top_k=2)])
    assert params.temperature.shape == (2,) and params.temperature.dtype == jnp.float32
    assert params.top_k.dtype == jnp.int32 and params.max_new_tokens.tolist() == [9, 256]
    np.testing.assert_array_equal(params.stop_tokens, [[3, 4, 5], [-1, -1, -1]])
    assert batch_sampling([Sampling()]).stop_tokens.shape == (1, 1)  # S >= 1 even with no stop ids
    fixed = batch_sampling([Sampling(stop_token_ids=(3,)), Sampling()], stop_width=4)
    np.testing.assert_array_equal(fixed.stop_tokens, [[3, -1, -1, -1], [-1] * 4])
    with pytest.raises(ValueError, match="stop_width=2"):
        batch_sampling([Sampling(stop_token_ids=(1, 2, 3))], stop_width=2)
    with pytest.raises(ValueError, match="stop_width must be"):
        batch_sampling([Sampling()], stop_width=0)
    assert jax.dtypes.issubdtype(params.keys.dtype, jax.dtypes.prng_key) and params.keys.shape == (2,)
    assert len(jax.tree_util.tree_leaves(params)) == 10


# ---------------------------------------------------------------- greedy and penalties


def test_greedy_is_argmax_whatever_the_filters_and_seed():
    x = np.random.default_rng(1).normal(size=(4, VOCAB)).astype(np.float32)
    settings = [Sampling(), Sampling(top_k=3, top_p=0.2, seed=5), Sampling(min_p=0.9, seed=6), Sampling(seed=7)]
    for step in (0, 11):
        np.testing.assert_array_equal(sample_once(x, settings, step=step), x.argmax(-1))


def penalty_case():
    """Logits of both signs, per-row prompts (right-padded) and outputs, per-row penalties."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(3, 40)) * 3).astype(np.float32)
    prompts = rng.integers(0, 40, size=(3, 6))
    lengths = np.array([6, 2, 0])
    outputs = rng.integers(0, 40, size=(5, 3))  # five generated steps
    settings = [
        Sampling(repetition_penalty=1.7),
        Sampling(repetition_penalty=0.8, presence_penalty=0.6, frequency_penalty=0.4),
        Sampling(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.2),
    ]
    return x, prompts, lengths, outputs, settings


def test_penalties_match_numpy():
    x, prompts, lengths, outputs, settings = penalty_case()
    seen, counts = init_counts(prompts, lengths, 40)
    for step in outputs:
        counts = update_counts(counts, jnp.asarray(step, jnp.int32))
    ref_seen = np.zeros((3, 40), bool)
    ref_counts = np.zeros((3, 40), np.int64)
    for b in range(3):
        ref_seen[b, prompts[b, : lengths[b]]] = True
        np.add.at(ref_counts[b], outputs[:, b], 1)
    np.testing.assert_array_equal(seen, ref_seen)
    np.testing.assert_array_equal(counts, ref_counts)
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(x), batch_sampling(settings), seen, counts))
    for b, s in enumerate(settings):
        want = ref_penalties(
            x[b], ref_seen[b], ref_counts[b], s.repetition_penalty, s.presence_penalty, s.frequency_penalty
        )
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(got, x)  # the case exercises the penalties at all


@pytest.mark.slow
def test_greedy_with_repetition_penalty_matches_numpy():
    # Token 3 leads, but was in the prompt; token 8 (negative) was generated and sinks further.
    x = np.full((2, 10), -1.0, np.float32)
    x[:, 3], x[:, 5], x[:, 8] = 2.0, 1.5, -0.2
    x[1, 8] = 1.9
    seen, counts = init_counts(np.array([[3, 0], [3, 3]]), np.array([1, 2]), 10)
    counts = update_counts(counts, jnp.array([8, 8]))
    tokens = sample_once(x, [Sampling(repetition_penalty=1.5)] * 2, seen, counts)
    want = [ref_penalties(x[b], np.asarray(seen[b]), np.asarray(counts[b]), 1.5, 0, 0).argmax() for b in range(2)]
    np.testing.assert_array_equal(tokens, want)
    assert list(tokens) == [5, 5] and list(x.argmax(-1)) == [3, 3]


def test_init_counts_ignores_padding_and_accepts_numpy_and_jax():
    tokens = np.array([[4, 4, 9, 1], [2, 7, 7, 7]])
    seen_np, counts = init_counts(tokens, np.array([3, 1]), 12)
    seen_jax, _ = init_counts(jnp.asarray(tokens), jnp.array([3, 1]), 12)
    assert sorted(np.flatnonzero(seen_np[0])) == [4, 9] and sorted(np.flatnonzero(seen_np[1])) == [2]
    np.testing.assert_array_equal(seen_np, seen_jax)
    assert counts.dtype == jnp.int32 and not counts.any() and counts.shape == (2, 12)
    full, _ = init_counts(tokens, None, 12)
    assert sorted(np.flatnonzero(full[1])) == [2, 7]
    # update_counts leaves rows that have stopped unchanged.
    counts = update_counts(counts, jnp.array([5, 6]), active=jnp.array([True, False]))
    assert counts[0, 5] == 1 and not counts[1].any()


# ---------------------------------------------------------------- filters: exact distribution


def filter_rows(x):
    """Settings that each exercise one filter (or all), with boundaries chosen away from float noise."""
    t1 = ref_probs(x, 1.0)
    t06 = ref_probs(x, 0.6)
    t08_k12 = ref_probs(x, 0.8, top_k=12)
    top_p = top_p_keeping(t08_k12, 8)
    after_p = ref_probs(x, 0.8, top_k=12, top_p=top_p)
    return [
        Sampling(temperature=1.3, seed=1),
        Sampling(temperature=1.0, top_k=7, seed=2),
        Sampling(temperature=0.6, top_p=top_p_keeping(t06, 5), seed=3),
        Sampling(temperature=1.5, min_p=min_p_keeping(ref_probs(x, 1.5), 9), seed=4),
        Sampling(temperature=0.8, top_k=12, top_p=top_p, min_p=min_p_keeping(after_p, 6), seed=5),
        Sampling(temperature=0.0, top_k=7, top_p=0.5, seed=6),
        Sampling(temperature=1.0, top_p=top_p_keeping(t1, 3), seed=7),
        Sampling(temperature=1.5, top_k=4, top_p=top_p_keeping(ref_probs(x, 1.5, top_k=4), 3), seed=8),
    ]


def expected_probs(x, settings):
    rows = []
    for s in settings:
        if s.greedy:
            rows.append(np.eye(len(x))[x.argmax()])
        else:
            rows.append(ref_probs(x, s.temperature, s.top_k, s.top_p, s.min_p))
    return np.stack(rows)


def test_filtered_distribution_is_exact(logits):
    settings = filter_rows(logits)
    want = expected_probs(logits, settings)
    assert [int((w > 0).sum()) for w in want] == [VOCAB, 7, 5, 9, 6, 1, 3, 3]
    # The cases tell apart the orders that matter: top-p acts on temperature-scaled
    # probabilities (at T=1 the same top_p keeps more tokens) renormalized after top-k
    # (without renormalizing, the top 3 of row 7 would not reach its top_p).
    assert (ref_probs(logits, 1.0, top_p=settings[2].top_p) > 0).sum() > 5
    assert np.sort(ref_probs(logits, 1.5))[::-1][:3].sum() < settings[7].top_p
    got = np.asarray(jax.nn.softmax(filter_once(logits, settings), axis=-1))
    sampled_rows = [b for b, s in enumerate(settings) if not s.greedy]
    np.testing.assert_allclose(got[sampled_rows], want[sampled_rows], atol=2e-6)
    np.testing.assert_array_equal(got[sampled_rows] > 0, want[sampled_rows] > 0)


@pytest.mark.slow
def test_each_row_samples_its_own_distribution(logits):
    settings = filter_rows(logits)
    want = expected_probs(logits, settings)
    tokens = draw_many(logits, settings, n=N_DRAWS)
    assert tokens.shape == (N_DRAWS, len(settings))
    for b, s in enumerate(settings):
        assert_follows(np.bincount(tokens[:, b], minlength=VOCAB), want[b], f"row {b} {s}")


@pytest.mark.slow
def test_sampling_after_penalties_follows_the_penalized_distribution(logits):
    seen, counts = init_counts(np.array([[int(logits.argmax()), 3, 4]]), None, VOCAB)
    counts = update_counts(update_counts(counts, jnp.array([7])), jnp.array([7]))
    s = Sampling(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.7, seed=3)
    tokens = draw_many(logits, [s], seen, counts, n=N_DRAWS)[:, 0]
    penalized = ref_penalties(logits, np.asarray(seen[0]), np.asarray(counts[0]), 1.4, 0.5, 0.7)
    assert_follows(np.bincount(tokens, minlength=VOCAB), ref_probs(penalized, 0.9), "penalized")


def test_the_statistical_check_detects_a_wrong_distribution(logits):
    # Sanity of the checker itself: samples at T=1.3 must fail against T=1.0 and against top-k.
    tokens = draw_many(logits, [Sampling(temperature=1.3, seed=1)], n=N_DRAWS)
    observed = np.bincount(tokens[:, 0], minlength=VOCAB)
    for wrong in (ref_probs(logits, 1.0), ref_probs(logits, 1.3, top_k=20)):
        with pytest.raises(AssertionError):
            assert_follows(observed, wrong, "wrong")


def test_top_k_keeps_ties_at_the_boundary():
    x = np.array([3.0, 1.0, 2.0, 2.0, 0.0, 2.0])
    kept = np.isfinite(filter_once(x, [Sampling(temperature=1.0, top_k=2)]))[0]
    assert list(np.flatnonzero(kept)) == [0, 2, 3, 5]


def test_one_surviving_token_and_tiny_temperature_give_no_nan():
    x = np.full((3, 20), -np.inf, np.float32)
    x[:, 4] = 1.0
    x[2] = np.random.default_rng(3).normal(size=20) * 1e4  # huge logits, tiny temperature
    settings = [
        Sampling(temperature=1.0, top_k=5, top_p=0.3, min_p=0.5, seed=1),
        Sampling(temperature=0.7, seed=2),
        Sampling(temperature=1e-6, top_p=0.9, seed=3),
    ]
    assert not np.isnan(filter_once(x, settings)).any()
    tokens = draw_many(x, settings)
    assert (tokens[:, :2] == 4).all() and (tokens[:, 2] == x[2].argmax()).all()


def test_bfloat16_logits_are_accepted(logits):
    x, params, seen, counts = padded(logits, [Sampling(temperature=1.0, top_k=3, seed=0), Sampling()])
    x = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))  # what the sampler sees
    tokens = jax.jit(sample)(jnp.asarray(x, jnp.bfloat16), params, seen, counts, jnp.int32(0))
    assert tokens.dtype == jnp.int32 and int(tokens[1]) == x[1].argmax()
    assert x[0, int(tokens[0])] >= np.sort(x[0])[-3]  # within the top 3


# ---------------------------------------------------------------- seeds


def seeded_draws(rows, settings, pad=True):
    """SHORT draws for rows of logits with the given settings, as [B, SHORT]."""
    return draw_many(np.stack(rows), settings, pad=pad).T


def test_same_seed_same_tokens_and_rows_are_independent(logits):
    other = np.random.default_rng(4).normal(size=VOCAB).astype(np.float32)
    mine = Sampling(temperature=1.0, seed=7)
    alone = seeded_draws([logits], [mine], pad=False)[0]  # a batch of one, unpadded
    again = seeded_draws([logits], [mine])[0]
    np.testing.assert_array_equal(alone, again)
    # No filters in batch one, top-k/top-p in batch two (so the sorting branch runs there):
    # the row's tokens do not depend on the batch size, the other rows, their settings, or its position.
    one = seeded_draws([logits, other, other], [mine, Sampling(temperature=0.5, seed=1), Sampling()])[0]
    two = seeded_draws(
        [other, other, logits, other],
        [Sampling(temperature=1, top_k=3, seed=3), Sampling(temperature=1, top_p=0.5), mine, Sampling(seed=7)],
    )[2]
    np.testing.assert_array_equal(alone, one)
    np.testing.assert_array_equal(alone, two)
    assert len(set(alone.tolist())) > 5  # genuinely random tokens, not a constant


def test_different_seeds_differ(logits):
    a, b = seeded_draws([logits, logits], [Sampling(temperature=1.0, seed=7), Sampling(temperature=1.0, seed=8)])
    assert (a != b).mean() > 0.5
    far = seeded_draws([logits], [Sampling(temperature=1.0, seed=7 + 2**32)])[0]
    assert (a != far).mean() > 0.5  # seeds are not truncated to 32 bits


def test_seed_keys_and_random_seeds():
    params = batch_sampling([Sampling(seed=123), Sampling(seed=None), Sampling(seed=None)])
    data = np.asarray(jax.random.key_data(params.keys))
    np.testing.assert_array_equal(data[0], jax.random.key_data(jax.random.key(123)))
    again = np.asarray(jax.random.key_data(batch_sampling([Sampling(seed=None)]).keys))
    assert not np.array_equal(data[1], data[2]) and not np.array_equal(data[1], again[0])


def test_per_row_steps(logits):
    # A [B] step vector (rows at different positions) equals per-row scalar steps.
    settings = [Sampling(temperature=1.0, seed=1), Sampling(temperature=1.0, seed=2)]
    both = sample_once(logits, settings, step=np.array([3, 9] + [0] * (ROWS - 2)))
    draws = draw_many(logits, settings)
    assert int(both[0]) == draws[3, 0] and int(both[1]) == draws[9, 1]


# ---------------------------------------------------------------- stops


def test_is_stop_token():
    params = batch_sampling([Sampling(stop_token_ids=(1, 5)), Sampling(), Sampling(stop_token_ids=(0,))])
    assert is_stop_token(jnp.array([5, 1, 0]), params).tolist() == [True, False, True]
    assert is_stop_token(jnp.array([2, 0, 1]), params).tolist() == [False, False, False]


@pytest.mark.parametrize(
    "text, stops, start, want",
    [
        ("hello world", ["wor"], 0, 6),
        ("hello world", ["xyz"], 0, None),
        ("hello world", [], 0, None),
        ("abc STOP def", ["STOP"], 6, 4),  # began before start, ends after it
        ("abc STOP def", ["STOP"], 8, None),  # wholly in text already searched
        ("abc STOP def", ["STOP"], 7, 4),
        ("one two three", ["three", "o t", "two"], 0, 4),  # earliest wins, not list order
        ("aaa<|end|>b", ["<|end|>", "end"], 5, 3),
        ("xyz", ["xyz"], 2, 0),
        ("xyz", ["xyz"], 3, None),
    ],
)
def test_find_stop_string(text, stops, start, want):
    assert find_stop_string(text, stops, start) == want
    if want is not None:
        assert not any(s in text[:want] for s in stops)  # the cut output holds no stop string


# ---------------------------------------------------------------- jit


def test_jitted_sampler_does_not_recompile_for_new_values(logits):
    traces = []

    def step_fn(x, params, seen, counts, step):
        traces.append(1)
        return sample(x, params, seen, counts, step)

    jitted = jax.jit(step_fn)
    batches = [
        [Sampling(), Sampling(temperature=1.0, seed=1)],
        [Sampling(temperature=0.7, top_k=4, top_p=0.9, min_p=0.1, repetition_penalty=1.2, seed=9), Sampling()],
        [Sampling(presence_penalty=1.0, stop_token_ids=(1, 2)), Sampling(frequency_penalty=-1.0, seed=None)],
    ]
    for settings in batches:
        x, params, seen, counts = padded(logits, settings)
        assert isinstance(params, SamplingArrays)
        for step in range(3):
            jitted(x, params, seen, counts, jnp.int32(step)).block_until_ready()
    assert len(traces) == 1
    if hasattr(jitted, "_cache_size"):
        assert jitted._cache_size() == 1


@pytest.mark.slow
def test_restrict_applies_bias_allowed_tokens_bad_words_and_min_tokens():
    from dsr1.generation.sampling import host_token_rules
    from dsr1.programs.sampling import restrict, token_rules

    vocab = 12
    settings = [Sampling(logit_bias={3: 2.0, 4: -500}, allowed_token_ids=(3, 4, 5, 6), min_tokens=2,
                         stop_token_ids=(5,)),
                Sampling(bad_words_ids=[[7], [1, 2, 8]]),
                Sampling()]
    rules = token_rules(jax.tree.map(jnp.asarray, host_token_rules(settings)), vocab)
    logits = jnp.zeros((3, vocab))
    recent = jnp.full((3, 7), -1, jnp.int32).at[1, -2:].set(jnp.array([1, 2]))
    early = np.asarray(restrict(logits, rules, jnp.array([1, 0, 0]), recent))
    late = np.asarray(restrict(logits, rules, jnp.array([2, 0, 0]), recent.at[1, -1].set(3)))
    assert early[0, 3] == 2.0 and early[0, 4] == -100.0 and early[0, 6] == 0.0  # clipped to -100
    assert np.isneginf(early[0, [0, 1, 2, 7]]).all() and np.isneginf(early[0, 5]) and late[0, 5] == 0.0
    assert np.isneginf(early[1, [7, 8]]).all() and late[1, 8] == 0.0 and np.isneginf(late[1, 7])
    assert (early[2] == 0).all()


def test_grammar_bitmask_bits_are_llguidances():
    from dsr1.programs.sampling import apply_masks

    rng = np.random.default_rng(0)
    vocab = 70
    masks = rng.integers(-2**31, 2**31, (2, 3), dtype=np.int64).astype(np.int32)
    out = np.asarray(apply_masks(jnp.zeros((3, vocab)), jnp.asarray(masks), jnp.array([1, -1, 0])))
    bits = np.unpackbits(masks.view(np.uint8), bitorder="little").reshape(2, -1)[:, :vocab].astype(bool)
    assert (np.isneginf(out[0]) == ~bits[1]).all() and (out[1] == 0).all() and (np.isneginf(out[2]) == ~bits[0]).all()
