"""Resumable training state on disk: `OUT/checkpoint/{state.pkl, meta.json}`, replaced atomically.

The state (float32 weights, optimizer state, step) is pickled as host numpy arrays. The data order
depends on the seed and the step alone (`dsr1.train.data.batch_at`), and the step uses no randomness,
so (state, seed) is all a resumed run needs to continue exactly where the interrupted one stopped.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

STATE = "state.pkl"
META = "meta.json"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished `tmp` folder to `final`, never leaving `final` half written."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def save(folder: str | Path, state: Any, meta: dict) -> None:
    """Write `state` (any pytree of arrays) and `meta` (JSON) to `folder`, atomically."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    host = jax.tree.map(np.asarray, jax.device_get(state))
    with open(tmp / STATE, "wb") as f:
        pickle.dump(host, f, protocol=pickle.HIGHEST_PROTOCOL)
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    _replace_dir(tmp, folder)


def exists(folder: str | Path) -> bool:
    return (Path(folder) / STATE).is_file() and (Path(folder) / META).is_file()


def load(folder: str | Path) -> tuple[Any, dict]:
    """The (host numpy) state and the meta written by `save`."""
    folder = Path(folder)
    with open(folder / STATE, "rb") as f:
        state = pickle.load(f)
    return state, json.loads((folder / META).read_text())
