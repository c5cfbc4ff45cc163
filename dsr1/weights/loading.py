"""Loading weights into their shardings, from a HF release-layout folder or a converted one.

`plan_load` derives once what a load does (`LoadPlan`: the folder's format and quantization, the
weights' declarations as stored and as held, their dtype and shardings, how each stack is built),
and `load_params` carries it out. A process reads only the regions of the checkpoint's tensors
that its devices hold (`planned_reads` lists them before anything is read; the disk is asked for
the next unit's pages while one is converted).

Both formats are read one unit at a time (the global weights, then one layer). Each weight is
built on the host region by region, one buffer per distinct device region, and handed to its
devices: where the devices are the CPU, without a copy (the buffer becomes the device buffer).
There, a whole layer stack is filled layer by layer straight into place; on accelerators, or where
int8 is made on load, each layer arrives on its devices, is quantized there if asked, and is
written into the stacked weights in place, so host memory follows one weight of one layer.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from ..core.config import Config
from ..core.params import (
    Params,
    abstract_params,
    is_spec,
    param_specs,
    per_layer,
    quantize_like,
    stack_layers,
    stack_names,
    unit_specs,
)
from ..core.quant import check_quant
from ..core.sharding import ShardingRules
from ..host import copy as host_copy
from . import store
from .release import (
    FP8_BLOCK,
    CheckpointIndex,
    Fp8Experts,
    dequantize_experts,
    fp8_scale_region,
    is_fp8_experts,
    read_region_into,
    read_stored_into,
    stored_experts,
    tensor_regions,
    unit_sources,
    validate,
)
from .safetensors_io import ReadLog, TensorInfo, advise, page_ranges, read_header, region_runs
from .throughput import Throughput

Fill = Callable[[tuple[slice, ...], np.ndarray], None]  # writes a region of one weight into a host array
HostRegions = dict[tuple, tuple[tuple[slice, ...], np.ndarray]]  # a weight's distinct device regions and their buffers


@dataclasses.dataclass(frozen=True)
class UnitReader:
    """How one checkpoint format is read, one loading unit ("globals", or a stack and a layer) at a time."""

    fills: Callable[[str, int | None, Any], list[Fill]]  # one per leaf of the unit's ShapeDtypeStructs, in leaf order
    # The tensor regions this process reads for a unit (its ShapeDtypeStructs in our layout): those
    # its devices hold, mapped to the checkpoint's tensors, in reading order.
    regions: Callable[[str, int | None, Any], list[tuple[TensorInfo, tuple[slice, ...]]]]
    log: ReadLog  # the regions read so far
    # The unit's ShapeDtypeStructs as read for devices that finish the conversion (`_set_layer`): the
    # release's FP8 experts as `Fp8Experts`. Identity where the format is read as it is held.
    stored: Callable[[str, int | None, Any], Any] = lambda unit, layer, abstract: abstract

    def prefetch(self, regions: list[tuple[TensorInfo, tuple[slice, ...]]]) -> None:
        """Start reading these regions' pages in the background, in the order given."""
        advise([(info.file, int(b), int(e)) for info, region in regions
                for b, e in page_ranges(region_runs(info, region))])


