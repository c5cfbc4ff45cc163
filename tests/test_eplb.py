"""Redundant experts (`dsr1.core.eplb`): placements keep every expert, fill every device equally and
bring the busiest device toward the mean; pairs go only to copies of their expert; `bench eplb`
replays recorded routings. (That a placement changes no token is checked on eight devices in
tests/test_expert_all_to_all.py.)"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dsr1.bench.cli import main as bench_main
from dsr1.core import eplb
from dsr1.programs.eplb import moved_to, with_placement


def skewed_load(layers: int = 3, experts: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).pareto(1.0, (layers, experts)) * 100 + 10


def test_balance_keeps_every_expert_fills_devices_equally_and_evens_the_load():
    load = skewed_load()
    plain = eplb.identity_placement(3, 16, 4)
    placement = eplb.balance(load, devices=4, redundant=8)
    assert placement.physical.shape == (3, 24)
    for row, layer_load in zip(placement.physical, load):
        assert set(row) == set(range(16))  # every expert keeps a slot
        hottest = int(np.argmax(layer_load))
        assert (row == hottest).sum() >= 2  # and the hottest one a copy
        for d in range(4):  # no device holds two copies of one expert
            share = row[d * 6:(d + 1) * 6]
            assert len(set(share)) == len(share)
    before = eplb.device_load(load, plain)
    after = eplb.device_load(load, placement)
    np.testing.assert_allclose(after.sum(1), load.sum(1))  # the same pairs, spread
    assert (after.max(1) / after.mean(1) < before.max(1) / before.mean(1)).all()
    assert (after.max(1) / after.mean(1) < 1.2).all()


def test_balance_refuses_slots_that_do_not_split_over_the_devices():
    with pytest.raises(ValueError, match="16 experts \\+ 3 redundant slots do not split over 4 devices"):
        eplb.balance(skewed_load(), devices=4, redundant=3)


def test_pairs_go_to_copies_of_their_expert_spread_over_the_copies():
    placement = eplb.balance(skewed_load(layers=1), devices=4, redundant=8)
    replicas, counts = placement.replicas()
    experts = np.random.default_rng(1).integers(0, 16, (64, 4)).astype(np.int32)
    slots = np.asarray(eplb.physical_experts(jnp.asarray(experts), jnp.asarray(replicas[0]), jnp.asarray(counts[0])))
    assert (placement.physical[0][slots] == experts).all()
    hot = int(np.argmax(counts[0]))
    used = set(slots[experts == hot].tolist())
    assert len(used) == counts[0, hot] > 1


def test_bench_eplb_replays_recorded_routing(tmp_path, capsys):
    out, routing = tmp_path / "eplb.json", tmp_path / "routing.npy"
    assert bench_main(["eplb", "--steps", "8", "--redundant", "4", "--record", str(routing), "--json", str(out),
                       "--expert", "1", "--tensor", "1"]) == 0
    result = json.loads(out.read_text())
    assert [r["redundant"] for r in result["rows"]] == [0, 4] and result["tokens"] == 8 * 8
    assert all(len(r["max_over_mean"]) == 3 and min(r["max_over_mean"]) >= 1.0 for r in result["rows"])
    recorded = np.load(routing)
    assert recorded.shape == (64, 3, 4) and recorded.max() < 16
    assert bench_main(["eplb", "--routing", str(routing), "--redundant", "4,8", "--expert", "1", "--tensor", "1"]) == 0
    assert "| 8 |" in capsys.readouterr().out
    np.save(routing, recorded[:, :2])
    with pytest.raises(SystemExit, match="expected \\[tokens, 3, K\\]"):
        bench_main(["eplb", "--routing", str(routing), "--expert", "1", "--tensor", "1"])


def test_a_serving_state_counts_the_pairs_of_real_tokens_only():
    """The serving engine's routing statistics (`SlotState.expert_load`, what `Engine.rebalance` reads):
    each layer's pairs of the real tokens of each row (`counts`), none of the padding."""
    import dsr1
    from dsr1.generation.sampling import Sampling
    from dsr1.programs import step
    from dsr1.serving.work import device_sampling, host_sampling

    from .harness import TINY

    layers, experts, k = TINY.num_moe_layers, TINY.n_routed_experts, TINY.num_experts_per_tok
    mesh = dsr1.make_mesh()
    idle = device_sampling(host_sampling([Sampling(seed=0)] * 3), mesh)
    state = step.slot_state(idle, mesh=mesh, vocab_size=TINY.vocab_size, expert_load=(layers, experts))
    assert step.slot_state(idle, mesh=mesh, vocab_size=TINY.vocab_size).expert_load is None
    routing = np.random.default_rng(0).integers(0, experts, (layers, 3, 5, k))
    counts = np.array([5, 2, 0])
    for _ in range(2):
        state = step.count_routing(state, jnp.asarray(routing, jnp.int32), jnp.asarray(counts, jnp.int32))
    want = np.zeros((layers, experts), np.int64)
    for layer, row in np.ndindex(layers, 3):
        np.add.at(want[layer], routing[layer, row, :counts[row]].ravel(), 2)
    np.testing.assert_array_equal(np.asarray(state.expert_load), want)
    assert (want.sum(1) == 2 * k * counts.sum()).all()


