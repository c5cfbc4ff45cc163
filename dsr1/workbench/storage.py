"""How every process sees the shared folders (mount, file system type, free space)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .connection import Cluster
from .engines import call_everywhere, engine_targets
from .process import storage


def shared_paths(info: dict[str, Any]) -> list[str]:
    """The folders every host must see, from cluster.json: the compilation cache and the
    ipyparallel profile (both on the shared folder of a real cluster) and dsr1's source."""
    import dsr1

    paths = [info.get("jax_cache_dir"), info.get("profile_dir"), str(Path(dsr1.__file__).parents[1])]
    return [p for p in dict.fromkeys(paths) if p]


def storage_everywhere(cluster: Cluster, paths: list[str] | None = None, *,
                       timeout: float = 30.0) -> dict[str, list[dict[str, Any]]]:
    """:func:`~dsr1.workbench.process.storage` of ``paths`` (default :func:`shared_paths`) in every
    process: exists, mount point, file system type (``nfs4``, ``fuse.gcsfuse``, ...), free bytes."""
    paths = paths or shared_paths(cluster.info)
    ids = engine_targets(cluster, None)
    engines, mine = call_everywhere(cluster, {e: functools.partial(storage, paths) for e in ids}, timeout,
                                     local=functools.partial(storage, paths))
    return {"kernel": mine} | {cluster.describe(e): engines[e] for e in ids}
