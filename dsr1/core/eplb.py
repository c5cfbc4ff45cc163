"""Redundant experts (EPLB, DeepSeek-V3 report): extra physical expert slots holding copies of the
hottest experts, so that no device of the expert axis gets much more than its share of the routed
pairs.

A placement maps, per MoE layer, each of `P = E + redundant` physical slots to the logical expert
it holds (`ExpertPlacement.physical [L, P]`); the physical slots are split over the expert axis like
the logical experts were (`P / devices` per device). `balance` derives one from routing statistics
(pairs routed to each expert per layer, `[L, E]`): each redundant slot goes to the expert with the
most pairs per copy (at most one copy per device), then the copies are dealt to devices heaviest
first, each to the least-loaded device with a free slot that does not hold that expert yet.

The model keeps routing over logical experts; `dsr1.programs.eplb.with_placement` stores the
routed-expert stacks by physical slot and adds the map as device arrays (`replicas [L, E, R]`,
`replica_counts [L, E]`) to the MoE parameters, and `moe.routed_experts` sends each (token, expert)
pair to one copy of its expert, spread by token (`physical_experts`). A copy holds the same weights,
so the tokens are unchanged. `dsr1.bench eplb` replays recorded routings and reports the load per
device with and without a placement. The serving engine counts the routing as it serves and moves
the weights to a new placement with `dsr1.programs.eplb.moved_to` (docs/serving.md, "Redundant
experts").
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np

MOE_STACK = "moe_layers"


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """`physical [L, P]` int32: the logical expert each physical slot holds, per MoE layer; slots
    `[d * P/devices, (d + 1) * P/devices)` are device d's."""

    physical: np.ndarray
    devices: int

    @property
    def num_experts(self) -> int:
        return int(self.physical.max()) + 1

    def replicas(self) -> tuple[np.ndarray, np.ndarray]:
        """`(replicas [L, E, R], counts [L, E])`: each logical expert's physical slots (padded with the
        first), and how many."""
        layers, e = self.physical.shape[0], self.num_experts
        counts = np.stack([np.bincount(row, minlength=e) for row in self.physical]).astype(np.int32)
        table = np.zeros((layers, e, int(counts.max())), np.int32)
        for layer, row in enumerate(self.physical):
            for expert in range(e):
                slots = np.flatnonzero(row == expert)
                table[layer, expert] = np.resize(slots, table.shape[2])
        return table, counts


def identity_placement(layers: int, experts: int, devices: int) -> ExpertPlacement:
    """No redundant slot: physical slot i holds expert i."""
    return ExpertPlacement(np.tile(np.arange(experts, dtype=np.int32), (layers, 1)), devices)


def balance(load: np.ndarray, devices: int, redundant: int) -> ExpertPlacement:
    """A placement of `E + redundant` physical slots per layer over `devices` from `load [L, E]` (pairs
    routed to each logical expert). `E + redundant` must divide by `devices`."""
    load = np.asarray(load, np.float64)
    layers, e = load.shape
    slots = e + redundant
    if redundant < 0 or slots % devices:
        raise ValueError(f"{e} experts + {redundant} redundant slots do not split over {devices} devices")
    physical = np.zeros((layers, slots), np.int32)
    for layer in range(layers):
        physical[layer] = _place_layer(load[layer], devices, redundant)
    return ExpertPlacement(physical, devices)


def _place_layer(load: np.ndarray, devices: int, redundant: int) -> np.ndarray:
    e = load.shape[0]
    copies = np.ones(e, np.int64)
    heap = [(-load[i], i) for i in range(e)]  # most pairs per copy first
    heapq.heapify(heap)
    for _ in range(redundant):
        # More copies than devices split nothing: an expert stops taking copies at one per device.
        i = heapq.heappop(heap)[1] if heap else int(np.argmin(copies))
        copies[i] += 1
        if copies[i] < devices:
            heapq.heappush(heap, (-load[i] / copies[i], i))
    per_device = (e + redundant) // devices
    items = sorted(((load[i] / copies[i], i) for i in range(e) for _ in range(copies[i])), key=lambda t: (-t[0], t[1]))
    held: list[list[int]] = [[] for _ in range(devices)]
    device_load = np.zeros(devices)
    for share, expert in items:
        free = [d for d in range(devices) if len(held[d]) < per_device]
        fresh = [d for d in free if expert not in held[d]] or free
        d = min(fresh, key=lambda d: (device_load[d], d))
        held[d].append(expert)
        device_load[d] += share
    return np.array([x for d in range(devices) for x in sorted(held[d])], np.int32)


def device_load(load: np.ndarray, placement: ExpertPlacement) -> np.ndarray:
    """Pairs per device `[L, devices]` when each expert's pairs `load [L, E]` are spread evenly over its
    copies."""
    _, counts = placement.replicas()
    layers, slots = placement.physical.shape
    per_slot = np.take_along_axis(np.asarray(load, np.float64) / counts, placement.physical, axis=1)
    return per_slot.reshape(layers, placement.devices, slots // placement.devices).sum(-1)


def physical_experts(experts: jax.Array, replicas: jax.Array, counts: jax.Array) -> jax.Array:
    """Logical expert ids `[N, K]` (one layer) -> physical slots: pair (n, k) goes to copy
    `(n + k) mod count` of its expert (`replicas [E, R]`, `counts [E]`), spreading a hot expert's
    pairs over its copies."""
    n, k = experts.shape
    copy = (jnp.arange(n)[:, None] + jnp.arange(k)[None, :]) % counts[experts]
    return replicas[experts, copy]


def placement_of(params: dict) -> ExpertPlacement | None:
    """The placement the weights hold (`dsr1.programs.eplb.with_placement`), or None."""
    stack = params.get(MOE_STACK, {}).get("moe", {})
    if "replicas" not in stack:
        return None
    replicas, counts = np.asarray(stack["replicas"]), np.asarray(stack["replica_counts"])
    gate = jax.tree.leaves(stack["gate"])[0]
    physical = np.zeros((replicas.shape[0], gate.shape[1]), np.int32)
    for layer, expert in np.ndindex(counts.shape):
        physical[layer, replicas[layer, expert, :counts[layer, expert]]] = expert
    return ExpertPlacement(physical, gate.shape[1] // gate.sharding.shard_shape(gate.shape)[1])
