"""`python -m dsr1.bench eplb`: what redundant experts (`dsr1.core.eplb`) do to the load per device.

Records the routed experts of every MoE layer while a model decodes greedily from a set of prompts
(or reads routings recorded before, `--routing PATH`, and writes them with `--record PATH`), then
replays them: the first half of the decode steps are the statistics a placement is derived from,
the second half is what it is judged on. For each number of redundant slots it reports, per MoE
layer and on average, the busiest device's pairs over the mean (1.0 is perfect balance) with the
plain placement (expert i on device i * devices / E) and with the balanced one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import programs
from ..core import eplb
from ..generation.tokenizer import load_tokenizer
from ..options import add_model_options, model_from_options, positive_int, positive_ints

PROMPTS = [
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "Friends, Romans, countrymen, lend me your ears;",
    "All the world's a stage, and all the men and women merely players.",
    "O Romeo, Romeo, wherefore art thou Romeo?",
    "What's in a name? That which we call a rose",
    "The quality of mercy is not strained;",
    "If music be the food of love, play on;",
]


def add_eplb_options(p: argparse.ArgumentParser) -> None:
    add_model_options(p, default_preset=None)
    p.add_argument("--devices", type=positive_int, default=4,
                   help="devices of the expert axis the experts are placed on (default: 4)")
    p.add_argument("--redundant", type=positive_ints, default=[4, 8],
                   help="redundant expert slots per MoE layer to compare, comma-separated (default: 4,8)")
    p.add_argument("--steps", type=positive_int, default=64, help="greedy decode steps recorded (default: 64)")
    p.add_argument("--routing", metavar="PATH", help="replay these routings (.npy, [tokens, MoE layers, K]) "
                   "instead of recording")
    p.add_argument("--record", metavar="PATH", help="also write the recorded routings to PATH (.npy)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def record_routing(model: Any, prompts: list[str], steps: int) -> np.ndarray:
    """The routed expert ids `[steps * rows, MoE layers, K]` of `steps` greedy decode steps from `prompts`."""
    tokenizer = model.tokenizer or load_tokenizer()
    rows = [tokenizer.encode(p) for p in prompts]
    width = max(map(len, rows))
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)
    logits, cache = programs.prefill(model.params, tokens, lengths, max_len=width + steps + 1,
                                     kv_cache_dtype=model.kv_cache_dtype, **model.program_kwargs)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    _, _, ids, _ = programs.greedy_decode(model.params, cache, first, steps=steps, **model.program_kwargs)
    ids = np.asarray(jax.device_get(ids))  # [steps, L, B, K]
    return ids.transpose(0, 2, 1, 3).reshape(-1, ids.shape[1], ids.shape[3])


def expert_load(routing: np.ndarray, experts: int) -> np.ndarray:
    """Pairs routed to each expert per MoE layer `[L, E]` from routings `[tokens, L, K]`."""
    return np.stack([np.bincount(routing[:, layer].reshape(-1), minlength=experts)
                     for layer in range(routing.shape[1])]).astype(np.float64)


def imbalance(load: np.ndarray, placement: eplb.ExpertPlacement) -> np.ndarray:
    """Per MoE layer: the busiest device's pairs over the mean device's."""
    per_device = eplb.device_load(load, placement)
    return per_device.max(1) / np.maximum(per_device.mean(1), 1e-9)


def compare(routing: np.ndarray, experts: int, devices: int, redundant: list[int]) -> dict[str, Any]:
    """Placements derived from the first half of `routing`, judged on the second half."""
    half = routing.shape[0] // 2
    seen, replay = expert_load(routing[:half], experts), expert_load(routing[half:], experts)
    plain = imbalance(replay, eplb.identity_placement(replay.shape[0], experts, devices))
    rows = [{"redundant": 0, "max_over_mean": plain.tolist(), "mean": float(plain.mean())}]
    for r in redundant:
        balanced = imbalance(replay, eplb.balance(seen, devices, r))
        rows.append({"redundant": r, "max_over_mean": balanced.tolist(), "mean": float(balanced.mean())})
    return {"tokens": int(routing.shape[0]), "statistics_tokens": half, "experts": experts, "devices": devices,
            "rows": rows}


def report(result: dict[str, Any]) -> str:
    layers = len(result["rows"][0]["max_over_mean"])
    lines = [f"expert load per device, busiest / mean (1.00: balanced): {result['experts']} experts on "
             f"{result['devices']} devices; placement from {result['statistics_tokens']} tokens' routing, "
             f"judged on the next {result['tokens'] - result['statistics_tokens']}", "",
             "| redundant slots | " + " | ".join(f"layer {i}" for i in range(layers)) + " | mean |",
             "|--:|" + "--:|" * (layers + 1)]
    for row in result["rows"]:
        name = "0 (plain)" if row["redundant"] == 0 else str(row["redundant"])
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row["max_over_mean"]) + f" | {row['mean']:.2f} |")
    return "\n".join(lines)


def run_eplb(args: argparse.Namespace) -> dict[str, Any]:
    """The `eplb` command."""
    model = model_from_options(args)
    experts = model.cfg.n_routed_experts
    for r in args.redundant:
        if (experts + r) % args.devices:
            raise SystemExit(f"--redundant {r}: {experts} experts + {r} do not split over --devices {args.devices}")
    if args.routing:
        routing = np.load(args.routing)
        if routing.ndim != 3 or routing.shape[1] != model.cfg.num_moe_layers or routing.max() >= experts:
            raise SystemExit(f"--routing {args.routing}: expected [tokens, {model.cfg.num_moe_layers}, K] expert ids "
                             f"below {experts}, got shape {routing.shape}")
    else:
        print(f"recording {args.steps} decode steps of {len(PROMPTS)} prompts ...", file=sys.stderr, flush=True)
        routing = record_routing(model, PROMPTS, args.steps)
    if args.record:
        np.save(args.record, routing)
    result = compare(routing, experts, args.devices, args.redundant)
    print(report(result))
    return {"command": "eplb", **result}
