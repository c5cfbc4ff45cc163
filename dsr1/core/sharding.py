"""The device mesh and the logical-axis rules: the only module that names mesh axes.

Every weight and activation elsewhere speaks *logical* axes ("heads", "experts", ...); the table
below maps each to a mesh axis (or to None: replicated). Low-latency decode layout: activations
replicated, attention heads and ffw split over `tensor`, routed experts over `expert`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

EXPERT = "expert"
TENSOR = "tensor"
MESH_AXES = (EXPERT, TENSOR)

LOGICAL_RULES: dict[str, str | None] = {
    "layers": None,
    "vocab": TENSOR,
    "embed": None,
    "q_lora": None,
    "kv_lora": None,
    "heads": TENSOR,
    "head_dim": None,
    "ffw": TENSOR,
    "experts": EXPERT,
    "expert_ffw": TENSOR,
}

LogicalAxes = tuple[str | None, ...]


def make_mesh(expert: int | None = None, tensor: int | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 2-D (expert, tensor) mesh over `devices` (default: every device of every process).

    With no sizes given, `tensor` is the largest divisor of the device count not above its square
    root and `expert` takes the rest (8 devices -> 4 x 2). Give one size and the other is inferred.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if expert is None and tensor is None:
        tensor = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    for name, size in (("expert", expert), ("tensor", tensor)):
        if size is not None and (size <= 0 or n % size):
            raise ValueError(f"mesh axis {name}={size} does not divide the {n} devices")
    expert = n // tensor if expert is None else expert
    tensor = n // expert if tensor is None else tensor
    if expert * tensor != n:
        raise ValueError(f"mesh expert={expert} x tensor={tensor} does not match the {n} devices")
    grid = np.array(devices, dtype=object).reshape(expert, tensor)
    return Mesh(grid, MESH_AXES)


def logical_spec(axes: LogicalAxes) -> P:
    """The PartitionSpec of an array whose dimensions carry these logical axis names."""
    return P(*(None if a is None else LOGICAL_RULES[a] for a in axes))


def logical_sharding(mesh: Mesh, axes: LogicalAxes) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def moe_reduce_axes() -> tuple[str, ...]:
    """Mesh axes over which the routed-expert block's partial outputs are summed."""
    return tuple(a for a in (LOGICAL_RULES["experts"], LOGICAL_RULES["expert_ffw"]) if a is not None)


def check_divisible(mesh: Mesh, shape: Sequence[int], axes: LogicalAxes, name: str) -> None:
    """Fail early, naming the weight, when a dimension does not split evenly over its mesh axis."""
    for size, axis in zip(shape, axes):
        mesh_axis = None if axis is None else LOGICAL_RULES[axis]
        if mesh_axis is not None and size % mesh.shape[mesh_axis]:
            raise ValueError(
                f"{name}: dimension {axis!r} of size {size} does not split over mesh axis "
                f"{mesh_axis!r} of size {mesh.shape[mesh_axis]}; choose another make_mesh(expert=, tensor=)"
            )


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated (possibly multi-process) array as numpy, without a cross-process gather."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))
