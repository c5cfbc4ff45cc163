"""Expert parallelism by all-to-all (`ShardingRules(moe_dispatch="all_to_all")`): the rows split over
the expert axis, each token-expert pair sent to its expert's device and back, gives the same MoE
outputs and the same greedy tokens as summing partial outputs over the mesh ("psum") and as one
device, in float32. And attention data parallelism (`layout_rules("dp")`: the rows, the decode cache
and the page pool split over the expert axis, with the all-to-all) gives the same tokens and the
same paged-extend logits as one device, each rank holding only its share; so does the serving
engine on that layout (each rank its slots, pages and prefix cache; staggered requests, shared
prefixes, pages offloaded to host memory and reloaded); redundant experts (`dsr1.core.eplb`)
change no token.

The multi-device comparison runs this file as a program in a subprocess (the device count must be
set before JAX starts): `python -m tests.test_expert_all_to_all --expert 4 --tensor 2`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dsr1
from dsr1 import programs
from dsr1.core import eplb
from dsr1.core import moe as moe_module
from dsr1.core.moe import moe
from dsr1.core.sharding import ShardingRules, layout_rules
from dsr1.options import rules_from_options

# R1's routing at toy width: 64 experts in 8 groups, 4 groups kept, top-8; two dense layers, then MoE.
CONFIG = dataclasses.replace(
    dsr1.Config.preset("tiny"), vocab_size=512, n_routed_experts=64, num_experts_per_tok=8, n_group=8,
    topk_group=4, first_k_dense_replace=2, num_hidden_layers=4)
ALL_TO_ALL = ShardingRules(moe_dispatch="all_to_all")
DP = layout_rules("dp")
PROMPTS = [[0, 17, 300, 42, 5], [0, 99], [0, 7, 8, 9, 10, 11, 12, 250, 251], [0, 400, 3]]


def test_dispatch_is_checked():
    with pytest.raises(ValueError, match="moe_dispatch='scatter'"):
        ShardingRules(moe_dispatch="scatter")
    assert ShardingRules().moe_token_axis() is None
    assert ALL_TO_ALL.moe_token_axis() == ALL_TO_ALL.experts


def test_layouts_name_their_rules():
    assert layout_rules("tp") == ShardingRules()
    assert (DP.batch, DP.moe_dispatch) == (DP.experts, "all_to_all")
    with pytest.raises(ValueError, match="layout='ep'"):
        layout_rules("ep")
    args = argparse.Namespace(layout="dp", moe_dispatch=None)
    assert rules_from_options(args) == DP
    assert rules_from_options(argparse.Namespace(layout="tp", moe_dispatch="all_to_all")) == ALL_TO_ALL


@pytest.mark.slow
def test_all_to_all_on_one_device_matches_psum():
    """One device: the exchange is with itself (and the CPU's dense all-to-all is a copy)."""
    outputs = moe_outputs(dsr1.make_mesh(expert=1, tensor=1))
    np.testing.assert_allclose(outputs["all_to_all"], outputs["psum"], rtol=1e-5, atol=1e-5)


def moe_outputs(mesh, tokens: tuple[int, ...] = (1, 3, 8, 64)) -> dict[str, np.ndarray]:
    """The first MoE layer's output on random rows, per dispatch, `tokens` rows at a time (counts that
    do and do not divide the expert axis), concatenated."""
    model = dsr1.init_random(CONFIG, seed=11, dtype="float32", mesh=mesh)
    p = jax.tree.map(lambda a: a[0], model.params["moe_layers"]["moe"])
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n, CONFIG.hidden_size)).astype(np.float32) for n in tokens]
    outputs = {}
    for rules in (ShardingRules(), ALL_TO_ALL):
        run = jax.jit(lambda p, x, rules=rules: moe(p, x, CONFIG, mesh, rules)[0])
        outputs[rules.moe_dispatch] = np.concatenate([np.asarray(run(p, x)) for x in xs])
    return outputs


def greedy_tokens(mesh, rules: ShardingRules, new_tokens: int = 12, redundant: int = 0) -> list[list[int]]:
    """Greedy tokens of `PROMPTS`; with `redundant` expert slots per layer placed (`dsr1.core.eplb`)
    from a skewed load, each hot expert's pairs spread over its copies."""
    model = dataclasses.replace(dsr1.init_random(CONFIG, seed=11, dtype="float32", mesh=mesh), rules=rules)
    if redundant:
        load = np.random.default_rng(0).pareto(1.0, (CONFIG.num_moe_layers, CONFIG.n_routed_experts)) + 1
        model = model.with_expert_placement(eplb.balance(load, mesh.shape[rules.experts], redundant))
    result = dsr1.generate(model, PROMPTS, max_new_tokens=new_tokens)
    return [c.tokens for c in result.completions]


