"""Redundant experts (EPLB, DeepSeek-V3 report): extra physical expert slots holding copies of the
hottest experts, so that no device of the expert axis gets much more than its share of the routed
pairs.

A placement maps, per MoE layer, each of `P = E + redundant` physical slots to the logical expert
it holds (`ExpertPlacement.physical [L, P]`); the physical slots are split over the expert axis like
the logical experts were (`P / devices` per device). `balance` derives one from routing statistics
(pairs routed to each expert per layer, `[L, E]`): each redundant slot goes to the expert with the
most pairs per copy (at most one copy per device), then the copies are dealt to devices heaviest
first, each to the least-loaded device with a free slot that does not hold that expert yet.

The model keeps routing over logical experts; `with_placement` stores the routed-expert stacks by
physical slot and adds the map as device arrays (`replicas [L, E, R]`, `replica_counts [L, E]`) to
the MoE parameters, and `moe.routed_experts` sends each (token, expert) pair to one copy of its
expert, spread by token (`physical_experts`). A copy holds the same weights, so the tokens are
unchanged. `dsr1.bench eplb` replays recorded routings and reports the load per device with and
without a placement. The serving engine counts the routing as it serves and moves the weights to a
new placement with `moved_to` (docs/serving.md, "Redundant experts").
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
    """The placement the weights hold (`with_placement`), or None."""
    stack = params.get(MOE_STACK, {}).get("moe", {})
    if "replicas" not in stack:
        return None
    replicas, counts = np.asarray(stack["replicas"]), np.asarray(stack["replica_counts"])
    gate = jax.tree.leaves(stack["gate"])[0]
    physical = np.zeros((replicas.shape[0], gate.shape[1]), np.int32)
    for layer, expert in np.ndindex(counts.shape):
        physical[layer, replicas[layer, expert, :counts[layer, expert]]] = expert
    return ExpertPlacement(physical, gate.shape[1] // gate.sharding.shard_shape(gate.shape)[1])


def with_placement(params: dict, placement: ExpertPlacement) -> dict:
    """The weights with each MoE layer's routed-expert stacks `[L, E, ...]` stored by physical slot
    `[L, P, ...]` (split over the expert axis as before) and the placement's map added to the MoE
    parameters (`replicas`, `replica_counts`). Takes the logical weights (a model without a placement)."""
    if "replicas" in params[MOE_STACK]["moe"]:
        raise ValueError("the weights already hold a placement: apply one to the logical weights, "
                         "or move them with `moved_to`")
    return _stored_by_slot(params, placement.physical, placement, placement.num_experts)


def moved_to(params: dict, placement: ExpertPlacement, *, donate: bool = False) -> dict:
    """Weights that hold a placement, moved to `placement` (of the same number of physical slots):
    each new slot takes the weights of a slot that held its expert, so tokens are unchanged. What a
    serving engine applies when it rebalances from the routing it collected. Device to device, a layer
    at a time (`_moved`); `donate`: in place, the given routed-expert arrays deleted (a device holds a
    few layer slices more at most; else a second copy of its stacks)."""
    stack = params[MOE_STACK]["moe"]
    if "replicas" not in stack:
        raise ValueError("the weights hold no placement: place logical weights with `with_placement`")
    held = np.asarray(stack["replicas"])[:, :, 0]  # [L, E]: a slot holding each expert now
    slots = jax.tree.leaves(stack["gate"])[0].shape[1]
    if placement.physical.shape != (held.shape[0], slots) or placement.num_experts != held.shape[1]:
        raise ValueError(f"a placement of {placement.physical.shape[0]} layers x {placement.physical.shape[1]} "
                         f"slots for {placement.num_experts} experts does not match the weights' "
                         f"{held.shape[0]} layers x {slots} slots for {held.shape[1]} experts")
    logical = {k: v for k, v in stack.items() if k not in ("replicas", "replica_counts")}
    return _stored_by_slot({**params, MOE_STACK: {**params[MOE_STACK], "moe": logical}},
                           np.take_along_axis(held, placement.physical, axis=1), placement, slots, donate)


def _stored_by_slot(params: dict, source: np.ndarray, placement: ExpertPlacement, rows: int,
                    donate: bool = False) -> dict:
    """`params` with each routed-expert stack `[L, rows, ...]`'s entry `[l, source[l, s]]` at `[l, s]`
    (split over the expert axis as before) and `placement`'s map added."""
    stack = params[MOE_STACK]["moe"]

    def by_slot(w: jax.Array) -> jax.Array:
        if w.shape[:2] != (source.shape[0], rows):
            raise ValueError(f"a routed-expert stack of shape {w.shape} does not match the placement's "
                             f"{source.shape[0]} layers x {rows} entries")
        if w.shape[1] != source.shape[1]:  # logical -> physical: the stack grows to P entries
            return jax.device_put(_taken(w, np.asarray(source, np.int32)), w.sharding)
        return _moved(w, source, donate)

    moved = {k: jax.tree.map(by_slot, stack[k]) for k in ("gate", "up", "down")}
    replicas, counts = placement.replicas()
    rep = jax.sharding.NamedSharding(jax.tree.leaves(stack["gate"])[0].sharding.mesh, jax.sharding.PartitionSpec())
    extra = {"replicas": jax.device_put(replicas, rep), "replica_counts": jax.device_put(counts, rep)}
    return {**params, MOE_STACK: {**params[MOE_STACK], "moe": {**stack, **moved, **extra}}}


