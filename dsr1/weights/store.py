"""The converted checkpoint format: one safetensors file per loading unit in dsr1's layout, and a manifest.

    OUT/config.json                the HF config (so `Config.from_hf(OUT)` works)
    OUT/dsr1.json                  manifest: format, version, quant, dtype, units; written last
    OUT/globals.safetensors        embed, final_norm, lm_head
    OUT/layers/0007.safetensors    one transformer layer (our layout), per release layer number
    OUT/mtp/0061.safetensors       the multi-token-prediction module

Each file holds its unit's weights as the model holds them (stored precision, `[in, out]`, experts
stacked; an int8 weight as `NAME.q` and `NAME.scale`), named by their path in the declarations
(`moe.gate.q`). One file per layer lets the converter stream (and resume) layer by layer; its raw,
uncompressed arrays let a loader copy each device's region straight from the file into place
(memory-mapped, so with several processes each reads only what its devices hold), where a general
array store would decode every array first.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .safetensors_io import (
    DTYPES,
    CheckpointError,
    ReadLog,
    TensorInfo,
    map_file,
    read_header,
    read_into,
    write_safetensors,
)

MANIFEST = "dsr1.json"
FORMAT = "dsr1-safetensors"
VERSION = 1


def is_converted(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).exists()


def unit_file(unit: str, layer: int | None = None) -> str:
    """File of a unit: "globals.safetensors", or a layer of a stack ("layers/0007.safetensors")."""
    if unit == "globals":
        return "globals.safetensors"
    return f"{'mtp' if unit == 'mtp' else 'layers'}/{layer:04d}.safetensors"


def read_json_file(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None


def read_manifest(folder: str | Path) -> dict[str, Any]:
    file = Path(folder) / MANIFEST
    manifest = read_json_file(file)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{file}: not a {FORMAT} v{VERSION} manifest (found {manifest.get('format')!r} "
                              f"v{manifest.get('version')!r}); convert the release checkpoint again with this "
                              f"version of `python -m dsr1 convert`")
    return manifest


def write_json(file: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, file)


def weight_names(tree: Any) -> list[str]:
    """The name each leaf of a unit's tree is stored under, in leaf order ("moe.gate.q")."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in paths]


def save_unit(file: Path, tree: Any) -> None:
    """Write one unit's pytree of numpy arrays; the file appears only when complete."""
    leaves = jax.tree.leaves(tree)
    arrays = dict(zip(weight_names(tree), leaves))
    file.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(file, {n: (a.shape, a.dtype) for n, a in arrays.items()}, arrays.__getitem__,
                      {"format": FORMAT})


def open_unit(file: Path, abstract: Any,
              log: ReadLog | None = None) -> list[Callable[[tuple[slice, ...], np.ndarray], None]]:
    """For each leaf of `abstract` (one unit's ShapeDtypeStructs), in leaf order, a function that
    writes a region of that weight into an array (`safetensors_io.read_into`), each checked for its
    name, shape and dtype first; no weight bytes are read yet. A float weight may be read into
    another float dtype (a bfloat16 conversion loaded in float32). `log` records the regions read."""
    if not file.exists():
        raise CheckpointError(f"{file}: missing unit of a converted checkpoint")
    header, data = read_header(file), map_file(file)
    return [functools.partial(read_into, _checked(file, header, name, a), data=data, log=log)
            for name, a in zip(weight_names(abstract), jax.tree.leaves(abstract))]


def _checked(file: Path, header: dict[str, TensorInfo], name: str, abstract: Any) -> TensorInfo:
    info = header.get(name)
    if info is None:
        raise CheckpointError(f"{file}: tensor {name!r} is missing (the checkpoint does not match the model)")
    stored, wanted = DTYPES[info.dtype], np.dtype(abstract.dtype)
    castable = stored == wanted or (jnp.issubdtype(stored, jnp.floating) and jnp.issubdtype(wanted, jnp.floating))
    if info.shape != tuple(abstract.shape) or not castable:
        raise CheckpointError(f"{file}: tensor {name!r} is {info.dtype}{list(info.shape)}, the model needs "
                              f"{wanted}{list(abstract.shape)}")
    return info