def ragged_exchange_errors(mesh, rules: ShardingRules, rows: int = 6) -> list[str]:
    """XLA:CPU has no `ragged_all_to_all`: the offsets and sizes each device computes for it
    (`_exchange`) are checked here by doing its exchange in numpy, there (each sorted pair to its
    expert's device, with `_received_experts` naming each received row's expert) and back (each
    result to its pair's own slot). Returns what disagrees."""
    axis = rules.experts
    n, n_local = mesh.shape[axis], CONFIG.n_routed_experts // mesh.shape[axis]
    rng = np.random.default_rng(n)
    experts = np.stack([rng.choice(CONFIG.n_routed_experts, CONFIG.num_experts_per_tok, replace=False)
                        for _ in range(n * rows)]).astype(np.int32)
    experts[rows - 1::rows] = -1  # a padding row on every device

    def body(e):
        flat = e.reshape(-1)
        pairs = flat[jnp.argsort(jnp.where(flat >= 0, flat, CONFIG.n_routed_experts))]
        plan = moe_module._exchange(flat, n, n_local, axis)
        received = moe_module._received_experts(plan, flat.size, jax.lax.axis_index(axis) * n_local, True)
        return jax.tree.map(lambda a: a[None], (plan, pairs, received))

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    plan, pairs, received = jax.tree.map(np.asarray, run(experts))
    p, errors = pairs.shape[1], []
    buffers = np.full((n, n * p), -1, np.int32)
    for i in range(n):
        for j in range(n):
            size, src, dst = plan.send_sizes[i, j], plan.send_offsets[i, j], plan.remote_offsets[i, j]
            if (plan.recv_sizes[j, i], plan.recv_offsets[j, i]) != (size, dst):
                errors.append(f"device {j} expects {plan.recv_sizes[j, i]} pairs at {plan.recv_offsets[j, i]} from "
                              f"{i}, which sends {size} to {dst}")
            buffers[j, dst:dst + size] = pairs[i, src:src + size]
    errors += [f"device {j} names its received rows' experts wrongly" for j in range(n)
               if not np.array_equal(buffers[j], received[j])]
    for i in range(n):
        back = np.full(p, -1, np.int32)
        for j in range(n):
            size, src, dst = plan.recv_sizes[j, i], plan.recv_offsets[j, i], plan.home_offsets[j, i]
            back[dst:dst + size] = buffers[j, src:src + size]
        if not np.array_equal(back, np.where(pairs[i] >= 0, pairs[i], -1)):
            errors.append(f"device {i}'s results come back to the wrong pairs")
    return errors


