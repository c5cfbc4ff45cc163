"""The converted checkpoint format: orbax items, one per loading unit, and a manifest.

    OUT/config.json        the HF config (so `Config.from_hf(OUT)` works)
    OUT/dsr1.json          manifest: format, version, quant, dtype, units; written last
    OUT/globals/           embed, final_norm, lm_head
    OUT/layers/0007/       one transformer layer (our layout), per release layer number
    OUT/mtp/0061/          the multi-token-prediction module

One orbax item per layer lets the converter stream (and resume) layer by layer and lets a loader
restore each layer straight into its shardings on any mesh: with several processes, orbax reads
only the chunks each process's devices hold.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from .safetensors_io import CheckpointError

MANIFEST = "dsr1.json"
FORMAT = "dsr1-orbax"
VERSION = 1


def is_converted(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).exists()


def unit_dir(unit: str, layer: int | None = None) -> str:
    """Folder of a unit: "globals", or a layer of a stack ("layers/0007", "mtp/0061")."""
    if unit == "globals":
        return "globals"
    return f"{'mtp' if unit == 'mtp' else 'layers'}/{layer:04d}"


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
                              f"v{manifest.get('version')!r})")
    return manifest


def write_json(file: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, file)


def save_unit(folder: Path, tree: Any, checkpointer: ocp.StandardCheckpointer | None = None) -> None:
    """Save one unit's pytree (numpy or jax arrays); the folder appears only when complete.
    Pass one `checkpointer` for many units: its thread pools and buffers are then set up once,
    which keeps a long conversion's memory flat."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if checkpointer is None:
        with ocp.StandardCheckpointer() as own:
            own.save(tmp.absolute(), tree)
    else:
        checkpointer.save(tmp.absolute(), tree)
        checkpointer.wait_until_finished()
    os.replace(tmp, folder)


def restore_unit(folder: Path, abstract: Any) -> Any:
    """Restore one unit into the shardings and dtypes of `abstract` (ShapeDtypeStructs)."""
    if not folder.exists():
        raise CheckpointError(f"{folder}: missing unit of a converted checkpoint")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(folder.absolute(), abstract)
    except ValueError as e:
        raise CheckpointError(f"{folder}: does not match the model ({e})") from None
