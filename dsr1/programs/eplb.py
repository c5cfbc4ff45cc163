"""Redundant experts' weight moves (`dsr1.core.eplb`: the placements): the routed-expert stacks
stored by physical slot (`with_placement`), and moved from one placement to another device to
device, a layer at a time (`moved_to`, what a serving engine applies when it rebalances).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.eplb import MOE_STACK, ExpertPlacement

__all__ = ["moved_to", "with_placement"]


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