def _hf_reader(plan: LoadPlan, process: int | None = None) -> UnitReader:
    index = plan.index

    def unit_sources(unit: str) -> tuple:
        return plan.parts[unit].sources

    def fills(unit: str, layer: int | None, abstract: Any) -> list[Fill]:
        at, out = 0 if layer is None else layer, []
        slots = jax.tree.leaves(abstract, is_leaf=is_fp8_experts)
        for slot, (spec, src) in zip(slots, unit_sources(unit)):
            if is_fp8_experts(slot):  # codes, then scales: `Fp8Experts`' leaf order
                out += [functools.partial(read_stored_into, index, src, suffix, at, spec.shape[0])
                        for suffix in ("", "_scale_inv")]
            else:
                out.append(functools.partial(read_region_into, index, src, spec.shape, at))
        return out

    def stored(unit: str, layer: int | None, abstract: Any) -> Any:
        def one(a: jax.ShapeDtypeStruct, spec: Any, src: Any) -> Any:
            as_stored = layer is not None and stored_experts(index, src, layer, spec.shape[0])
            return _fp8_experts_abstract(a) if as_stored else a

        sources = unit_sources(unit)
        slots = [one(a, spec, src) for a, (spec, src) in zip(jax.tree.leaves(abstract), sources)]
        return jax.tree.unflatten(jax.tree.structure(abstract), slots)

    def regions(unit: str, layer: int | None, abstract: Any) -> list[tuple[TensorInfo, tuple[slice, ...]]]:
        out = []
        for a, (spec, src) in zip(jax.tree.leaves(abstract), unit_sources(unit)):
            for region in process_regions(a, process):
                for name, box in tensor_regions(src, spec.shape, 0 if layer is None else layer, region):
                    info = index.info(name)
                    box = (slice(None),) * len(info.shape) if box is None else box
                    out.append((info, box))
                    if name + "_scale_inv" in index.tensors and len(info.shape) == 2:
                        out.append((index.tensors[name + "_scale_inv"], fp8_scale_region(_resolved(box, info.shape))))
        return out

    return UnitReader(fills, regions, index.log, stored)


def _fp8_experts_abstract(weight: jax.ShapeDtypeStruct) -> Fp8Experts:
    """What is read for one layer's `[E, in, out]` routed-expert weight stored in FP8: its codes in the
    release layout `[E, out, in]`, split over the devices as the weight is (so each device's codes are
    the transpose of its part of the weight), and the block scales, replicated (1/16,384 of the codes)."""
    experts, rows, cols = weight.shape
    mesh, spec = weight.sharding.mesh, tuple(weight.sharding.spec) + (None,) * 3
    codes = jax.ShapeDtypeStruct((experts, cols, rows), np.uint8,
                                 sharding=NamedSharding(mesh, P(spec[0], spec[2], spec[1])))
    scales = jax.ShapeDtypeStruct((experts, -(-cols // FP8_BLOCK), -(-rows // FP8_BLOCK)), np.float32,
                                  sharding=NamedSharding(mesh, P()))
    return Fp8Experts(codes, scales)


def _resolved(region: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*r.indices(n)[:2]) for r, n in zip(region, shape))


def process_regions(abstract: jax.ShapeDtypeStruct, process: int | None = None) -> list[tuple[slice, ...]]:
    """The distinct regions of `abstract` held by the devices of `process` (None: this process's)."""
    sharding = abstract.sharding
    if process is None:
        held = sharding.addressable_devices_indices_map(abstract.shape).values()
    else:
        held = [r for d, r in sharding.devices_indices_map(abstract.shape).items() if d.process_index == process]
    keys = dict.fromkeys(_region_key(r, abstract.shape) for r in held)
    return [tuple(slice(a, b) for a, b, _ in key) for key in keys]


def _converted_reader(folder: Path, manifest: dict[str, Any], process: int | None = None) -> UnitReader:
    missing = [unit for unit in manifest["units"] if not (folder / unit).is_file()]
    if missing:  # found before anything is read
        raise store.CheckpointError(f"{folder / missing[0]}: missing unit of a converted checkpoint "
                                    f"({len(missing)} of {len(manifest['units'])} missing)")

    def file(unit: str, layer: int | None) -> Path:
        return folder / store.unit_file(unit, layer)

    log = ReadLog()

    def fills(unit: str, layer: int | None, abstract: Any) -> list[Fill]:
        return store.open_unit(file(unit, layer), abstract, log)

    def regions(unit: str, layer: int | None, abstract: Any) -> list[tuple[TensorInfo, tuple[slice, ...]]]:
        header = read_header(file(unit, layer))
        return [(header[name], region) for name, a in zip(store.weight_names(abstract), jax.tree.leaves(abstract))
                if name in header for region in process_regions(a, process)]

    return UnitReader(fills, regions, log)


def _region_key(region: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n) for s, n in zip(region, shape))


