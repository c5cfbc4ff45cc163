"""The device mesh and the logical-axis rules: the only module that names mesh axes.

Every weight and activation elsewhere speaks *logical* axes ("heads", "experts", ...);
`ShardingRules` maps each to a mesh axis (or to None: replicated). The rules are a value, passed
to whatever places arrays (`Model.rules`, `init_random(..., rules=)`); `DEFAULT_RULES` is the
low-latency decode layout ("tp"): activations replicated, attention heads and ffw split over
`tensor`, routed experts over `expert` (and their ffw over `tensor`). `layout_rules("dp")` is the
throughput layout: attention data parallelism, the rows of every activation and of the decode cache
split over `expert` (each of its devices a data-parallel rank), each row's pages of the page pool
dealt out over `tensor`, with the all-to-all expert dispatch (docs/layouts.md).

`moe_dispatch` chooses how tokens meet the routed experts: "psum" (default) runs every device's
experts on every token routed to them and sums the partial outputs over the mesh; "all_to_all"
splits the MoE input's rows over the `experts` axis and sends each (token, expert) pair to the
device holding its expert and back (`dsr1.core.moe`, docs/layouts.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

EXPERT = "expert"
TENSOR = "tensor"
MESH_AXES = (EXPERT, TENSOR)

LogicalAxes = tuple[str | None, ...]
MOE_DISPATCH = ("psum", "all_to_all")
LAYOUTS = ("tp", "dp")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axis (or None: replicated) each logical axis is split over."""

    layers: str | None = None
    batch: str | None = None  # rows: of activations and of the decode cache (attention data parallelism)
    positions: str | None = None  # a row's cached positions: the page pool's pages within a rank
    vocab: str | None = TENSOR
    embed: str | None = None
    q_lora: str | None = None
    kv_lora: str | None = None
    heads: str | None = TENSOR
    head_dim: str | None = None
    ffw: str | None = TENSOR
    experts: str | None = EXPERT
    expert_ffw: str | None = TENSOR
    moe_dispatch: str = "psum"  # how tokens reach the routed experts: one of MOE_DISPATCH
    # Products whose per-row sums never depend on the other rows of the call (the serving engine's
    # `batch_invariant`): the CPU backend's expert kernels sum a row by how many rows share its expert.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.moe_dispatch not in MOE_DISPATCH:
            raise ValueError(f"ShardingRules.moe_dispatch={self.moe_dispatch!r}: expected one of {MOE_DISPATCH}")

    def mesh_axis(self, logical: str | None) -> str | None:
        """The mesh axis of one logical axis; a name with no rule is an error, not "replicated"."""
        if logical is None:
            return None
        if logical not in {f.name for f in dataclasses.fields(self)} - {"moe_dispatch", "batch_invariant"}:
            raise ValueError(f"no sharding rule for logical axis {logical!r}")
        return getattr(self, logical)

    def devices(self, mesh: Mesh, logical: str) -> int:
        """Over how many devices of `mesh` a logical axis is split (1: not split)."""
        axis = self.mesh_axis(logical)
        return 1 if axis is None else mesh.shape[axis]

    def spec(self, axes: LogicalAxes) -> P:
        """The PartitionSpec of an array whose dimensions carry these logical axes. Two dimensions
        mapped to one mesh axis would be split twice over the same devices: that is an error."""
        mesh_axes = [self.mesh_axis(a) for a in axes]
        used = [m for m in mesh_axes if m is not None]
        if len(used) != len(set(used)):
            clash = next(m for m in used if used.count(m) > 1)
            raise ValueError(f"logical axes {axes} map {[a for a, m in zip(axes, mesh_axes) if m == clash]} "
                             f"to the same mesh axis {clash!r}")
        return P(*mesh_axes)

    def sharding(self, mesh: Mesh, axes: LogicalAxes) -> NamedSharding:
        return NamedSharding(mesh, self.spec(axes))

    def moe_reduce_axes(self) -> tuple[str, ...]:
        """Mesh axes over which the routed-expert block's partial outputs are summed."""
        return tuple(a for a in (self.experts, self.expert_ffw) if a is not None)

    def moe_token_axis(self) -> str | None:
        """The mesh axis the routed-expert block splits its input rows over, or None when every
        device sees every row: the `experts` axis under the "all_to_all" dispatch (each device of
        it owns a share of the rows and sends their pairs to the experts' devices)."""
        return self.experts if self.moe_dispatch == "all_to_all" else None

    def check_divisible(self, mesh: Mesh, shape: Sequence[int], axes: LogicalAxes, name: str) -> None:
        """Fail early, naming the weight, when a dimension does not split evenly over its mesh axis."""
        for size, axis in zip(shape, axes):
            mesh_axis = self.mesh_axis(axis)
            if mesh_axis is not None and size % mesh.shape[mesh_axis]:
                raise ValueError(
                    f"{name}: dimension {axis!r} of size {size} does not split over mesh axis "
                    f"{mesh_axis!r} of size {mesh.shape[mesh_axis]}; choose another make_mesh(expert=, tensor=)")


