"""Loading weights into their shardings, from a HF release-layout folder or a converted one.

Both formats are read one unit at a time (the global weights, then one layer): each unit arrives
already sharded, is quantized on device if int8 was asked for, and is written into the stacked
weights in place. Host memory follows the largest device shard of one layer, never the model.
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
from jax.sharding import Mesh
from tqdm.auto import tqdm

from ..core.config import Config
from ..core.params import (
    Params,
    abstract_params,
    is_spec,
    param_specs,
    per_layer,
    quantize_like,
    resolved_dtype,
    stack_layers,
    stack_names,
    unit_specs,
)
from ..core.quant import check_quant
from ..core.sharding import ShardingRules
from . import store
from .release import CheckpointIndex, read_region, tensor_bytes, unit_sources, unit_tensors, validate
from .throughput import Throughput, folder_bytes


@dataclasses.dataclass(frozen=True)
class UnitReader:
    """How one checkpoint format is read, one loading unit ("globals", or a stack and a layer) at a time."""

    read: Callable[[str, int | None], Any]  # the unit's pytree of sharded arrays
    nbytes: Callable[[str, int | None], int]  # bytes reading it moves from disk
    prefetch: Callable[[str, int | None], None] = lambda unit, layer: None  # start reading it in the background


def _hf_reader(folder: Path, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any, quant: str | None,
               mtp: bool) -> UnitReader:
    index = CheckpointIndex.open(folder)
    validate(index, cfg, mtp=mtp)
    specs = param_specs(cfg, mtp=mtp)
    layer_dtype = jnp.float32 if quant else dtype  # quantize from full precision

    def read(unit: str, layer: int | None) -> Any:
        declared = unit_specs(specs, unit)
        read_dtype = dtype if unit == "globals" else layer_dtype
        arrays = [_from_callback(index, src, spec, mesh, rules, 0 if layer is None else layer,
                                 resolved_dtype(spec, read_dtype))
                  for spec, src in unit_sources(cfg, unit, mtp=mtp)]
        return jax.tree.unflatten(jax.tree.structure(declared, is_leaf=is_spec), arrays)

    def tensors(unit: str, layer: int | None) -> list[str]:
        return unit_tensors(index, cfg, unit, layer)

    return UnitReader(read, lambda unit, layer: tensor_bytes(index, tensors(unit, layer)),
                      lambda unit, layer: index.prefetch(tensors(unit, layer)))


def _from_callback(index: CheckpointIndex, src, spec, mesh: Mesh, rules: ShardingRules, layer: int,
                   dtype: Any) -> jax.Array:
    sharding = abstract_params(spec, mesh, rules, dtype).sharding
    regions: dict[tuple, np.ndarray] = {}  # devices holding the same region share one read

    def read(region: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in region)
        if key not in regions:
            regions[key] = read_region(index, src, spec.shape, layer, region, dtype)
        return regions[key]

    return jax.make_array_from_callback(spec.shape, sharding, read)


def _converted_reader(folder: Path, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any,
                      stored_quant: str | None, mtp: bool) -> UnitReader:
    specs = param_specs(cfg, stored_quant, mtp=mtp)

    def read(unit: str, layer: int | None) -> Any:
        abstract = abstract_params(unit_specs(specs, unit), mesh, rules, dtype)
        return store.restore_unit(folder / store.unit_dir(unit, layer), abstract)

    return UnitReader(read, lambda unit, layer: folder_bytes([folder / store.unit_dir(unit, layer)]))


def _set_layer(layer_target: Any, stacked: list[jax.Array], layer: Any, i: jax.Array) -> list[jax.Array]:
    """Write one layer (quantized first if `layer_target` says so) into every stacked weight in place.
    One program for all the weights of a stack: one compilation per stack, not one per weight."""
    if layer_target is not None:
        layer = quantize_like(layer_target, layer)
    return [jax.lax.dynamic_update_index_in_dim(s, w.astype(s.dtype), i, 0)
            for s, w in zip(stacked, jax.tree.leaves(layer))]


def _assemble_stack(read: Callable[[str, int | None], Any], cfg: Config, unit: str, target: Any, mesh: Mesh,
                    rules: ShardingRules, dtype: Any, quantize: bool, advance: Callable[[str, int], None]) -> Any:
    """Allocate a stack in its shardings, then fill it layer by layer (quantizing each layer if asked)."""
    leaves = jax.tree.leaves(abstract_params(target, mesh, rules, dtype))
    shardings = [a.sharding for a in leaves]
    zeros = jax.jit(lambda: [jnp.zeros(a.shape, a.dtype) for a in leaves], out_shardings=shardings)
    stacked = zeros()
    set_layer = jax.jit(functools.partial(_set_layer, per_layer(target) if quantize else None), donate_argnums=0,
                        out_shardings=shardings)
    for i, layer in enumerate(stack_layers(cfg, unit)):
        stacked = set_layer(stacked, read(unit, layer), np.int32(i))
        advance(unit, layer)
    return jax.tree.unflatten(jax.tree.structure(target, is_leaf=is_spec), stacked)


def load_params(folder: str | Path, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any, *,
                quant: str | None = None, mtp: bool = False, progress: bool = True) -> tuple[Params, Throughput]:
    """Weights of `dtype` (int8 matmul weights with `quant="int8"`) in their shardings on `mesh`, and
    how fast they came: the bytes read from `folder` (the tensors' bytes in the shards of a release
    folder, FP8 scales included; the unit folders' files of a converted one) over the wall seconds
    until every weight is on its devices. The progress bar shows the same rate as it goes."""
    start = time.perf_counter()
    folder = Path(folder)
    if store.is_converted(folder):
        manifest = store.read_manifest(folder)
        stored_quant = manifest["quant"]
        if mtp and not manifest["mtp"]:
            raise store.CheckpointError(f"{folder}: converted without the MTP module; cannot load mtp=True")
        reader = _converted_reader(folder, cfg, mesh, rules, dtype, stored_quant, mtp)
    else:
        stored_quant = None
        reader = _hf_reader(folder, cfg, mesh, rules, dtype, check_quant(quant), mtp)
    quant = check_quant(quant) or stored_quant
    target = param_specs(cfg, quant, mtp=mtp)
    stacks = stack_names(target)
    units = [("globals", None)] + [(k, i) for k in stacks for i in stack_layers(cfg, k)]
    sizes = {u: reader.nbytes(*u) for u in units}
    following = dict(zip(units, units[1:]))

    def read(unit: str, layer: int | None) -> Any:
        if (unit, layer) in following:  # the disk reads the next unit while this one is converted
            reader.prefetch(*following[unit, layer])
        return reader.read(unit, layer)

    with tqdm(total=sum(sizes.values()), desc=f"loading {folder.name}", unit="B", unit_scale=True,
              disable=not progress) as bar:
        def advance(unit: str, layer: int | None) -> None:
            bar.update(sizes[unit, layer])

        reader.prefetch(*units[0])
        params: dict[str, Any] = dict(read("globals", None))
        advance("globals", None)
        for unit in stacks:
            params[unit] = _assemble_stack(read, cfg, unit, target[unit], mesh, rules, dtype, quant != stored_quant,
                                           advance)
        jax.block_until_ready(params)  # the seconds count until the weights are in place
    return params, Throughput(sum(sizes.values()), time.perf_counter() - start)