@jax.jit
def _taken(w: jax.Array, source: jax.Array) -> jax.Array:
    """`w [L, E, ...]`'s entry `[l, source[l, s]]` at `[l, s]`."""
    return jax.vmap(lambda a, i: a[i])(w, source)


def _moved(w: jax.Array, source: np.ndarray, donate: bool) -> jax.Array:
    """`w [L, P, ...]` with entry `[l, source[l, s]]` at `[l, s]`, one layer at a time, each device
    sending its slots of the layer round the devices of the expert axis (`ppermute`) and keeping the
    ones its new slots need, so no device ever gathers a whole stack. `donate`: written into `w`'s
    own buffer layer by layer. The map is an argument of the programs, so a rebalance after the
    first compiles nothing."""
    spec = tuple(w.sharding.spec) + (None,) * (w.ndim - len(w.sharding.spec))
    mesh = w.sharding.mesh
    per = source.shape[1] // _ring_size(mesh, spec)
    holder, index = (source // per).astype(np.int32), (source % per).astype(np.int32)
    if not donate:
        return _moved_stack(w, holder, index, mesh=mesh, spec=spec)
    for layer in range(w.shape[0]):
        w = _moved_layer(w, holder, index, np.int32(layer), mesh=mesh, spec=spec)
    return w


def _ring_names(spec: tuple) -> tuple[str, ...]:
    """The mesh axes a stack's slots (its second dimension) are split over."""
    axis = spec[1]
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _ring_size(mesh: Mesh, spec: tuple) -> int:
    return int(np.prod([mesh.shape[name] for name in _ring_names(spec)]))


def _ring_move(mesh: Mesh, spec: tuple):
    """One layer's move as a `shard_map`: `(local slots, holder, index) -> new local slots`, where
    slot `s`'s weights come from slot `index[s]` of device `holder[s]` of the expert axis."""
    names, devices = _ring_names(spec), _ring_size(mesh, spec)

    def move(local: jax.Array, holder: jax.Array, index: jax.Array) -> jax.Array:
        me = jax.lax.axis_index(names) if names else 0
        out, chunk = jnp.zeros_like(local), local
        for step in range(devices):  # after `step` shifts, `chunk` is device (me - step)'s slots
            wanted = (holder == (me - step) % devices).reshape(-1, *(1,) * (local.ndim - 1))
            out = jnp.where(wanted, chunk[index], out)
            if step + 1 < devices:
                chunk = jax.lax.ppermute(chunk, names, [(d, (d + 1) % devices) for d in range(devices)])
        return out

    layer_spec, slot_spec = P(*spec[1:]), P(spec[1])
    return jax.shard_map(move, mesh=mesh, in_specs=(layer_spec, slot_spec, slot_spec), out_specs=layer_spec)


@functools.partial(jax.jit, static_argnames=("mesh", "spec"))
def _moved_stack(w: jax.Array, holder: jax.Array, index: jax.Array, *, mesh: Mesh, spec: tuple) -> jax.Array:
    moved = _ring_move(mesh, spec)
    out = jnp.stack([moved(w[i], holder[i], index[i]) for i in range(w.shape[0])])
    return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(*spec)))


@functools.partial(jax.jit, static_argnames=("mesh", "spec"), donate_argnums=0)
def _moved_layer(w: jax.Array, holder: jax.Array, index: jax.Array, layer: jax.Array, *, mesh: Mesh,
                 spec: tuple) -> jax.Array:
    return w.at[layer].set(_ring_move(mesh, spec)(w[layer], holder[layer], index[layer]))
