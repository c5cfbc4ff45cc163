"""Routed-expert kernels side by side on the first MoE layer of a model: `ragged_dot` (grouped
matmuls, the default on GPU and TPU), the expert loop (the default on CPU: each hit expert sliced in
place) and every expert on every token (`dense`: training on CPU). Per kernel and token count: the
time, the bytes of the distinct experts the tokens hit (what an ideal kernel reads), GB/s and
FLOP/s of the routed work, and how far the output is from the first kernel's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..api import Model
from ..core import moe
from ..core.sharding import put_replicated, to_host
from .accounting import expert_bytes
from .timing import best_of

KERNELS: dict[str, moe.ExpertKernel] = {"ragged_dot": moe.ragged_experts, "loop": moe.loop_experts,
                                        "gather": moe.gather_experts, "capacity": moe.capacity_experts,
                                        "dense": moe.dense_experts}
EXPERT_COLUMNS = ("kernel", "tokens", "ms", "experts_hit", "mb_hit", "gb_s", "gflop_s", "max_rel_diff")


def routed_inputs(model: Model, tokens: int, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random activations `[tokens, D]` in the model's dtype, routed by the first MoE layer's router:
    `(x, weights [tokens, K], experts [tokens, K])`, replicated on the model's mesh."""
    cfg, layer = model.cfg, model.params["moe_layers"]["moe"]
    x = np.random.default_rng(seed).standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
    x = put_replicated(x, model.mesh).astype(model.dtype)
    weights, experts = jax.jit(moe.route, static_argnames="cfg")(x, layer["router"][0], layer["router_bias"][0],
                                                                  cfg=cfg)
    return x, weights, experts


def time_kernel(model: Model, kernel: moe.ExpertKernel, inputs: tuple[jax.Array, ...],
                repeats: int = 2) -> tuple[float, np.ndarray]:
    """The fastest of `repeats` runs of `kernel` on the first MoE layer (after a compiling warm-up),
    and its output `[tokens, D]` on the host."""
    layer = model.params["moe_layers"]["moe"]

    @jax.jit
    def run(layer: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        return moe.routed_experts(layer, x, weights, experts, model.mesh, model.rules, jnp.int32(0), kernel=kernel)

    seconds, out = best_of(lambda: run(layer, *inputs), repeats)
    return seconds, to_host(out)


def kernel_row(model: Model, name: str, experts: np.ndarray, seconds: float, out: np.ndarray,
               reference: np.ndarray) -> dict[str, Any]:
    """One line of the table: `experts [tokens, K]` as routed, `out` against `reference`."""
    cfg = model.cfg
    tokens = experts.shape[0]
    hit = len(np.unique(experts))
    nbytes = hit * expert_bytes(model.params)
    flop = 2 * tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return {"kernel": name, "tokens": tokens, "ms": 1e3 * seconds, "experts_hit": hit, "mb_hit": nbytes / 1e6,
            "gb_s": nbytes / seconds / 1e9, "gflop_s": flop / seconds / 1e9,
            "max_rel_diff": float(np.abs(out - reference).max() / max(np.abs(reference).max(), 1e-30))}


def bench_kernels(model: Model, names: list[str], tokens: list[int], repeats: int = 2, seed: int = 0,
                  log=lambda msg: None) -> list[dict[str, Any]]:
    """Every kernel of `names` at every token count, the first kernel's output the reference."""
    if "moe_layers" not in model.params:
        raise ValueError("the model has no MoE layer")
    rows = []
    for n in tokens:
        inputs = routed_inputs(model, n, seed)
        experts = to_host(inputs[2])
        reference = None
        for name in names:
            log(f"{n} tokens, {name}: compile, warm up, time ...")
            seconds, out = time_kernel(model, KERNELS[name], inputs, repeats)
            reference = out if reference is None else reference
            rows.append(kernel_row(model, name, experts, seconds, out, reference))
            log(f"    {rows[-1]['ms']:.2f} ms")
    return rows
