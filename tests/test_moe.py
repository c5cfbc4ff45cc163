"""Routing and the routed-expert block against a straightforward per-token numpy implementation."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import dsr1
from dsr1.core.moe import moe, route
from dsr1.core.sharding import DEFAULT_RULES
from dsr1.cpu import ffi as cpu_kernels
from dsr1.cpu import products as cpu_products
from dsr1.cpu.ffi import KERNEL_ROWS

from .harness import TINY, count_products


def numpy_route(x, router, bias, cfg):
    """DeepSeek-V3 routing written token by token, as the paper describes it."""
    weights, experts = [], []
    per_group = cfg.n_routed_experts // cfg.n_group
    for token in x.astype(np.float64):
        s = 1 / (1 + np.exp(-(token @ router)))
        biased = s + bias
        group_score = [np.sort(biased[g * per_group:(g + 1) * per_group])[-2:].sum() for g in range(cfg.n_group)]
        kept = np.argsort(group_score)[::-1][:cfg.topk_group]
        allowed = np.full_like(biased, -np.inf)
        for g in kept:
            allowed[g * per_group:(g + 1) * per_group] = biased[g * per_group:(g + 1) * per_group]
        chosen = np.argsort(allowed)[::-1][:cfg.num_experts_per_tok]
        w = s[chosen]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        weights.append(w * cfg.routed_scaling_factor)
        experts.append(chosen)
    return np.array(weights), np.array(experts)


def numpy_moe(x, p, cfg):
    def silu(z):
        return z / (1 + np.exp(-z))

    weights, experts = numpy_route(x, p["router"], p["router_bias"], cfg)
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            h = silu(x[t] @ p["gate"][e]) * (x[t] @ p["up"][e])
            out[t] += w * (h @ p["down"][e])
        s = p["shared"]
        out[t] += (silu(x[t] @ s["gate"]) * (x[t] @ s["up"])) @ s["down"]
    return out


def _moe_params(cfg, seed=0):
    model = dsr1.init_random(cfg, seed=seed, dtype="float32")
    layer0 = jax.tree.map(lambda a: np.asarray(a[0]), model.params["moe_layers"]["moe"])
    layer0["router_bias"] = np.random.default_rng(seed).uniform(-0.05, 0.05, cfg.n_routed_experts).astype(np.float32)
    return model.mesh, layer0


@pytest.mark.parametrize("variant", [
    {}, {"norm_topk_prob": False}, {"n_group": 1, "topk_group": 1}, {"n_group": 8, "topk_group": 3},
])
@pytest.mark.slow
def test_route_matches_numpy(variant):
    cfg = dataclasses.replace(TINY, **variant)
    _, p = _moe_params(cfg)
    x = np.random.default_rng(1).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    weights, experts = route(x, p["router"], p["router_bias"], cfg)
    ref_w, ref_e = numpy_route(x, p["router"], p["router_bias"], cfg)
    order = np.argsort(np.asarray(experts), axis=1)
    ref_order = np.argsort(ref_e, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(ref_e, ref_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(ref_w, ref_order, 1), rtol=1e-6)


@pytest.mark.slow
def test_bias_selects_but_does_not_weigh():
    """A huge bias on one expert forces its selection; its weight is still its unbiased score."""
    cfg = dataclasses.replace(TINY, norm_topk_prob=False, routed_scaling_factor=1.0)
    _, p = _moe_params(cfg)
    x = np.random.default_rng(2).standard_normal((16, cfg.hidden_size)).astype(np.float32)
    bias = np.zeros(cfg.n_routed_experts, np.float32)
    bias[5] = 100.0
    weights, experts = map(np.asarray, route(x, p["router"], bias, cfg))
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ p["router"])))
    assert (experts == 5).any(axis=1).all()
    np.testing.assert_allclose(weights[experts == 5], scores[:, 5], rtol=1e-6)


@pytest.mark.slow
def test_group_limit_is_respected():
    cfg = TINY
    _, p = _moe_params(cfg)
    x = np.random.default_rng(3).standard_normal((128, cfg.hidden_size)).astype(np.float32)
    _, experts = route(x, p["router"], p["router_bias"], cfg)
    groups = np.asarray(experts) // (cfg.n_routed_experts // cfg.n_group)
    assert max(len(set(row)) for row in groups) <= cfg.topk_group


@pytest.mark.slow
def test_moe_block_matches_numpy():
    cfg = TINY
    mesh, p = _moe_params(cfg)
    x = np.random.default_rng(4).standard_normal((24, cfg.hidden_size)).astype(np.float32)
    ours = np.asarray(jax.jit(lambda p, x: moe(p, x, cfg, mesh, DEFAULT_RULES)[0])(p, x))
    ref = numpy_moe(x, p, cfg)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"\nMoE block (ragged_dot, sorted pairs) vs per-token numpy loop: {err:.1e}")
    assert err < 1e-5


@pytest.mark.parametrize("tokens", [1, 8, 9, 100])
@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.slow
def test_every_kernel_matches_ragged_dot_in_place(tokens, quant):
    """The CPU expert loop (one expert of one layer sliced in place per block of sorted rows; 9 and
    100 tokens give blocks of several rows and experts spanning several blocks), the GPU kernels
    (each pair's expert gathered; per-expert buffers) equal `ragged_dot` on the same stacked weights,
    float32 and int8."""
    from dsr1.core.moe import loop_block_rows

    from .moe_worker import kernel_outputs

    cfg = TINY
    model = dsr1.init_random(cfg, seed=5, dtype="float32", quant=quant)
    outputs = kernel_outputs(model, tokens)
    assert loop_block_rows(tokens, tokens * cfg.num_experts_per_tok, cfg.n_routed_experts) <= tokens
    ref = outputs.pop("ragged_dot")
    for name, out in outputs.items():
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max(), err_msg=name)


@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("dtype,quant", [("bfloat16", None), ("float32", "int8")])
@pytest.mark.slow
def test_expert_loop_reads_experts_transposed_for_blocks_of_few_rows(tokens, dtype, quant, cpu_kernel, monkeypatch):
    """On CPU the bf16 and int8 expert stacks also hold their values transposed, `[L, E, out, in]`.
    dsr1's CPU kernel reads that copy in place for the loop's blocks of up to `KERNEL_ROWS` rows;
    without it (`DSR1_CPU_KERNELS=0`) blocks of up to `expert_rows` rows (bf16: 2, decode; int8: 4, a
    short prefill too) multiply each row against it in XLA (int8: then scale it). Either way the result
    equals `ragged_dot` on the `[in, out]` values (all widen exactly and sum in float32). 16 tokens run
    blocks of 4 here. bf16 with the kernel and at most `KERNEL_ROWS` tokens: the pairs go to the
    kernel as routed, two calls (`swiglu_pairs`, `combine_pairs`), no blocks."""
    import dsr1.core.moe as moe_module

    from .moe_worker import kernel_outputs

    model = dsr1.init_random(TINY, seed=5, dtype=dtype, quant=quant)
    gate = model.params["moe_layers"]["moe"]["gate"]
    if not cpu_kernel:  # without the backend the stacks hold their values once; XLA's products take bf16
        assert not hasattr(gate, "transposed")  # operands as on accelerators: equal to bf16's rounding
        outputs = kernel_outputs(model, tokens)
        ref = outputs.pop("ragged_dot")
        tol = 2e-2 if dtype == "bfloat16" else 2e-5
        for name, out in outputs.items():
            np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max(), err_msg=name)
        return
    values = gate.q if quant else gate.bits
    np.testing.assert_array_equal(np.asarray(gate.transposed), np.swapaxes(np.asarray(values), -1, -2))
    calls = count_products(monkeypatch, cpu_products)
    outputs = kernel_outputs(model, tokens)
    block = moe_module.loop_block_rows(tokens, tokens * TINY.num_experts_per_tok, TINY.n_routed_experts)
    limit = KERNEL_ROWS if cpu_kernel else gate.expert_rows
    as_pairs = cpu_kernel and dtype == "bfloat16" and tokens <= KERNEL_ROWS
    assert calls["swiglu_pairs"] + calls["combine_pairs"] == ([tokens, tokens] if as_pairs else []), calls
    fused = calls["swiglu_rows_dot"] + calls["combine_rows_dot"]  # bf16 with the kernel: two calls, not three
    taken, other = (calls["kernel_matmul"] + fused, calls["rowwise_matmul"]) if cpu_kernel else (
        calls["rowwise_matmul"], calls["kernel_matmul"] + fused)
    if as_pairs:  # no blocks
        assert not taken, calls
    elif block <= limit:  # the loop's gate, up and down products took the copy
        assert taken and set(taken) <= {block}, calls
        assert not cpu_kernel or (len(fused) == 2) == (dtype == "bfloat16"), calls
    else:
        assert not taken, calls
    assert not other, calls
    assert tokens != 16 or block == 4  # the case where, without the kernel, int8 reads the copy and bf16 does not
    ref = outputs.pop("ragged_dot")
    for name, out in outputs.items():
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max(), err_msg=name)


def _bf16_blocks_here() -> bool:
    return cpu_kernels.amx_available() or cpu_kernels.available() and cpu_kernels._bf16_dot_rate() > 0


@pytest.mark.skipif(not _bf16_blocks_here(), reason="neither AMX nor AVX-512 BF16 here (or no kernel build)")
@pytest.mark.parametrize("tokens", [64, 100])
def test_expert_loop_runs_blocks_of_many_rows_in_bf16(tokens, monkeypatch):
    """bf16 blocks of 16 or more rows (64 tokens: blocks of 16, full; 100: of 32, partly full) go to
    the kernel reading the experts in place, one call per product: AMX tiles where the CPU has them,
    else `vdpbf16ps` (`DSR1_BF16_ROWS=1`), whose down product sums each row into its token in the same
    call (`combine_rows_dot`); the rows rounded to bf16 as XLA's bf16 dot on the
    expert's slice (the path without either) rounds them, so both agree to float32 sums, but for the
    down product's rows (SiLU(gate) x up, rounded to bf16) whose float32 sums, in another order, round
    to the next bf16 value (2^-8 apart) here and there: on Zen 5, 11 of 12,800 outputs at 100 tokens
    differ by more than 1e-5 of the largest, by at most 2e-5 (none at 64 tokens; none on the AMX
    Xeon). A changed sum or a wrong row moves far more values, by far more."""
    import dsr1.core.moe as moe_module

    from .moe_worker import kernel_outputs

    monkeypatch.setenv("DSR1_BF16_ROWS", "1")
    model = dsr1.init_random(TINY, seed=5, dtype="bfloat16")
    block = moe_module.loop_block_rows(tokens, tokens * TINY.num_experts_per_tok, TINY.n_routed_experts)
    calls = count_products(monkeypatch, cpu_products)
    jax.clear_caches()
    bf16 = kernel_outputs(model, tokens)["loop"]
    amx = cpu_kernels.amx_available()
    expected = {"kernel_matmul": [block] * (3 if amx else 2), "combine_rows_dot": [] if amx else [block]}
    assert block >= 16 and {name: calls[name] for name in expected} == expected, calls
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)
    monkeypatch.setenv("DSR1_BF16_ROWS", "0")
    jax.clear_caches()
    xla = kernel_outputs(model, tokens)["loop"]
    assert {name: calls[name] for name in expected} == expected, calls  # (the XLA path calls no kernel)
    error, scale = np.abs(bf16 - xla), np.abs(xla).max()
    assert np.mean(error <= 1e-5 * scale) > 0.995 and error.max() < 1e-4 * scale, (np.mean(error <= 1e-5 * scale),
                                                                                  error.max() / scale)


@pytest.mark.slow
def test_capacity_kernel_runs_the_rows_past_capacity_in_more_rounds():
    """Dropless: 40 tokens all routed to the same 4 experts give each 40 rows, 2.5x its buffer's 16
    (160 pairs on 16 experts), so three rounds run, and every row counts."""
    from dsr1.core.moe import capacity_rows

    from .moe_worker import kernel_outputs

    cfg = TINY
    model = dsr1.init_random(cfg, seed=7, dtype="float32")
    tokens, k = 40, cfg.num_experts_per_tok
    experts = np.tile(np.arange(k, dtype=np.int32), (tokens, 1))
    assert capacity_rows(tokens * k, cfg.n_routed_experts) * 2 < tokens  # several rounds
    outputs = kernel_outputs(model, tokens, experts)
    ref = outputs["ragged_dot"]
    np.testing.assert_allclose(outputs["capacity"], ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_default_kernel_by_platform_and_size():
    """CPU: the expert loop at every size. GPU: each pair's expert gathered while the pairs are at
    most half the experts (R1 decode up to batch 16), per-expert buffers beyond. TPU: the grouped-matmul
    kernel."""
    import dsr1.core.moe as moe_module

    assert moe_module.default_kernel(8, 256) is moe_module.loop_experts  # this machine: CPU
    for backend, small, large in (("cpu", moe_module.loop_experts, moe_module.loop_experts),
                                  ("gpu", moe_module.gather_experts, moe_module.capacity_experts),
                                  ("tpu", moe_module.grouped_experts, moe_module.grouped_experts)):
        kernels = (moe_module.default_kernel(128, 256, backend), moe_module.default_kernel(129, 256, backend))
        assert kernels == (small, large), backend
    assert [moe_module.capacity_rows(p, 256) for p in (8, 512, 2048, 32768)] == [8, 8, 16, 192]


def test_expert_loop_blocks_follow_the_mean_rows_per_expert():
    """Blocks hold the mean pairs per expert, rounded up to a power of two, at least 2 rows and at
    most the tokens: a decode batch of 8 on 64 experts (top-6) runs blocks of 2, not all 8 tokens."""
    from dsr1.core.moe import loop_block_rows

    assert [loop_block_rows(n, 6 * n, 64) for n in (1, 2, 8, 16, 32, 256)] == [1, 2, 2, 2, 4, 32]


@pytest.mark.slow
@pytest.mark.parametrize("expert,tensor", [(8, 1), (4, 2)])
def test_expert_loop_matches_ragged_dot_on_eight_devices(expert, tensor):
    """Expert and tensor parallelism: on 8 fake CPU devices, each device's loop over its own experts
    (and ffw slice), summed over the mesh, equals `ragged_dot`'s, float32, int8 and bf16 (whose
    decode blocks read the transposed copy, split over the mesh like the weight)."""
    import json
    import subprocess
    import sys

    from .harness import subprocess_env

    done = subprocess.run([sys.executable, "-m", "tests.moe_worker", f"--expert={expert}", f"--tensor={tensor}"],
                          env=subprocess_env(8, optimized=True), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n[{expert} x {tensor}] expert loop vs ragged_dot: {errors}")
    assert max(errors.values()) < 2e-5, errors


@pytest.mark.slow
def test_training_path_matches_ragged_dot_with_gradients(monkeypatch):
    """The differentiable expert path of CPU training (every expert on every token, weighted by the
    routing) equals `ragged_dot` on the same routing, in value and in the gradients of every weight."""
    import dsr1.core.moe as moe_module

    cfg = TINY
    mesh, p = _moe_params(cfg, seed=6)
    x = np.random.default_rng(6).standard_normal((2, 20, cfg.hidden_size)).astype(np.float32)

    def loss(p, x):
        out, _ = moe(p, x, cfg, mesh, DEFAULT_RULES, differentiable=True)
        return (out * np.linspace(-1, 1, out.size).reshape(out.shape)).sum(), out

    results = {}
    for dense in (True, False):
        kernel = moe_module.dense_experts if dense else moe_module.ragged_experts
        monkeypatch.setattr(moe_module, "differentiable_kernel", lambda platform, kernel=kernel: kernel)
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)
        results[dense] = (out, grads)
    (out_dense, grads_dense), (out_ragged, grads_ragged) = results[True], results[False]
    np.testing.assert_allclose(out_dense, out_ragged, rtol=1e-5, atol=1e-5 * np.abs(out_ragged).max())
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_dense), jax.tree.leaves(grads_ragged)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(np.abs(b).max(), 1e-30),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [8, 64])
def test_batch_invariant_experts_sum_a_row_the_same_whatever_its_neighbours_pick(tokens):
    """`ShardingRules(batch_invariant=True)` (the serving engine's `batch_invariant`): a row's routed-expert
    output is bit for bit the same whether the call's other rows picked its experts or others. The CPU
    backend's expert kernels sum a row by how many rows share its expert; the loop's blocks have one
    shape whatever the routing (decode's 8 rows, a prefill's 64)."""
    from dsr1.core.moe import routed_experts

    model = dsr1.init_random(TINY, seed=5, dtype="bfloat16")
    rules = dataclasses.replace(model.rules, batch_invariant=True)
    k, rng = TINY.num_experts_per_tok, np.random.default_rng(0)
    x = rng.standard_normal((tokens, TINY.hidden_size)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    shared = np.tile(np.arange(k, dtype=np.int32), (tokens, 1))  # every row picks row 0's experts
    apart = shared.copy()
    apart[1:] = np.arange(k, 2 * k)  # the others pick other experts
    run = jax.jit(lambda x, w, e: routed_experts(model.params["moe_layers"]["moe"], x, w, e, model.mesh, rules,
                                                 layer=1))
    np.testing.assert_array_equal(np.asarray(run(x, weights, shared))[0], np.asarray(run(x, weights, apart))[0])
