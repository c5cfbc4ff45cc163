"""Compare the routed-expert kernels (the CPU expert loop, the GPU gather and capacity kernels, and
`ragged_dot`) on a mesh of fake CPU devices; prints the worst relative difference per case as JSON.

Used by test_moe.py in a subprocess, because the device count (XLA_FLAGS) must be set before JAX starts.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import dsr1
import dsr1.core.moe as moe_module
from dsr1.core.moe import routed_experts

from .harness import TINY

KERNELS = {"ragged_dot": moe_module.ragged_experts, "loop": moe_module.loop_experts,
           "gather": moe_module.gather_experts, "capacity": moe_module.capacity_experts}


def kernel_outputs(model: dsr1.Model, tokens: int, experts: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Layer 1's routed experts (stacked weights, in place) on `tokens` random rows by each kernel of
    `KERNELS`; `experts [tokens, K]` the routing (default: random distinct experts per token)."""
    cfg = model.cfg
    p = model.params["moe_layers"]["moe"]
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
    if experts is None:
        experts = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False)
                            for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, experts.shape).astype(np.float32)
    outputs = {}
    for name, kernel in KERNELS.items():
        run = jax.jit(lambda p, x, w, e, kernel=kernel: routed_experts(p, x, w, e, model.mesh, model.rules, layer=1,
                                                                        kernel=kernel))
        outputs[name] = np.asarray(run(p, x, weights, experts))
    return outputs


def compare(model: dsr1.Model, tokens: int) -> float:
    """The worst relative difference of any kernel from `ragged_dot` on `model`'s mesh."""
    outputs = kernel_outputs(model, tokens)
    ref = outputs["ragged_dot"]
    return max(float(np.abs(out - ref).max() / np.abs(ref).max()) for out in outputs.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expert", type=int, required=True)
    ap.add_argument("--tensor", type=int, required=True)
    args = ap.parse_args()
    mesh = dsr1.make_mesh(expert=args.expert, tensor=args.tensor)
    errors = {}
    # bf16 decode blocks (one or two rows) read the experts' transposed copy (`quant.rowwise_matmul`).
    cases = (("float32", None, (1, 8, 40)), ("float32", "int8", (1, 8, 40)), ("bfloat16", None, (1, 8)))
    for dtype, quant, sizes in cases:
        model = dsr1.init_random(TINY, seed=3, dtype=dtype, quant=quant, mesh=mesh)
        errors |= {f"{quant if dtype == 'float32' else dtype} x {tokens}": compare(model, tokens) for tokens in sizes}
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