def _host_regions(abstract: jax.ShapeDtypeStruct, empty: Callable[..., np.ndarray] = np.empty) -> HostRegions:
    """An empty host buffer (made by `empty`, `LoadPlan.empty`) for each distinct region this process's
    devices hold of `abstract`."""
    regions = {}
    devices = abstract.sharding.addressable_devices_indices_map(abstract.shape)
    for region in devices.values():
        key = _region_key(region, abstract.shape)
        if key not in regions:
            shape = tuple(len(range(*k)) for k in key)
            regions[key] = (region, empty(shape, abstract.dtype))
    return regions


def _to_devices(abstract: jax.ShapeDtypeStruct, regions: HostRegions) -> jax.Array:
    """The filled host buffers as one sharded array. The first device given a buffer may take it over
    (on CPU it does, without a copy); any other device holding the same region gets its own copy."""
    shards, taken = [], set()
    for device, region in abstract.sharding.addressable_devices_indices_map(abstract.shape).items():
        key = _region_key(region, abstract.shape)
        shards.append(jax.device_put(regions[key][1], device, may_alias=key not in taken))
        taken.add(key)
    return jax.make_array_from_single_device_arrays(abstract.shape, abstract.sharding, shards)


def _read_unit(fills: list[Fill], abstract: Any, empty: Callable[..., np.ndarray]) -> Any:
    """One unit's weights on their devices (`abstract`: its ShapeDtypeStructs), one weight at a time."""
    def one(fill: Fill, a: jax.ShapeDtypeStruct) -> jax.Array:
        regions = _host_regions(a, empty)
        for region, out in regions.values():
            fill(region, out)
        return _to_devices(a, regions)

    leaves = [one(fill, a) for fill, a in zip(fills, jax.tree.leaves(abstract))]
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def _read_stack_in_place(fills: Callable[[str, int | None], list[Fill]], plan: LoadPlan, unit: str,
                         advance: Callable[[str, int], None]) -> Any:
    """A whole layer stack filled on the host layer by layer, each layer's region of every weight read
    straight into its slot, then handed to the devices (CPU devices: no copy, no program compiled).
    A weight on one device that the plan holds transposed (`UnitPlan.transposed`) also gets its
    `[..., out, in]` copy here, each layer written as soon as it is read, while the disk reads the
    next (after the load, `compute_view` would make it with the disk idle)."""
    part = plan.parts[unit]
    abstract = part.stored_as
    leaves = jax.tree.leaves(abstract)
    buffers = [_host_regions(a, plan.host.empty) for a in leaves]
    copies = [plan.host.empty(_swapped_shape(a.shape), a.dtype) if flag and len(a.sharding.device_set) == 1
              else None for a, flag in zip(leaves, part.transposed)]
    layers = part.layers
    for i, layer in enumerate(layers):
        for fill, regions, copy in zip(fills(unit, layer), buffers, copies):
            for region, out in regions.values():
                held = range(len(layers))[region[0]]  # the stack's positions this buffer holds
                if i in held:
                    fill(region[1:], out[held.index(i)])
                    if copy is not None:  # (one device: the buffer is the whole stack)
                        host_copy.transpose_into(copy[i], out[i])
        advance(unit, layer)
    arrays = [_to_devices(a, r) for a, r in zip(leaves, buffers)]
    arrays = [w if copy is None else plan.host.with_transposed(w, copy) for w, copy in zip(arrays, copies)]
    return jax.tree.unflatten(jax.tree.structure(abstract), arrays)