def paged_extend_logits(mesh, rules: ShardingRules, rows: int = 8, page_size: int = 4,
                        pages_per_row: int = 6) -> tuple[list[np.ndarray], list[int], int]:
    """A prompt chunk then three decode tokens per row through `programs.extend` on a page pool split
    as `rules` split it: rank r holds rows r*R/ranks.., and with a positions split a row's page j lives
    on device j mod T of that axis; page ids are local to their device, shuffled. Returns each call's
    logits, the pages each device holds, and the pages one device should."""
    ranks = mesh.shape[rules.batch] if rules.batch else 1
    split = mesh.shape[rules.positions] if rules.positions else 1
    per_device = rows // ranks * -(-pages_per_row // split) + 1  # + the device's scratch page
    model = dataclasses.replace(dsr1.init_random(CONFIG, seed=11, dtype="float32", mesh=mesh), rules=rules)
    pool = programs.paged_cache(cfg=CONFIG, mesh=mesh, num_pages=per_device * ranks * split, page_size=page_size,
                                dtype="float32", kv_cache_dtype=None, rules=rules)
    table = np.zeros((rows, pages_per_row), np.int32)
    for r in range(ranks):
        for t in range(split):
            ids = iter(np.random.default_rng(r * split + t).permutation(np.arange(1, per_device)))
            for b in range(r * rows // ranks, (r + 1) * rows // ranks):
                for j in range(t, pages_per_row, split):
                    table[b, j] = next(ids)
    tokens = np.random.default_rng(1).integers(1, CONFIG.vocab_size, (rows, 9)).astype(np.int32)
    counts = np.resize(np.array([9, 5, 9, 1, 0, 7, 9, 3], np.int32), rows)  # row 4 (mod 8) idle throughout
    starts = np.zeros(rows, np.int32)
    logits, _, pool = programs.extend(model.params, pool, tokens, starts, counts, table,
                                      np.maximum(counts - 1, 0)[:, None], **model.program_kwargs)
    out = [np.asarray(logits)]
    for _ in range(3):
        starts, counts = starts + counts, np.where(counts > 0, 1, 0).astype(np.int32)
        token = out[-1][:, -1].argmax(-1).astype(np.int32)[:, None]
        logits, _, pool = programs.extend(model.params, pool, token, starts, counts, table,
                                          np.zeros((rows, 1), np.int32), **model.program_kwargs)
        out.append(np.asarray(logits))
    return out, [s.data.shape[1] for s in pool.c_kv.addressable_shards], per_device


def dp_checks(one, mesh) -> dict:
    """Attention data parallelism against one device: paged extend's logits with the pool split over
    the ranks and over each row's positions (layout dp) and over the ranks only; where the caches live."""
    ranks = mesh.shape[DP.batch]
    rows = max(8, ranks)
    ref, _, _ = paged_extend_logits(one, ShardingRules(), rows)
    scale = max(float(np.abs(r).max()) for r in ref)
    report = {}
    for name, rules in (("dp", DP), ("dp_rows_only", dataclasses.replace(DP, positions=None))):
        got, pages, per_device = paged_extend_logits(mesh, rules, rows)
        report[name] = {"extend_max_rel_diff": max(float(np.abs(a - b).max()) for a, b in zip(ref, got)) / scale,
                        "pool_pages_per_device": sorted(set(pages)), "expected_pages_per_device": per_device}
    cache = programs.random_cache(jax.random.key(0), cfg=CONFIG, mesh=mesh, batch=2 * ranks, context=4, max_len=8,
                                  dtype="float32", kv_cache_dtype=None, rules=DP)
    report["cache_rows_per_device"] = sorted({s.data.shape[1] for s in cache.c_kv.addressable_shards})
    return report


def engine_workload(vocab: int) -> list[tuple[int, list[int], dict]]:
    """Arrivals `(step, prompt, options)`: requests sharing four prefixes, then unrelated ones that push
    those prefixes' pages out to host memory, then the four prefixes again (reloaded)."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(2, vocab, n).tolist() for n in (13, 16, 18, 20)]

    def extending(prefix: list[int]) -> list[int]:
        return prefix + rng.integers(2, vocab, int(rng.integers(2, 10))).tolist()

    arrivals = [(i // 2, extending(prefixes[i % 4])) for i in range(8)]
    arrivals += [(6 + i, rng.integers(2, vocab, int(rng.integers(20, 30))).tolist()) for i in range(12)]
    arrivals += [(24 + i // 2, extending(prefixes[i % 4])) for i in range(8)]
    budgets = rng.integers(2, 9, len(arrivals)).tolist()
    return [(at, prompt, dict(max_new_tokens=b)) for (at, prompt), b in zip(arrivals, budgets)]


def engine_shape(mesh, rules: ShardingRules) -> tuple[int, int, int]:
    """The engine's slots, prefill rows and pages: 8, 4 and 48 up to 4 ranks (some requests wait for
    pages, cached prefixes go to host memory), 1 slot, 1 prefill row and 10 pages per rank beyond."""
    ranks = mesh.shape[rules.batch] if rules.batch else 1
    return (8, 4, 48) if ranks <= 4 else (ranks, ranks, 10 * ranks)


def engine_run(mesh, rules: ShardingRules, draft_tokens: int = 0, redundant: int = 0) -> dict:
    """`engine_workload` through the serving engine on `mesh` with `rules` (and MTP drafts): each
    request's greedy tokens, the prefix cache's counts, and how the requests and the pool were spread
    over the ranks. `redundant`: that many redundant expert slots per layer, first placed for an even
    load, then placed again from the routing the engine counted every 6 steps."""
    from dsr1.serving import Engine

    from .test_serving import run_arrivals

    cfg = dataclasses.replace(CONFIG, num_nextn_predict_layers=1)  # the same weights, and an MTP module
    model = dsr1.init_random(cfg, seed=11, dtype="float32", mesh=mesh, mtp=bool(draft_tokens), rules=rules)
    if redundant:
        model = model.with_redundant_experts(redundant)
    first = eplb.placement_of(model.params)
    slots, prefill_rows, pages = engine_shape(mesh, rules)
    engine = Engine(model, max_seqs=slots, prefill_rows=prefill_rows,
                    page_size=4, num_pages=pages, prefill_chunk=8, decode_steps=2, host_cache_bytes=1 << 24,
                    max_seq_len=48, draft_tokens=draft_tokens, rebalance_every=6 if redundant else 0)
    snapshots: list = []
    requests = run_arrivals(engine, engine_workload(CONFIG.vocab_size), snapshots)
    engine.check()
    stats, shards = engine.stats(), engine._runner.pool.cache.c_kv.addressable_shards
    placed = {} if first is None else {  # the pairs counted since the engine started, per layer
        "moved": not np.array_equal(eplb.placement_of(engine.model.params).physical, first.physical),
        "pairs_per_layer": sorted(set(engine._runner.expert_load().sum(1).tolist())), "k": cfg.num_experts_per_tok}
    return {"tokens": [r.tokens for r in requests], "prefix_hit_tokens": stats.prefix_hit_tokens, **placed,
            "offloaded_pages": stats.offloaded_pages, "reloaded_pages": stats.reloaded_pages,
            "ranks_used": np.max([s.running_per_rank for s in snapshots], axis=0).tolist(),
            "pool_pages_per_device": sorted({s.data.shape[1] for s in shards})}


def compare(expert: int, tensor: int) -> dict:
    """The MoE layer's outputs and greedy tokens on an expert x tensor mesh, per dispatch, against one
    device's psum path."""
    one = dsr1.make_mesh(expert=1, tensor=1, devices=jax.devices()[:1])
    mesh = dsr1.make_mesh(expert=expert, tensor=tensor)
    ref = moe_outputs(one)["psum"]
    outputs = moe_outputs(mesh)
    scale = float(np.abs(ref).max())
    return {
        "ragged_exchange_errors": ragged_exchange_errors(mesh, ALL_TO_ALL),
        "moe_max_rel_diff": {k: float(np.abs(v - ref).max()) / scale for k, v in outputs.items()},
        "tokens_one_device": greedy_tokens(one, ShardingRules()),
        "tokens": {**{r.moe_dispatch: greedy_tokens(mesh, r) for r in (ShardingRules(), ALL_TO_ALL)},
                   "dp": greedy_tokens(mesh, DP)},
        "tokens_eplb": {"psum": greedy_tokens(mesh, ShardingRules(), redundant=2 * expert),
                        "dp": greedy_tokens(mesh, DP, redundant=2 * expert)},
        "dp": dp_checks(one, mesh),
        # MTP drafts are checked on layout dp with redundant experts: one engine run covers both.
        "engine": {"one_device": engine_run(one, ShardingRules()), "dp": engine_run(mesh, DP),
                   "dp_eplb": engine_run(mesh, DP, draft_tokens=1, redundant=2 * expert)},
        "engine_pages": engine_shape(mesh, DP)[2],
    }


