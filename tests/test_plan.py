"""`python -m dsr1.bench plan`: weight and cache bytes against hand-computed sums, the replication
check, a scaled-down plan compiled on 8 fake CPU devices (in a subprocess: the device count is
fixed when JAX starts), the HLO walk of `--compiler tpu` on a hand-written module, and a scaled-down
model compiled by XLA:TPU (libtpu, the tpu-plan extra) for a v5e-4 slice."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from dsr1.bench import hlo
from dsr1.bench.chips import SLICES
from dsr1.bench.cli import parser
from dsr1.bench.plan import (
    TARGETS,
    PlanError,
    abstract_cache,
    abstract_weights,
    cache_bytes_per_token,
    device_bytes,
    parse_mesh,
    spec_from_options,
    split_problems,
)
from dsr1.core.config import Config
from dsr1.core.params import param_specs
from dsr1.core.sharding import DEFAULT_RULES, MESH_AXES, ShardingRules
from dsr1.weights.release import CheckpointIndex

from .harness import subprocess_env

TINY = Config.preset("tiny")


def _mesh(expert: int, tensor: int) -> AbstractMesh:
    return AbstractMesh((expert, tensor), MESH_AXES)


def bf16_bytes_per_device(c: Config, expert: int, tensor: int) -> int:
    """A q_lora config's bf16 weights on one device, summed by hand from the layout DEFAULT_RULES gives:
    vocab, heads, ffw and expert ffw split over `tensor`, experts over `expert`, the rest whole."""
    d, h, r, q, v = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.q_lora_rank, c.v_head_dim
    qk, rope = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_rope_head_dim
    e, f = c.n_routed_experts, c.moe_intermediate_size
    attention = 2 * (2 * d + d * (r + rope) + r + d * q + q  # norms, kv_a, kv_a_norm, q_a, q_a_norm
                     + (q * h * qk + 2 * h * c.qk_nope_head_dim * r + h * v * d) // tensor)  # q_b, wk_b, wv_b, o
    dense_mlp = 2 * 3 * d * c.intermediate_size // tensor
    moe = (4 * (d * e + e)  # float32 router and bias
           + 2 * 3 * e * d * f // (expert * tensor)  # routed experts
           + 2 * 3 * d * f * c.n_shared_experts // tensor)  # shared expert
    globals_ = 2 * (2 * c.vocab_size * d // tensor + d)  # embed, lm_head, final_norm
    return globals_ + c.num_dense_layers * (attention + dense_mlp) + c.num_moe_layers * (attention + moe)


@pytest.mark.parametrize("expert,tensor", [(4, 2), (1, 4), (2, 1)])
def test_weight_bytes_per_device_are_the_hand_computed_sum(expert, tensor):
    weights = abstract_weights(TINY, _mesh(expert, tensor), DEFAULT_RULES, jnp.bfloat16, None)
    assert device_bytes(weights) == bf16_bytes_per_device(TINY, expert, tensor)


def test_int8_weights_are_smaller_and_r1_int8_on_64_devices_is_about_an_eighth_of_its_total():
    mesh = _mesh(4, 2)
    bf16 = device_bytes(abstract_weights(TINY, mesh, DEFAULT_RULES, jnp.bfloat16, None))
    int8 = device_bytes(abstract_weights(TINY, mesh, DEFAULT_RULES, jnp.bfloat16, "int8"))
    assert int8 < bf16
    r1 = Config.preset("deepseek-r1")
    weights = abstract_weights(r1, _mesh(8, 8), DEFAULT_RULES, jnp.bfloat16, "int8")
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))
    # ~680 GB of int8 + bf16: experts split 64 ways, attention 8 ways (replicated over the expert axis).
    assert 650e9 < total < 720e9 and total / 64 < device_bytes(weights) < total / 32


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_cache_bytes_per_token_follow_the_formula_and_the_abstract_cache(kv_cache_dtype):
    r1 = Config.preset("deepseek-r1")
    latent = 512 + 4 if kv_cache_dtype else 512 * 2  # int8 + a float32 scale, or bf16
    assert cache_bytes_per_token(r1, jnp.bfloat16, kv_cache_dtype) == 61 * (latent + 64 * 2)
    cache = abstract_cache(TINY, _mesh(4, 2), 3, 10, jnp.bfloat16, kv_cache_dtype)
    per_token = cache_bytes_per_token(TINY, jnp.bfloat16, kv_cache_dtype)
    assert device_bytes(cache) == 3 * 10 * per_token + 3 * 4  # replicated: all of it on each device, + lengths


def test_replication_check_names_the_tensor_and_the_axis():
    assert split_problems(param_specs(TINY), _mesh(4, 2), DEFAULT_RULES) == []
    dropped = ShardingRules(experts=None)  # the routed experts would sit whole on every device
    with pytest.raises(PlanError, match=r"\['moe_layers'\]\['moe'\]\['gate'\].*'experts'.*'expert' \(size 4\)"):
        abstract_weights(TINY, _mesh(4, 2), dropped, jnp.bfloat16, None)
    with pytest.raises(PlanError, match=r"\['q_b'\].q .*\('heads'\) of size 4 does not split over mesh axis 'tensor'"):
        abstract_weights(TINY, _mesh(1, 8), DEFAULT_RULES, jnp.bfloat16, "int8")
    # A size-1 axis splits nothing: nothing to complain about.
    assert split_problems(param_specs(TINY), _mesh(8, 1), ShardingRules(heads=None)) == []


def test_mesh_option_syntax():
    assert parse_mesh("expert=8,tensor=4") == {"expert": 8, "tensor": 4}
    for bad in ("8x8", "expert=8", "expert=8,tensor=0", "expert=8,expert=8", "tensor=2,model=4"):
        with pytest.raises(argparse.ArgumentTypeError, match="expert=8,tensor=8"):
            parse_mesh(bad)


def _plan(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsr1.bench", "plan", *args], env=subprocess_env(1),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_scaled_down_plan_compiles_on_eight_fake_devices(tmp_path):
    """R1's structure (q_lora, grouped routing, a dense then a MoE layer) at toy size, from a config.json."""
    small = dataclasses.replace(TINY, vocab_size=1024, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(small.to_hf_dict()))
    out = tmp_path / "plan.json"
    batch, context = 2, 64
    proc = _plan("--config", str(tmp_path), "--mesh", "expert=4,tensor=2", "--hbm", "0.5", "--kv-cache-dtype", "int8",
                 "--batch", str(batch), "--context", str(context), "--prefill-len", "32", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert plan["devices"] == 8 and plan["device"]["device_count"] == 8
    assert plan["weight_bytes_per_device"] == bf16_bytes_per_device(small, 4, 2)
    assert plan["cache_bytes_per_token"] == cache_bytes_per_token(small, jnp.bfloat16, "int8")
    decode = plan["compiled"][0]["memory"]
    # XLA's per-device arguments: the weight shards, the whole (replicated) cache and lengths, the tokens.
    cache = batch * context * plan["cache_bytes_per_token"] + 4 * batch
    assert decode["argument_size_in_bytes"] == plan["weight_bytes_per_device"] + cache + 4 * batch
    assert decode["alias_size_in_bytes"] >= batch * context * plan["cache_bytes_per_token"]  # the donated cache
    assert plan["weights_fit"] and plan["max_tokens"] > 0 and plan["fit"][0]["max_batch"] >= 1
    assert "largest batch x context" in proc.stdout and "| decode | batch 2, cache 64 |" in proc.stdout


def test_plan_fails_before_compiling_when_a_weight_would_be_replicated():
    proc = _plan("--preset", "tiny", "--mesh", "expert=1,tensor=8")  # tiny has 4 heads: they do not split 8 ways
    assert proc.returncode != 0
    assert "['dense_layers']['q_b']" in proc.stderr and "('heads') of size 4" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_target_sets_devices_memory_and_mesh_and_options_override_it():
    spec = spec_from_options(parser().parse_args(["plan", "--target", "v5p-64", "--quant", "int8"]))
    assert (spec.devices, spec.hbm_gib, spec.quant, spec.cfg.num_hidden_layers) == (32, 95, "int8", 61)
    assert {t: (TARGETS[t].devices, TARGETS[t].hbm_gib) for t in TARGETS} == {
        "8xH100": (8, 80), "8xH200": (8, 141), "v5e-4": (4, 16), "v5e-8": (8, 16), "v5e-64": (64, 16),
        "v5p-64": (32, 95), "v6e-8": (8, 32), "v6e-64": (64, 32)}
    # Every TPU target is a slice whose topology has its device count, and its memory is its chip's.
    for name, t in TARGETS.items():
        if name in SLICES:
            assert (SLICES[name].devices, SLICES[name].chip.hbm_gib) == (t.devices, t.hbm_gib)
    with pytest.raises(PlanError, match="--compiler tpu needs a TPU --target"):
        spec_from_options(parser().parse_args(["plan", "--target", "8xH200", "--compiler", "tpu"]))
    spec = spec_from_options(parser().parse_args(["plan", "--target", "8xH100", "--mesh", "expert=2,tensor=4",
                                                  "--hbm", "40", "--preset", "tiny"]))
    assert (spec.mesh, spec.hbm_gib, spec.context, spec.prefill_len) == ({"expert": 2, "tensor": 4}, 40, 1024, 2048)
    with pytest.raises(PlanError, match="max_position_embeddings=2048"):
        spec_from_options(parser().parse_args(["plan", "--preset", "tiny", "--context", "2048"]))


# A loop of 5 layers (its bound a constant) around a page loop whose bound is dynamic; the layer body
# slices its layer out of a [5, 64, 32] bf16 stack inside a fusion and all-reduces an f32[8,32].
HLO = """HloModule walk

%fused_slice (param_0: bf16[5,64,32], param_1: s32[]) -> bf16[64,32] {
  %param_0 = bf16[5,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %view = bf16[5,64,32]{2,1,0} bitcast(%param_0)
  %ds = bf16[1,64,32]{2,1,0} dynamic-slice(%view, %param_1, %zero, %zero), dynamic_slice_sizes={1,64,32}
  ROOT %b = bf16[64,32]{1,0} bitcast(%ds)
}

%retile (param_0.1: bf16[5,64,32]) -> bf16[5,64,32] {
  %param_0.1 = bf16[5,64,32]{2,1,0:T(8,128)} parameter(0)
  ROOT %c = bf16[5,64,32]{2,1,0:T(4,128)} copy(%param_0.1)
}

%fused_retiled_slice (param_0.2: bf16[5,64,32], param_1.2: s32[]) -> bf16[64,32] {
  %param_0.2 = bf16[5,64,32]{2,1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %zero.2 = s32[] constant(0)
  %tiled = bf16[5,64,32]{2,1,0:T(4,128)} fusion(%param_0.2), kind=kLoop, calls=%retile
  %ds.2 = bf16[1,64,32]{2,1,0} dynamic-slice(%tiled, %param_1.2, %zero.2, %zero.2), dynamic_slice_sizes={1,64,32}
  ROOT %b.2 = bf16[64,32]{1,0} bitcast(%ds.2)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%pages_cond (p: (s32[], s32[])) -> pred[] {
  %p = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%pages_body (p: (s32[], s32[])) -> (s32[], s32[]) {
  %p = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  %g = f32[16,8]{1,0} all-gather(f32[4,8]{1,0} %i), dimensions={0}, metadata={op_name="jit(f)/pages"}
  ROOT %t = (s32[], s32[]) tuple(%i, %n)
}

%layers_cond (q: (s32[], bf16[5,64,32])) -> pred[] {
  %q = (s32[], bf16[5,64,32]) parameter(0)
  %c5 = s32[] constant(5)
  %i = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%i, %c5), direction=LT
}

%layers_body (q: (s32[], bf16[5,64,32])) -> (s32[], bf16[5,64,32]) {
  %q = (s32[], bf16[5,64,32]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %w = bf16[5,64,32]{2,1,0} get-tuple-element(%q), index=1
  %layer = bf16[64,32]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %retiled = bf16[64,32]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_retiled_slice
  %copy.1 = bf16[64,32]{0,1} copy(%layer)
  %act = f32[8,32]{1,0} broadcast(%i), dimensions={}
  %r = f32[8,32]{1,0} all-reduce(f32[8,32]{1,0} %act), to_apply=%add, metadata={op_name="jit(f)/moe/psum"}
  %pt = (s32[], s32[]) tuple(%i, %i)
  %pw = (s32[], s32[]) while(%pt), condition=%pages_cond, body=%pages_body
  ROOT %t = (s32[], bf16[5,64,32]) tuple(%i, %w)
}

ENTRY %main (a: bf16[5,64,32]) -> f32[8,128] {
  %a = bf16[5,64,32]{2,1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], bf16[5,64,32]) tuple(%z, %a)
  %loop = (s32[], bf16[5,64,32]) while(%t), condition=%layers_cond, body=%layers_body
  ROOT %ag = f32[8,128]{1,0} all-gather(f32[8,32]{1,0} %z), dimensions={1}
}
"""


def test_hlo_walk_counts_loops_by_their_trip_counts_and_fusions_by_their_slices():
    module = hlo.parse_module(HLO)
    assert {n for n, c in module.items() if c.entry} == {"main"}
    assert hlo.trip_count(module["layers_cond"]) == 5 and hlo.trip_count(module["pages_cond"]) is None
    runs = hlo.executions(module, dynamic_trips=3)
    assert runs == {"main": 1, "layers_body": 5, "pages_body": 15}  # fused computations run inside their fusion
    found = {(c.op, c.bytes, c.runs) for c in hlo.collectives(module, runs)}
    assert found == {("all-gather", 8 * 128 * 4, 1), ("all-reduce", 8 * 32 * 4, 5), ("all-gather", 16 * 8 * 4, 15)}
    # The fusion reads one layer's slice (not the whole stack) and its index, and writes the slice.
    layer = 64 * 32 * 2
    for fusion in ("layer", "retiled"):  # the second slices the stack after XLA:TPU retiles it (a nested fusion)
        assert hlo.instruction_bytes(module["layers_body"].by_name()[fusion], {"w": "bf16[5,64,32]", "i": "s32[]"},
                                     module) == 2 * layer + 4  # + the s32 index
    copies = hlo.copies_of(module, runs, [(64, 32)])
    assert [(c.name, c.bytes, c.runs) for c in copies] == [("copy.1", layer, 5)]


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'dsr1[tpu-plan]')")


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_scaled_down_serving_step_compiled_by_xla_tpu_for_v5e(tmp_path, layout):
    """R1's structure at toy size (a dense layer, two MoE layers, 16 routed experts) compiled by XLA:TPU
    for a v5e-4 slice: memory analysis, bytes per step, collectives with their bytes, and none of them
    large: no collective moves more than the step's logits (a gathered weight, like the lm_head, would).
    Layout tp: the page pool on every device, the routed experts' partial sums all-reduced. Layout dp:
    each rank holds its share of the pool, and tokens reach their experts by two all-to-alls whose
    buffers hold at most twice the routed activations. Either way the experts are read in place
    (the grouped-matmul kernel): no copy of a device's expert stack."""
    # Expert widths of whole lane tiles per device, as R1's are (a narrower one XLA:TPU lays out
    # transposed, and copies into the kernel's layout).
    small = dataclasses.replace(TINY, vocab_size=1024, moe_intermediate_size=256)
    (tmp_path / "config.json").write_text(json.dumps(small.to_hf_dict()))
    out = tmp_path / "plan.json"
    batch, context = 8, 64
    proc = _plan("--compiler", "tpu", "--config", str(tmp_path), "--target", "v5e-4", "--quant", "int8",
                 "--batch", str(batch), "--context", str(context), "--prefill-len", "32", "--json", str(out),
                 "--layout", layout, timeout=1800)  # three XLA:TPU compiles, on a machine other jobs may share
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    for key in ("max_cached_tokens", "max_batch", "bytes_accessed_per_step", "collectives", "fits"):
        assert key in plan, key
    assert plan["compiler"] == "tpu" and plan["devices"] == 4 and plan["fits"] and plan["prefill_fits"]
    step = plan["compiled"][0]
    assert step["program"] == "serve_step" and step["refused"] is None
    memory = step["memory"]
    # XLA:TPU's arguments per device hold at least the weight shards and the page pool: all of it in
    # layout tp, a device's share in layout dp (pages split over the ranks, a row's over `tensor`).
    shares = plan["mesh"]["expert"] * plan["mesh"]["tensor"] if layout == "dp" else 1
    pool = (batch * context // 16 + shares) * 16 * plan["cache_bytes_per_token"] // shares
    assert plan["layout"] == layout
    assert plan["cache_bytes_per_token_per_device"] == -(-plan["cache_bytes_per_token"] // shares)
    assert memory["argument_size_in_bytes"] >= plan["weight_bytes_per_device"] + pool
    assert memory["alias_size_in_bytes"] >= pool  # the donated pool
    assert plan["max_cached_tokens"] >= batch * 2 * context
    assert plan["max_batch"][str(small.max_position_embeddings)] >= 1
    moe = [c for c in plan["collectives"] if "routed_experts" in c["source"]]
    if layout == "tp":  # the routed experts' partial sums: one f32 [batch, hidden] all-reduce per MoE layer
        reduced = [c for c in moe if c["op"] == "all-reduce"]
        assert [(c["bytes"], c["runs"]) for c in reduced] == [(batch * small.hidden_size * 4, small.num_moe_layers)]
    else:  # each (token, expert) pair to its expert's device and back, by two all-to-alls whose buffers
        # hold at most twice the step's routed activations (dropless: one device may receive every pair)
        sent = [c for c in moe if "all-to-all" in c["op"]]
        assert len(sent) == 2 and all(c["runs"] == small.num_moe_layers for c in sent), moe
        routed = batch * small.num_experts_per_tok * small.hidden_size * 2  # bf16
        assert all(c["bytes"] <= 2 * routed for c in sent), sent
        assert not [c for c in moe if c["op"] == "all-reduce" and c["bytes"] >= batch * small.hidden_size * 4]
    assert all(set(c) >= {"op", "bytes"} and c["op"] in hlo.COLLECTIVES for c in plan["collectives"])
    logits = batch * small.vocab_size * 4
    assert small.vocab_size * small.hidden_size * 2 > logits  # the bound would catch a gathered lm_head
    assert pool > logits  # and, in layout dp, a rank's pages gathered from the others
    assert max(c["bytes"] for c in plan["collectives"]) <= logits
    # Bytes per step: at least the attention weights every layer reads, and a step time from them.
    attention = plan["weight_breakdown"]["dense_layers"] + plan["weight_breakdown"][
        "moe_layers (attention, shared experts, router)"]
    assert plan["bytes_accessed_per_step"] >= attention
    assert plan["step_time_s"] == pytest.approx(plan["bytes_accessed_per_step"] / 819e9)
    # The grouped-matmul kernel reads each layer's experts in place: no copy per layer. At this toy size
    # XLA:TPU's memory-space assignment may prefetch a whole stack (every layer's) into fast memory once
    # a step; R1's stacks do not fit there (its plan, docs/benchmarks.md, shows no copy).
    assert all(c["runs"] == 1 and c["name"].startswith("copy-start") and c["shape"].startswith(
        f"(s8[{small.num_moe_layers},") for c in plan["expert_copies"]), plan["expert_copies"]
    assert "| serve_step | batch 8, cache 64 |" in proc.stdout and "collectives per serving step" in proc.stdout


@needs_libtpu
def test_shares_give_each_host_of_a_slice_its_experts_and_heads(tmp_path, capsys):
    """`bench shares` on v5p-64's topology (8 hosts of 4 chips), mesh expert=8 x tensor=4: every host
    reads the same bytes, an eighth of the routed experts' (each expert on one expert row, split over
    its 4 tensor columns), and far less than the checkpoint."""
    from .reference import BASE, release_tensors, write_checkpoint

    folder = write_checkpoint(tmp_path / "release", BASE, release_tensors(BASE, seed=0))
    out = tmp_path / "shares.json"
    from dsr1.bench.cli import main

    assert main(["shares", "--index", str(folder), "--config", str(folder), "--target", "v5p-64",
                 "--mesh", "expert=8,tensor=4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    experts = sum(info.end - info.begin for name, info in CheckpointIndex.open(folder).tensors.items()
                  if ".mlp.experts." in name)
    assert result["hosts"] == len(rows) == 8 and all(r["chips"] == 4 for r in rows)
    assert len({r["bytes"] for r in rows}) == 1
    assert all(r["expert_bytes"] * 8 == experts for r in rows)
    assert rows[0]["bytes"] < result["checkpoint_bytes"] / 2 <= rows[0]["page_bytes"] * 8
    assert "| 7 | 4 |" in capsys.readouterr().out