def test_a_placement_moves_to_another_with_the_same_weights_per_expert():
    """`moved_to` (a rebalance): every slot of the new placement holds its expert's weights, read from
    the slot that held them (`placement_of` reads the map back)."""
    import jax

    import dsr1

    stack = np.random.default_rng(1).standard_normal((2, 8, 3, 4)).astype(np.float32)  # [L, E, in, out]
    held = jax.device_put(stack, jax.sharding.NamedSharding(dsr1.make_mesh(), jax.sharding.PartitionSpec()))
    params = {"moe_layers": {"moe": {name: held for name in ("gate", "up", "down")}}}
    first = eplb.balance(skewed_load(2, 8, seed=1), devices=1, redundant=4)
    placed = with_placement(params, first)
    assert np.array_equal(eplb.placement_of(placed).physical, first.physical)
    second = eplb.balance(skewed_load(2, 8, seed=2), devices=1, redundant=4)
    moved = moved_to(placed, second)
    assert np.array_equal(eplb.placement_of(moved).physical, second.physical)
    gate = np.asarray(moved["moe_layers"]["moe"]["gate"])
    for layer, slot in np.ndindex(second.physical.shape):
        np.testing.assert_array_equal(gate[layer, slot], stack[layer, second.physical[layer, slot]])
    in_place = moved_to(with_placement(params, first), second, donate=True)  # what an engine does
    np.testing.assert_array_equal(np.asarray(in_place["moe_layers"]["moe"]["up"]), gate)
    with pytest.raises(ValueError, match="hold no placement"):
        moved_to(params, second)
    with pytest.raises(ValueError, match="already hold a placement"):
        with_placement(placed, second)


def test_serve_refuses_redundant_experts_without_an_expert_axis():
    """`python -m dsr1 serve --redundant-experts R` needs an expert axis of several devices to balance
    (the refusal is `Model.with_redundant_experts`'s, as the command's error)."""
    import dsr1
    from dsr1.server.cli import with_redundant_experts

    from .harness import TINY

    model = dsr1.init_random(TINY, seed=0, dtype="float32")
    with pytest.raises(SystemExit, match="--redundant-experts 4: redundant experts balance the devices"):
        with_redundant_experts(model, 4)


def test_an_engine_step_counts_k_pairs_per_token_it_runs():
    """The engine's own steps (`serve_step`: prompt chunks, multi-step decode) count K pairs per layer for
    every token they run: each prompt token once, each sampled token but the last fed back once."""
    import dsr1
    from dsr1.generation.sampling import Sampling
    from dsr1.programs import step
    from dsr1.serving import Engine
    from dsr1.serving.work import device_sampling, host_sampling

    from .harness import TINY

    engine = Engine(dsr1.init_random(TINY, seed=0, dtype="float32"), max_seqs=2, page_size=4, num_pages=24,
                    prefill_chunk=8, decode_steps=2, prefix_caching=False)
    runner, cfg = engine._runner, TINY
    idle = device_sampling(host_sampling([Sampling(seed=0)] * engine.config.slots), runner.model.mesh)
    runner.state = step.slot_state(idle, mesh=runner.model.mesh, vocab_size=cfg.vocab_size,
                                   expert_load=(cfg.num_moe_layers, cfg.n_routed_experts))
    rng = np.random.default_rng(0)
    prompts, budgets = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (11, 5, 19)], (6, 3, 4)
    requests = [engine.submit(p, max_new_tokens=b, sampling=Sampling(ignore_eos=True))
                for p, b in zip(prompts, budgets)]
    engine.run()
    assert [len(r.tokens) for r in requests] == list(budgets)
    fed = sum(len(p) + b - 1 for p, b in zip(prompts, budgets))
    assert (engine.expert_load().sum(1) == cfg.num_experts_per_tok * fed).all()