def _swapped_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _set_layer(layer_target: tuple[Any, tuple[Any, ...]] | None, shardings: tuple[Any, ...],
               stacked: list[jax.Array], layer: Any, i: jax.Array) -> list[jax.Array]:
    """Write one layer (its FP8 experts dequantized, then quantized if `layer_target`, a frozen
    declaration tree, says so) into every stacked weight in place. One program for all the weights
    of a stack, jitted once at module level: later loads of the same shapes compile nothing (a
    program per load would compile again on every load)."""
    layer = jax.tree.map(lambda w: dequantize_experts(w) if is_fp8_experts(w) else w, layer, is_leaf=is_fp8_experts)
    if layer_target is not None:
        layer = quantize_like(jax.tree.unflatten(*layer_target), layer)
    return [jax.lax.with_sharding_constraint(jax.lax.dynamic_update_index_in_dim(s, w.astype(s.dtype), i, 0), sh)
            for s, w, sh in zip(stacked, jax.tree.leaves(layer), shardings)]


def _frozen(specs: Any) -> tuple[Any, tuple[Any, ...]]:
    """A declaration tree as a hashable (structure, leaves) pair: a static argument of a jitted program."""
    leaves, structure = jax.tree.flatten(specs, is_leaf=is_spec)
    return structure, tuple(leaves)


def _assemble_stack(read: Callable[[str, int | None], Any], plan: LoadPlan, unit: str,
                    advance: Callable[[str, int], None]) -> Any:
    """Allocate a stack in its shardings, then fill it layer by layer (quantizing each layer if asked)."""
    part = plan.parts[unit]
    leaves = jax.tree.leaves(part.held_as)
    shardings = tuple(a.sharding for a in leaves)
    stacked = [jnp.zeros(a.shape, a.dtype, device=a.sharding) for a in leaves]
    for i, layer in enumerate(part.layers):
        stacked = _set_layer(part.layer_target, shardings, stacked, read(unit, layer), np.int32(i))
        advance(unit, layer)
    return jax.tree.unflatten(jax.tree.structure(part.held_as), stacked)


class HostLayout:
    """How the devices' backend holds the weights that loading builds on the host. This one: as plain
    arrays. A backend that holds some weights with a transposed copy (the CPU backend's,
    `dsr1.cpu.loading`) passes its own, with these three methods, which the loader fills layer by
    layer as it reads."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A host buffer for weights."""
        return np.empty(shape, dtype)

    def keeps_transposed(self, name: str | None, spec: Any, dtype: Any) -> bool:
        """Whether the weight `name` (declared `spec`, held in `dtype`) is held with a copy of its values
        with the last two axes swapped."""
        return False

    def with_transposed(self, w: jax.Array, copy: np.ndarray) -> Any:
        """The weight `w` (on one device) as held with its transposed copy `copy` (host values)."""
        return w


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """One loading unit of a plan: the global weights, or a layer stack read layer by layer."""

    layers: tuple[int, ...]  # a stack's release layer numbers (`model.layers.N`); () for the globals
    read_as: Any  # the ShapeDtypeStructs a unit (a layer of a stack) is read as
    stored_as: Any  # a stack's ShapeDtypeStructs as the folder stores it, whole (filled in place)
    held_as: Any  # a stack's ShapeDtypeStructs as the model holds it, whole
    layer_target: tuple | None  # a stack's per-layer declarations to quantize to on load (frozen), or None
    transposed: tuple[bool, ...]  # per leaf of a stack: held with a transposed copy, made on load
    sources: tuple | None  # the release layout: each leaf's (declaration, `Source`); None: converted


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What a load does, derived once from the folder (its index or manifest), the model's settings
    and the mesh (`plan_load`): every unit's shapes, shardings, dtypes and sources, handed down to the
    readers as they are."""

    folder: Path
    cfg: Config
    mesh: Mesh
    dtype: jnp.dtype  # the weights' dtype (int8 weights: their other weights')
    mtp: bool
    stored_quant: str | None  # the folder's quantization (a converted int8 folder: "int8")
    quant: str | None  # the weights' quantization as held
    manifest: dict[str, Any] | None  # a converted folder's manifest; None: a release-layout folder
    index: CheckpointIndex | None  # a release-layout folder's tensors (validated against `cfg`)
    host: HostLayout  # how the devices' backend holds what is built on the host
    parts: dict[str, UnitPlan]  # "globals", then each stack, in reading order

    @property
    def quantize(self) -> bool:
        """Whether layers are quantized on load (read in full precision, quantized on the devices)."""
        return self.quant != self.stored_quant

    @property
    def accelerators(self) -> bool:
        """Whether the mesh's devices are accelerators. There layer stacks are assembled on the devices,
        and the release's FP8 experts are dequantized there; CPU devices take the host's buffers as
        they are (no copy), and the host's table lookup dequantizes as fast as XLA:CPU."""
        return any(d.platform != "cpu" for d in self.mesh.devices.flat)

    @property
    def in_place(self) -> bool:
        """Whether stacks are filled on the host straight into the buffers the devices then hold."""
        return not self.quantize and not self.accelerators

    @property
    def stacks(self) -> list[str]:
        """The layer stacks, in reading order."""
        return [k for k in self.parts if k != "globals"]

    @property
    def units(self) -> list[tuple[str, int | None]]:
        """The loading units in reading order: the globals, then every layer of every stack."""
        return [("globals", None)] + [(k, i) for k in self.stacks for i in self.parts[k].layers]

    def unit_abstract(self, unit: str) -> Any:
        """What a unit's weights are read as (a layer to quantize on load: in full precision)."""
        return self.parts[unit].read_as


