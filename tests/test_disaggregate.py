"""Prefill/decode disaggregation (`Engine(disaggregate=(p, d))`, `dsr1.serving.disaggregate`): on 8 fake
CPU devices, 32 staggered requests with shared prefixes get the same greedy tokens from an engine
prefilling on 4 devices and decoding on the other 4 as from the mixed engine on all 8, with prefix-cache
hits (pages borrowed by the prefill side) and with MTP drafts.

The 8-device comparison runs this file as a program in a subprocess (the device count must be set
before JAX starts): `python -m tests.test_disaggregate --draft-tokens 0`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import dsr1
from dsr1.serving import Engine
from dsr1.serving.disaggregate import check_split

# R1's structure at toy size with a small vocabulary (the sampler's work per step) and an MTP module.
CONFIG = dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=512, num_hidden_layers=2,
                             num_nextn_predict_layers=1)
SHAPES = dict(max_seqs=8, page_size=16, num_pages=256, prefill_chunk=32, prefill_rows=2, decode_steps=2)
REQUESTS, NEW_TOKENS = 32, 10


def test_split_is_checked():
    assert check_split((4, 4), 8) == (4, 4)
    assert check_split([1, 2], 8) == (1, 2)
    for bad, match in [((4, 5), "asks for 9 devices"), ((0, 4), "each >= 1"), ((4,), "each >= 1"),
                       ((True, 4), "each >= 1"), ((2.0, 4), "each >= 1")]:
        with pytest.raises(ValueError, match=match):
            check_split(bad, 8)


def test_engine_refuses_a_split_larger_than_its_mesh():
    model = dsr1.init_random(CONFIG, dtype="float32")
    with pytest.raises(ValueError, match="the model's mesh has 1"):
        Engine(model, disaggregate=(1, 1), **SHAPES)


def test_bench_serve_takes_a_split():
    from dsr1.bench.cli import parser

    assert parser().parse_args(["serve", "--disaggregate", "2:6"]).disaggregate == (2, 6)
    assert parser().parse_args(["serve"]).disaggregate is None
    for bad in ("4", "0:4", "a:b", "4:4:4"):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--disaggregate", bad])


def prompts(vocab_size: int) -> list[list[int]]:
    """Half the prompts begin with one of two shared 40-token prefixes (2.5 pages: whole pages hit)."""
    rng = np.random.default_rng(0)
    heads = [rng.integers(2, vocab_size, 40).tolist() for _ in range(2)]
    return [(heads[i % 4 // 2] if i % 2 else []) + rng.integers(2, vocab_size, int(rng.integers(3, 50))).tolist()
            for i in range(REQUESTS)]


def serve_staggered(engine: Engine, requests: list[list[int]]) -> tuple[list[list[int]], dsr1.serving.EngineStats]:
    """Four requests arrive every three steps; greedy tokens of each, and the engine's stats."""
    engine.warm_up()
    submitted = []
    for i, prompt in enumerate(requests):
        submitted.append(engine.submit(prompt, max_new_tokens=NEW_TOKENS, sampling=dsr1.Sampling(temperature=0.0)))
        if i % 4 == 3:
            for _ in range(3):
                engine.step()
    while engine.has_work:
        engine.step()
    engine.check()
    return [r.tokens for r in submitted], engine.stats()


def compare(draft_tokens: int) -> dict:
    import jax

    model = dsr1.init_random(CONFIG, dtype="float32", mtp=bool(draft_tokens))
    assert model.mesh.size == 8, jax.devices()
    requests = prompts(CONFIG.vocab_size)
    mixed, _ = serve_staggered(Engine(model, draft_tokens=draft_tokens, **SHAPES), requests)
    split, stats = serve_staggered(Engine(model, draft_tokens=draft_tokens, disaggregate=(4, 4), **SHAPES), requests)
    return {"mixed": mixed, "split": split, "prefix_hit_tokens": stats.prefix_hit_tokens,
            "drafted_tokens": stats.drafted_tokens}


def run_compare(draft_tokens: int) -> dict:
    from .harness import subprocess_env

    done = subprocess.run([sys.executable, "-m", "tests.test_disaggregate", f"--draft-tokens={draft_tokens}"],
                          env=subprocess_env(8), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("draft_tokens", [0, pytest.param(1, marks=pytest.mark.extended)])
def test_disaggregated_engine_gives_the_mixed_engines_tokens_on_eight_devices(draft_tokens):
    report = run_compare(draft_tokens)
    assert len(report["mixed"]) == REQUESTS and all(len(t) == NEW_TOKENS for t in report["mixed"])
    differ = [i for i, (a, b) in enumerate(zip(report["mixed"], report["split"])) if a != b]
    assert not differ, f"requests {differ} differ"
    assert report["prefix_hit_tokens"] >= 14 * 32  # 14 prompts read two shared pages: borrowed by the prefill side
    if draft_tokens:
        assert report["drafted_tokens"] > 0  # random weights: drafts are verified, rarely accepted


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft-tokens", type=int, default=0)
    print(json.dumps(compare(parser.parse_args().draft_tokens)))
