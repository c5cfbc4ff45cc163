"""Compare the routed-expert kernels (the CPU expert loop and `ragged_dot`) on a mesh of fake CPU
devices; prints the worst relative difference per case as JSON.

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


def compare(expert: int, tensor: int, quant: str | None, tokens: int) -> float:
    """Routed experts of layer 1 (stacked weights, in place) by both kernels on an expert x tensor mesh."""
    cfg = dsr1.Config.preset("tiny")
    mesh = dsr1.make_mesh(expert=expert, tensor=tensor)
    model = dsr1.init_random(cfg, seed=3, dtype="float32", quant=quant, mesh=mesh)
    p = model.params["moe_layers"]["moe"]
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
    experts = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False)
                        for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, experts.shape).astype(np.float32)
    outputs = []
    for loop in (True, False):
        moe_module.use_gather = lambda n_pairs, n_local, loop=loop: loop
        run = jax.jit(lambda p, x, w, e: routed_experts(p, x, w, e, mesh, model.rules, layer=1))
        outputs.append(np.asarray(run(p, x, weights, experts)))
    return float(np.abs(outputs[0] - outputs[1]).max() / np.abs(outputs[1]).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expert", type=int, required=True)
    ap.add_argument("--tensor", type=int, required=True)
    args = ap.parse_args()
    print(json.dumps({f"{quant} x {tokens}": compare(args.expert, args.tensor, quant, tokens)
                      for quant in (None, "int8") for tokens in (1, 8, 40)}))


if __name__ == "__main__":
    main()