def plan_load(folder: str | Path, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any, *,
              quant: str | None = None, mtp: bool = False, host: HostLayout | None = None,
              index: CheckpointIndex | None = None) -> LoadPlan:
    """The plan of loading `folder` into `mesh`; raises a `store.CheckpointError` naming what a
    converted folder lacks, or what a release-layout folder's tensors do not match in `cfg`. `host`:
    how the devices' backend holds weights built on the host (by default as plain arrays). `index`
    stands for a release folder's shards (`CheckpointIndex.from_shape_index`: a plan from a listing of
    the tensors, no weights needed)."""
    folder = Path(folder)
    manifest = store.read_manifest(folder) if store.is_converted(folder) else None
    stored_quant = None if manifest is None else manifest["quant"]
    if manifest is not None and mtp and not manifest["mtp"]:
        raise store.CheckpointError(f"{folder}: converted without the MTP module; cannot load mtp=True")
    if manifest is None:
        index = CheckpointIndex.open(folder) if index is None else index
        validate(index, cfg, mtp=mtp)
    quant, dtype, host = check_quant(quant) or stored_quant, jnp.dtype(dtype), HostLayout() if host is None else host
    stored, target = param_specs(cfg, stored_quant, mtp=mtp), param_specs(cfg, quant, mtp=mtp)
    units = ("globals", *stack_names(target))
    sources = {u: None if manifest is not None else tuple(unit_sources(cfg, u, mtp=mtp)) for u in units}
    abstract = functools.partial(abstract_params, mesh=mesh, rules=rules)
    read_as = {u: abstract(unit_specs(stored, u), dtype=jnp.float32 if quant != stored_quant and u != "globals"
                           else dtype) for u in units}
    parts = {"globals": UnitPlan((), read_as["globals"], None, None, None, (), sources["globals"])}
    for unit in units[1:]:
        parts[unit] = UnitPlan(tuple(stack_layers(cfg, unit)), read_as[unit], abstract(stored[unit], dtype=dtype),
                               abstract(target[unit], dtype=dtype),
                               _frozen(per_layer(target[unit])) if quant != stored_quant else None,
                               _transposed_flags(host, stored[unit], dtype, stored_quant), sources[unit])
    return LoadPlan(folder, cfg, mesh, dtype, mtp, stored_quant, quant, manifest, index, host, parts)


