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
