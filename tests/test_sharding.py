"""The same logits on 1 device, on 8 fake CPU devices under expert x tensor meshes, and in
2 processes x 2 devices (jax.distributed over gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dsr1
from dsr1.core.sharding import DEFAULT_RULES, ShardingRules, to_host
from dsr1.weights.convert import convert

from .harness import (
    DECODE_PREFIX,
    TOLERANCE,
    decode_logits,
    free_port,
    relative_error,
    start_processes,
    subprocess_env,
    wait_processes,
)

WORKER = ("-m", "tests.mesh_worker")
SAME = 1e-5  # sharded vs single-device: only the order of float32 sums differs


@pytest.fixture(scope="module")
def single_device(all_fixtures, tmp_path_factory):
    """The R1-like fixture on one device: inputs file and logits to compare against."""
    fx = all_fixtures["grouped_qlora"]
    model = dsr1.load(fx.folder, dtype="float32", progress=False)
    inputs = tmp_path_factory.mktemp("mesh") / "inputs.npz"
    np.savez(inputs, tokens=fx.tokens, lengths=fx.lengths, prefix=DECODE_PREFIX)
    return fx, inputs, np.asarray(model.forward(fx.tokens, fx.lengths)), decode_logits(
        model, fx.tokens, fx.lengths, DECODE_PREFIX)


def _compare(result: dict, single_device, label: str) -> None:
    fx, _, forward, decoded = single_device
    valid = np.arange(forward.shape[1])[None, :] < fx.lengths[:, None]
    fwd_err = relative_error(result["forward"][valid], forward[valid])
    dec_err = max(relative_error(v, decoded[tuple(k)]) for k, v in zip(result["decode_keys"], result["decode"]))
    ref_err = max(relative_error(result["forward"][r, :n], fx.reference[r, :n]) for r, n in enumerate(fx.lengths))
    print(f"\n[{label}] vs 1 device: forward {fwd_err:.1e}, decode {dec_err:.1e}; vs HF {ref_err:.1e}")
    assert len(result["decode_keys"]) == len(decoded)
    assert fwd_err <= SAME and dec_err <= SAME and ref_err <= TOLERANCE


def _run(args: list[str], devices: int, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *WORKER, *args], env=subprocess_env(devices), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("expert,tensor", [(None, None), (8, 1), (2, 4)])
def test_eight_fake_devices(single_device, tmp_path, expert, tensor):
    fx, inputs, *_ = single_device
    out = tmp_path / "out.npz"
    sizes = [f"--expert={expert}"] * (expert is not None) + [f"--tensor={tensor}"] * (tensor is not None)
    proc = _run(["--folder", str(fx.folder), "--inputs", str(inputs), "--out", str(out), *sizes], devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(np.load(out))
    e, t = result["mesh_shape"]
    assert e * t == 8 and (expert is None or (e, t) == (expert, tensor))
    n_experts, heads = fx.hf_config["n_routed_experts"], fx.hf_config["num_attention_heads"]
    assert result["local_expert_shard"][1] == n_experts // e, "experts must be split over the expert axis"
    assert result["local_head_shard"][2] == heads // t, "heads must be split over the tensor axis"
    _compare(result, single_device, f"8 devices, expert={e} x tensor={t}")


def _two_processes(folder: Path, inputs: Path, out: Path) -> dict:
    common = ["--folder", str(folder), "--inputs", str(inputs), "--out", str(out), "--expert=2", "--tensor=2",
              "--num-processes=2", f"--port={free_port()}"]
    wait_processes(start_processes(WORKER[1], common))
    result = dict(np.load(out))
    assert int(result["processes"]) == 2 and int(result["devices"]) == 4
    return result


@pytest.mark.slow
def test_two_processes_two_devices_each(single_device, tmp_path):
    fx, inputs, *_ = single_device
    _compare(_two_processes(fx.folder, inputs, tmp_path / "out.npz"), single_device,
             "2 processes x 2 devices, expert=2 x tensor=2")


@pytest.mark.slow
def test_converted_checkpoint_on_eight_devices_and_two_processes(single_device, tmp_path):
    """Converted, then loaded into other meshes, it equals the direct single-device load."""
    fx, inputs, *_ = single_device
    converted = convert(fx.folder, tmp_path / "converted", dtype="float32", progress=False)
    proc = _run(["--folder", str(converted), "--inputs", str(inputs), "--out", str(tmp_path / "8.npz")], devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _compare(dict(np.load(tmp_path / "8.npz")), single_device, "converted, 8 devices, expert=4 x tensor=2")
    _compare(_two_processes(converted, inputs, tmp_path / "2.npz"), single_device,
             "converted, 2 processes x 2 devices")


@pytest.mark.slow
def test_default_mesh_and_indivisible_weights():
    code = ("import dataclasses, dsr1; tiny = dataclasses.replace(dsr1.Config.preset('tiny'), vocab_size=4096); "
            "print(dict(dsr1.make_mesh().shape)); "
            "m = dsr1.init_random(tiny); "
            "print(m.params['moe_layers']['moe']['gate'].addressable_shards[0].data.shape); "
            "dsr1.init_random(tiny, mesh=dsr1.make_mesh(expert=1, tensor=8))")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(8), capture_output=True, text=True,
                          timeout=300)
    assert "{'expert': 4, 'tensor': 2}" in proc.stdout
    assert "(2, 4, 128, 32)" in proc.stdout, "random init must create experts and expert ffw already split"
    assert proc.returncode != 0
    assert "dimension 'heads' of size 4 does not split over mesh axis 'tensor' of size 8" in proc.stderr


def test_sharding_rules_are_a_value_with_a_collision_check():
    """Rules map logical to mesh axes; one mesh axis twice in one array is refused, naming both."""
    assert DEFAULT_RULES.spec(("experts", "embed", "expert_ffw")) == jax.sharding.PartitionSpec("expert", None,
                                                                                               "tensor")
    clashing = ShardingRules(expert_ffw="expert")
    with pytest.raises(ValueError, match=r"map \['experts', 'expert_ffw'\] to the same mesh axis 'expert'"):
        clashing.spec(("experts", "embed", "expert_ffw"))
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'rows'"):
        DEFAULT_RULES.spec(("rows", None))
    with pytest.raises(ValueError, match="same mesh axis"):
        dsr1.init_random(dsr1.Config.preset("tiny"), rules=clashing)


@pytest.mark.slow
def test_other_rules_give_the_same_logits(grouped):
    """Rules are passed as a value: replicating the experts instead of splitting them over the
    expert axis changes where weights live, not the logits."""
    tokens = np.array([[0, 5, 9, 2, 7]], np.int32)
    base = dsr1.load(grouped.folder, dtype="float32", progress=False)
    other = dsr1.load(grouped.folder, dtype="float32", progress=False, rules=ShardingRules(experts=None))
    assert other.rules.experts is None
    np.testing.assert_allclose(to_host(other.forward(tokens)), to_host(base.forward(tokens)), rtol=0, atol=1e-5)


def test_make_mesh_lays_out_devices_with_jax_make_mesh():
    mesh = dsr1.make_mesh()
    assert mesh.axis_names == ("expert", "tensor")
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="does not divide"):
        dsr1.make_mesh(expert=3)
