"""The serving engine on a tiny random DeepSeek-V3.2 model (sparse attention, index_topk 8), float32:
its greedy tokens equal `dsr1.generate`'s (the contiguous cache) for 16 staggered requests sharing
prefixes longer than index_topk, while cached pages (latents and indexer keys) are offloaded to host
memory and reloaded; on one device, and on 8 fake devices in layouts tp and dp (a subprocess: the
device count must be set before JAX starts; this file is its program). Both compile every serving
shape for a new model: the extended tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import types

import numpy as np
import pytest

import dsr1

CONFIG = dataclasses.replace(dsr1.Config.preset("tiny-v3.2"), vocab_size=512)
REQUESTS, BUDGET = 16, 8
ONE_DEVICE = dict(max_seqs=4, page_size=4, num_pages=40, prefill_chunk=8, prefill_rows=2)  # requests wait for pages
HOST_CACHE = 1 << 24


def workload() -> list[tuple[int, list[int], dict]]:
    """(arrival step, prompt, options): 16 prompts of 17..32 tokens, most extending one of four prefixes
    of 13 to 20 tokens (past index_topk), arriving over 20 steps, each with its own budget."""
    from .test_serving import shared_prefix_workload

    rng = np.random.default_rng(0)
    prompts = shared_prefix_workload(rng, REQUESTS, CONFIG.vocab_size)
    budgets = rng.integers(2, BUDGET + 1, REQUESTS).tolist()
    steps = np.sort(rng.integers(0, 20, REQUESTS)).tolist()
    return [(at, p, dict(max_new_tokens=b)) for at, p, b in zip(steps, prompts, budgets)]


def serve(model: dsr1.Model, shapes: dict) -> dict:
    """The workload through an engine of `shapes`: each request's tokens and the prefix cache's counts."""
    from dsr1.serving import Engine

    from .test_serving import run_arrivals

    engine = Engine(model, **shapes, host_cache_bytes=HOST_CACHE)
    requests = run_arrivals(engine, workload())
    engine.check()
    stats = engine.stats()
    return {"tokens": [r.tokens for r in requests], "prefix_hit_tokens": stats.prefix_hit_tokens,
            "offloaded": stats.offloaded_pages, "reloaded": stats.reloaded_pages}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """`generate`'s greedy tokens for each request on one device, cut to its budget."""
    model = dsr1.init_random(CONFIG, seed=0, dtype="float32")
    arrivals = workload()
    out = dsr1.generate(model, [p for _, p, _ in arrivals], max_new_tokens=BUDGET).completions
    return [c.tokens[:o["max_new_tokens"]] for c, (_, _, o) in zip(out, arrivals)]


def _check(run: dict, reference: list[list[int]], name: str) -> None:
    for i, (got, want) in enumerate(zip(run["tokens"], reference)):
        assert got == want, f"{name}: request {i} differs from generate"
    assert run["prefix_hit_tokens"] > 0 and run["offloaded"] > 0 and run["reloaded"] > 0, (name, run)


@pytest.mark.extended
def test_greedy_equals_generate_with_shared_prefixes_and_offload_on_one_device(reference):
    model = dsr1.init_random(CONFIG, seed=0, dtype="float32")
    _check(serve(model, ONE_DEVICE), reference, "one device")


def test_engine_refuses_drafts_and_a_positions_split_for_sparse_attention():
    """The engine serves no MTP drafts for V3.2 (its draft pool holds no indexer keys), nor splits a row's
    pages over devices (the top-k needs all its keys on one): `Engine` says so before building anything."""
    from dsr1.core.sharding import DEFAULT_RULES, layout_rules
    from dsr1.serving.engine import check_sparse_serving

    one = types.SimpleNamespace(cfg=CONFIG, mesh=None, rules=DEFAULT_RULES)
    with pytest.raises(ValueError, match="no MTP drafts for a sparse-attention"):
        check_sparse_serving(one, draft_tokens=1)
    check_sparse_serving(one, draft_tokens=0)
    check_sparse_serving(types.SimpleNamespace(**{**vars(one), "cfg": dsr1.Config.preset("tiny")}), draft_tokens=1)
    split = types.SimpleNamespace(cfg=CONFIG, mesh=types.SimpleNamespace(shape={"expert": 2, "tensor": 2}),
                                  rules=layout_rules("dp"))
    with pytest.raises(ValueError, match="cannot split a row's pages over mesh axis 'tensor'"):
        check_sparse_serving(split, draft_tokens=0)


@pytest.mark.extended
def test_greedy_equals_generate_on_eight_devices_in_layouts_tp_and_dp(reference):
    from .harness import subprocess_env

    done = subprocess.run([sys.executable, "-m", "tests.test_serving_sparse"], env=subprocess_env(8),
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for layout in ("tp", "dp"):
        _check(report[layout], reference, layout)


def main() -> None:
    """(Subprocess, 8 devices) the workload on layout tp (expert 4 x tensor 2: heads split, the pool whole
    on every device) and layout dp over 2 ranks (expert 2 x tensor 4: each rank its own rows, slots and
    share of the pool, the heads split within it; a row's pages are not split over positions, which
    sparse attention refuses), both with one device's slots and pages; prints one JSON line of both."""
    argparse.ArgumentParser().parse_args()
    from dsr1.core.sharding import layout_rules, rules_layout

    tp = dsr1.init_random(CONFIG, seed=0, dtype="float32", mesh=dsr1.make_mesh(expert=4, tensor=2))
    rows_only = dataclasses.replace(layout_rules("dp"), positions=None)
    assert rules_layout(rows_only) == "dp"
    dp = dsr1.init_random(CONFIG, seed=0, dtype="float32", mesh=dsr1.make_mesh(expert=2, tensor=4), rules=rows_only)
    print(json.dumps({"tp": serve(tp, ONE_DEVICE), "dp": serve(dp, ONE_DEVICE)}))


if __name__ == "__main__":
    main()
