"""The form `load_everywhere` and serve.ipynb load the weights in by default: R1's release config in
int8 on a v5e-64 and on 8xH200, where bf16 does not fit (the capacity plan's own weight count and
budget say so too), full precision where it fits or where the devices report no memory (CPU); an
explicit quant or kv_cache_dtype wins; a model that fits nowhere is refused before any loading."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

import dsr1
from dsr1.bench.plan import GIB, SAFETY_MARGIN, TARGETS, abstract_weights, device_bytes
from dsr1.core.config import Config
from dsr1.core.sharding import DEFAULT_RULES, MESH_AXES
from dsr1.workbench.process import ClusterError
from dsr1.workbench.weights_form import choose_form, weights_form

SHARED_R1 = Path(__file__).parents[2] / "shared" / "reference" / "deepseek-r1" / "config.json"
R1_CONFIG = SHARED_R1 if SHARED_R1.exists() else Path(__file__).parent / "data" / "deepseek-r1-config.json"

# dsr1.make_mesh()'s default for the device count (tensor: the largest divisor <= its square root),
# the mesh load_everywhere loads on; and the target's own mesh.
MACHINES = {"v5e-64": [(8, 8)], "8xH200": [(4, 2), (1, 8)]}


@pytest.mark.parametrize("target", sorted(MACHINES))
def test_r1_loads_in_int8_where_bf16_does_not_fit(target):
    cfg = Config.from_hf(R1_CONFIG)
    memory = int(TARGETS[target].hbm_gib * GIB)
    budget = memory * (1 - SAFETY_MARGIN)
    for expert, tensor in MACHINES[target]:
        mesh = AbstractMesh((expert, tensor), MESH_AXES)
        form = choose_form(cfg, mesh, memory, mtp=True)
        assert (form.quant, form.kv_cache_dtype) == ("int8", None), form
        # `bench plan`'s count of the weights per device: bf16 over the budget, the chosen form within it.
        plan_bytes = {q: device_bytes(abstract_weights(cfg, mesh, DEFAULT_RULES, jnp.bfloat16, q))
                      for q in (None, "int8")}
        assert plan_bytes[None] > budget >= plan_bytes["int8"], (target, plan_bytes, budget)
        assert "GiB per device" in form.reason


def test_what_fits_stays_in_full_precision_and_the_caller_decides():
    demo = Config.from_hf(dsr1.demo_checkpoint())
    mesh = AbstractMesh((2, 2), MESH_AXES)
    fits = choose_form(demo, mesh, 16 * GIB)
    assert (fits.quant, fits.kv_cache_dtype) == (None, None)
    cpu = choose_form(Config.from_hf(R1_CONFIG), mesh, None)  # CPU devices report no memory limit
    assert (cpu.quant, cpu.kv_cache_dtype) == (None, None)
    asked = weights_form(dsr1.demo_checkpoint(), dsr1.make_mesh(), "int8", "int8")
    assert (asked.quant, asked.kv_cache_dtype, asked.reason) == ("int8", "int8", "as asked")
    auto = weights_form(dsr1.demo_checkpoint(), dsr1.make_mesh())  # this process's CPU devices: as before
    assert (auto.quant, auto.kv_cache_dtype) == (None, None)


def test_a_model_that_fits_no_form_is_refused_naming_the_sizes():
    with pytest.raises(ClusterError, match=r"does not fit \{'expert': 1, 'tensor': 8\} devices of 16.0 GiB.*int8 "
                                           r"weights \+ int8 cache .* GiB\. Use more devices"):
        choose_form(Config.from_hf(R1_CONFIG), AbstractMesh((1, 8), MESH_AXES), 16 * GIB)