def _transposed_flags(host: HostLayout, stack: Any, dtype: Any, stored_quant: str | None) -> tuple[bool, ...]:
    """Per leaf of a stack's declarations, whether the backend holds its values transposed
    (`HostLayout.keeps_transposed`), a copy made on load; all False for a converted folder's stored
    quantization."""
    if stored_quant is not None:
        return (False,) * len(jax.tree.leaves(stack, is_leaf=is_spec))

    def keeps(path: tuple, spec: Any) -> bool:
        return host.keeps_transposed(getattr(path[-1], "key", None), spec, dtype)

    return tuple(jax.tree.leaves(jax.tree_util.tree_map_with_path(keeps, stack, is_leaf=is_spec)))


def _reader(plan: LoadPlan, process: int | None = None) -> UnitReader:
    if plan.manifest is None:
        return _hf_reader(plan, process)
    return _converted_reader(plan.folder, plan.manifest, process)


def planned_reads(plan: LoadPlan, process: int | None = None) -> ReadLog:
    """The tensor regions loading by `plan` reads for the devices of `process` (None: this process),
    without reading any: the regions its devices hold, plus what every process reads (the tensors
    held whole)."""
    reader = _reader(plan, process)
    return ReadLog([r for unit in plan.units for r in reader.regions(*unit, plan.unit_abstract(unit[0]))])


def load_params(folder: str | Path, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any, *,
                quant: str | None = None, mtp: bool = False, progress: bool = True,
                host: HostLayout | None = None) -> tuple[Params, Throughput]:
    """Weights of `dtype` (int8 matmul weights with `quant="int8"`) in their shardings on `mesh`, and
    how fast they came: the bytes this process read from `folder` (the regions of its tensors that
    this process's devices hold, FP8 scales included, plus the tensors every device holds whole;
    `Throughput.reads` lists them) over the wall seconds until every weight is on its devices. The
    progress bar shows the planned bytes (`planned_reads`) at the same rate as it goes. `host`: see
    `plan_load`."""
    start = time.perf_counter()
    plan = plan_load(folder, cfg, mesh, rules, dtype, quant=quant, mtp=mtp, host=host)
    reader = _reader(plan)
    units = plan.units
    regions = {u: reader.regions(*u, plan.unit_abstract(u[0])) for u in units}
    sizes = {u: ReadLog(r).bytes() for u, r in regions.items()}
    following = dict(zip(units, units[1:]))

    def fills(unit: str, layer: int | None, abstract: Any = None) -> list[Fill]:
        if (unit, layer) in following:  # the disk reads the next unit while this one is converted
            reader.prefetch(regions[following[unit, layer]])
        return reader.fills(unit, layer, plan.unit_abstract(unit) if abstract is None else abstract)

    def read(unit: str, layer: int | None) -> Any:  # one unit on its devices (`_assemble_stack`)
        abstract = plan.unit_abstract(unit)
        abstract = reader.stored(unit, layer, abstract) if plan.accelerators else abstract
        return _read_unit(fills(unit, layer, abstract), abstract, plan.host.empty)

    with tqdm(total=sum(sizes.values()), desc=f"loading {plan.folder.name}", unit="B", unit_scale=True,
              disable=not progress) as bar:
        def advance(unit: str, layer: int | None) -> None:
            bar.update(sizes[unit, layer])

        reader.prefetch(regions[units[0]])
        params: dict[str, Any] = dict(read("globals", None))
        advance("globals", None)
        for unit in plan.stacks:
            if plan.in_place:
                params[unit] = _read_stack_in_place(fills, plan, unit, advance)
            else:
                params[unit] = _assemble_stack(read, plan, unit, advance)
        jax.block_until_ready(params)  # the seconds count until the weights are in place
    return params, Throughput(reader.log.bytes(), time.perf_counter() - start, reader.log)