DEFAULT_RULES = ShardingRules()


def layout_rules(layout: str, **overrides: Any) -> ShardingRules:
    """The rules of a named layout (docs/layouts.md): "tp", tensor-parallel attention with every row on
    every device (`DEFAULT_RULES`, lowest latency); "dp", attention data parallelism over the `expert`
    axis (each device of it owns a share of the rows and of their cache; heads stay split over
    `tensor`, and each row's pages of the pool are dealt out over `tensor`) with the all-to-all
    expert dispatch, so tokens never leave their rank but to meet their experts. `overrides`: other
    fields of `ShardingRules`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    base = {"batch": EXPERT, "positions": TENSOR, "moe_dispatch": "all_to_all"} if layout == "dp" else {}
    return ShardingRules(**{**base, **overrides})


def rules_layout(rules: ShardingRules) -> str:
    """The named layout `rules` follow: "dp" when rows are split, else "tp"."""
    return "tp" if rules.batch is None else "dp"


def make_mesh(expert: int | None = None, tensor: int | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 2-D (expert, tensor) mesh over `devices` (default: every device of every process), laid
    out by `jax.make_mesh`, which knows the TPU/GPU topology.

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
    # Auto axes: shardings come from the logical rules and `with_sharding_constraint`, as XLA's
    # partitioner expects; explicit-sharding types would change how every jnp op is typed.
    return jax.make_mesh((expert, tensor), MESH_AXES, (AxisType.Auto, AxisType.Auto), devices=devices)


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())


def keep_replicated(x: jax.Array, mesh: Mesh) -> jax.Array:
    """Inside jit: constrain an activation to the low-latency layout (whole on every device)."""
    return jax.lax.with_sharding_constraint(x, replicated_sharding(mesh))


def keep_rows(x: jax.Array, mesh: Mesh, rules: ShardingRules, axis: int = 0) -> jax.Array:
    """Inside jit: constrain an array whose dimension `axis` holds rows to the rules' layout: rows
    split over `rules.batch` (attention data parallelism), the rest whole; replicated when rows are
    not split. A row count that does not divide the axis is padded by XLA, not refused."""
    spec = [None] * x.ndim
    spec[axis] = rules.batch
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def put_replicated(tree: Any, mesh: Mesh) -> Any:
    """Host values (numpy, Python numbers, single-device arrays, PRNG keys) as arrays replicated over
    the mesh. Across processes `device_put` takes host data only, so arrays go through numpy and
    PRNG keys through their key data."""
    def is_key(x: Any) -> bool:
        return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)

    leaves, treedef = jax.tree.flatten(tree)
    host = [np.asarray(jax.random.key_data(x)) if is_key(x) else np.asarray(x) for x in leaves]
    # One device_put for every leaf: a serving step sends a dozen small arrays, each put has a fixed cost.
    placed = jax.device_put(host, replicated_sharding(mesh))
    placed = [jax.random.wrap_key_data(p, impl=jax.random.key_impl(x)) if is_key(x) else p
              for x, p in zip(leaves, placed)]
    return jax.tree.unflatten(treedef, placed)


def to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) array as numpy: a replicated one without a cross-process gather,
    one split over processes (rows under attention data parallelism) gathered from all of them."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
