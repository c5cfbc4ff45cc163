"""Loading weights into their shardings, from a HF release-layout folder or a converted one.

Both formats are read one unit at a time (the global weights, then one layer): each unit arrives
already sharded, is quantized on device if int8 was asked for, and is written into the stacked
weights in place. Host memory follows the largest device shard of one layer, never the model.
"""

from __future__ import annotations

import functools
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
from .release import CheckpointIndex, read_region, unit_sources, validate

UnitReader = Callable[[str, int | None], Any]  # (unit, layer) -> pytree of sharded arrays


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

    return read


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

    return read


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    """Write one layer into a stacked weight in place (the old buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), i, 0)


def _assemble_stack(read: UnitReader, cfg: Config, unit: str, target: Any, mesh: Mesh, rules: ShardingRules,
                    dtype: Any, quantize: bool, bar: tqdm) -> Any:
    """Allocate a stack in its shardings, then fill it layer by layer (quantizing each layer if asked)."""
    abstract = abstract_params(target, mesh, rules, dtype)
    stacked = [jax.jit(functools.partial(jnp.zeros, a.shape, a.dtype), out_shardings=a.sharding)()
               for a in jax.tree.leaves(abstract)]
    layer_target = per_layer(target)
    layer_shardings = jax.tree.map(lambda a: a.sharding, abstract_params(layer_target, mesh, rules, dtype))
    to_target = jax.jit(functools.partial(quantize_like, layer_target), out_shardings=layer_shardings)
    for i, layer in enumerate(stack_layers(cfg, unit)):
        part = read(unit, layer)
        if quantize:
            part = to_target(part)
        for j, leaf in enumerate(jax.tree.leaves(part)):
            stacked[j] = _set_layer(stacked[j], leaf, np.int32(i))
        bar.update(1)
    return jax.tree.unflatten(jax.tree.structure(abstract), stacked)


def load_params(folder: str | Path, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any, *,
                quant: str | None = None, mtp: bool = False, progress: bool = True) -> Params:
    """Weights of `dtype` (int8 matmul weights with `quant="int8"`) in their shardings on `mesh`."""
    folder = Path(folder)
    if store.is_converted(folder):
        manifest = store.read_manifest(folder)
        stored_quant = manifest["quant"]
        if mtp and not manifest["mtp"]:
            raise store.CheckpointError(f"{folder}: converted without the MTP module; cannot load mtp=True")
        read = _converted_reader(folder, cfg, mesh, rules, dtype, stored_quant, mtp)
    else:
        stored_quant = None
        read = _hf_reader(folder, cfg, mesh, rules, dtype, check_quant(quant), mtp)
    quant = check_quant(quant) or stored_quant
    target = param_specs(cfg, quant, mtp=mtp)
    params: dict[str, Any] = dict(read("globals", None))
    stacks = stack_names(target)
    with tqdm(total=sum(len(stack_layers(cfg, k)) for k in stacks), desc=f"loading {folder.name}", unit="layer",
              disable=not progress) as bar:
        for unit in stacks:
            params[unit] = _assemble_stack(read, cfg, unit, target[unit], mesh, rules, dtype, quant != stored_quant,
                                           bar)
    return params