@pytest.mark.slow
@pytest.mark.parametrize("expert, tensor", [(4, 2), pytest.param(8, 1, marks=pytest.mark.extended),
                                            pytest.param(16, 4, marks=pytest.mark.extended)])
def test_all_to_all_and_dp_match_psum_and_one_device_on_eight_devices(expert, tensor):
    """8 devices (64 in the extended tier): the MoE layer, `generate`, paged extend and the serving
    engine on the all-to-all dispatch and on layout dp give one device's outputs."""
    from .harness import subprocess_env

    done = subprocess.run([sys.executable, "-m", "tests.test_expert_all_to_all", f"--expert={expert}",
                           f"--tensor={tensor}"], env=subprocess_env(expert * tensor), capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ragged_exchange_errors"] == []
    for dispatch, diff in report["moe_max_rel_diff"].items():
        assert diff < 1e-5, (dispatch, diff)
    ref = report["tokens_one_device"]
    assert all(len(row) == 12 for row in ref)
    assert report["tokens"]["psum"] == ref
    assert report["tokens"]["all_to_all"] == ref
    assert report["tokens"]["dp"] == ref
    assert report["tokens_eplb"] == {"psum": ref, "dp": ref}  # redundant experts change no token
    for split in ("dp", "dp_rows_only"):
        dp = report["dp"][split]
        assert dp["extend_max_rel_diff"] < 1e-5, (split, dp)
        assert dp["pool_pages_per_device"] == [dp["expected_pages_per_device"]], (split, dp)  # its share only
    assert report["dp"]["cache_rows_per_device"] == [2], report["dp"]
    engine, ranks, pages = report["engine"], expert, report["engine_pages"]
    assert all(engine["one_device"]["tokens"]), "every request generated"
    for dp in (engine["dp"], engine["dp_eplb"]):
        assert dp["tokens"] == engine["one_device"]["tokens"]
        assert dp["pool_pages_per_device"] == [pages // ranks]  # each rank holds its share of the pool
        assert len(dp["ranks_used"]) == ranks and min(dp["ranks_used"]) > 0  # every rank served
    for run in engine.values():
        assert run["prefix_hit_tokens"] > 0 and run["offloaded_pages"] > 0 and run["reloaded_pages"] > 0, run
    # Redundant experts: the engine counted every layer's pairs (K per token) and placed the copies again.
    eplb_run = engine["dp_eplb"]
    assert eplb_run["moved"], "the engine rebalanced from the routing it counted"
    (pairs,) = eplb_run["pairs_per_layer"]
    assert pairs > 0 and pairs % eplb_run["k"] == 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--expert", type=int, required=True)
    ap.add_argument("--tensor", type=int, required=True)
    args = ap.parse_args()
    print(json.dumps(compare(args.expert, args.tensor)))
