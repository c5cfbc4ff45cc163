"""Sampling logits split over the vocabulary (`sampling.VocabSplit`): each shard's candidates are
combined, never the logits, and the tokens are those of whole logits: greedy, temperature, top-k,
top-p, min-p and penalties, log-probabilities and their top alternatives; and `dsr1.generate` on a
mesh whose tensor axis splits the lm_head gives one device's tokens. The compiled programs gather
no `[B, V]` array.

The multi-device comparison runs this file as a program in a subprocess (the device count must be
set before JAX starts): `python -m tests.test_vocab_split`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dsr1
from dsr1.core.sharding import layout_rules
from dsr1.generation.sampling import Sampling, batch_sampling
from dsr1.programs import sampling as S

VOCAB = 32768  # each of 4 shards holds 8,192: more than the CANDIDATES (4,096) each contributes
SETTINGS = [Sampling(), Sampling(temperature=0.8, seed=1), Sampling(temperature=1.0, top_k=5, seed=2),
            Sampling(temperature=1.0, top_p=0.9, seed=3), Sampling(temperature=0.7, top_k=40, top_p=0.8, seed=4),
            Sampling(temperature=1.0, min_p=0.1, seed=5), Sampling(repetition_penalty=1.3, seed=6),
            Sampling(temperature=0.9, top_k=1, presence_penalty=0.5, frequency_penalty=0.5, seed=7)]


def _compare_sampling(mesh: jax.sharding.Mesh) -> dict[str, float]:
    rng = np.random.default_rng(0)
    batch = len(SETTINGS)
    logits = jnp.asarray(rng.standard_normal((batch, VOCAB)).astype(np.float32) * 3)
    seen = jnp.asarray(rng.random((batch, VOCAB)) < 0.05)
    counts = jnp.asarray((rng.random((batch, VOCAB)) < 0.05).astype(np.int32))
    sampling = batch_sampling(SETTINGS)
    split = S.vocab_split(mesh, layout_rules("dp"), VOCAB)
    assert split is not None
    spread = jax.device_put(logits, NamedSharding(mesh, P("expert", "tensor")))

    @functools.partial(jax.jit, static_argnums=1)  # one program per split, the step an argument
    def run(x: jax.Array, split: S.VocabSplit | None, step: jax.Array) -> tuple[jax.Array, ...]:
        tokens = S.sample(x, sampling, seen, counts, step, split=split)
        return (tokens, *S.token_logprobs(x, tokens, jnp.ones(batch, bool), split))

    worst = 0.0
    for step in map(jnp.int32, range(16)):
        want = run(logits, None, step)
        got = run(spread, split, step)
        np.testing.assert_array_equal(got[0], want[0])  # the tokens
        np.testing.assert_array_equal(got[2], want[2])  # the top alternatives' ids
        worst = max(worst, float(jnp.max(jnp.abs(got[1] - want[1]))), float(jnp.max(jnp.abs(got[3] - want[3]))))
    values, ids = jax.jit(lambda x: S.top_k(x, 7, split))(spread)
    want_values, want_ids = jax.lax.top_k(logits, 7)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(values, want_values)
    ties = jnp.zeros((batch, VOCAB)).at[:, ::100].set(1.0)  # ties across shards: the lowest index first
    np.testing.assert_array_equal(jax.jit(lambda x: S.top_k(x, 5, split))(ties)[1], jax.lax.top_k(ties, 5)[1])
    np.testing.assert_array_equal(jax.jit(lambda x: S.split_argmax(x, split))(ties), jnp.zeros(batch, jnp.int32))
    hlo = run.lower(spread, split, jnp.int32(1)).compile().as_text()
    gathered = [int(n) for n in re.findall(r"= \w+\[\d+,(\d+)\][^ ]* all-gather\(", hlo)]
    assert gathered and max(gathered) <= 4 * S.CANDIDATES < VOCAB, gathered  # candidates, never the logits
    return {"logprob_diff": worst, "gathered": sorted(set(gathered))}


def _compare_generate(mesh: jax.sharding.Mesh) -> None:
    cfg = dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=1024)
    one = dsr1.init_random(cfg, seed=0, dtype="float32", mesh=dsr1.make_mesh(devices=jax.devices()[:1]))
    prompts = [[0, 17, 300, 42, 5], [0, 99], [0, 7, 8, 9, 10, 11, 12, 250, 251], [0, 400, 3]]
    settings = [Sampling(max_new_tokens=8), Sampling(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=8),
                Sampling(temperature=1.0, top_k=20, seed=4, max_new_tokens=8), Sampling(max_new_tokens=8)]
    want = dsr1.generate(one, prompts, sampling=settings)
    for rules in (layout_rules("tp"), layout_rules("dp")):
        model = dsr1.init_random(cfg, seed=0, dtype="float32", mesh=mesh, rules=rules)
        got = dsr1.generate(model, prompts, sampling=settings)
        assert [c.tokens for c in got.completions] == [c.tokens for c in want.completions], rules


def main() -> None:
    mesh = dsr1.make_mesh(expert=2, tensor=4)
    report = _compare_sampling(mesh)
    _compare_generate(mesh)
    print(report)


@pytest.mark.slow
def test_split_vocabulary_samples_the_tokens_of_whole_logits():
    from .harness import subprocess_env

    done = subprocess.run([sys.executable, "-m", "tests.test_vocab_split"], env=subprocess_env(8),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "logprob_diff" in done.stdout


if __name__ == "__main__":
    main()
