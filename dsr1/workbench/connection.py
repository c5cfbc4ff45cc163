"""Connecting the notebook kernel to the ipyparallel controller that ``mcjax_setup.sh`` (or
``--local N``) started: where the setup scripts keep their state (``cluster.json``, the
controller's connection file), the :class:`Cluster` handle every other workbench function takes,
and waiting for the engines to register.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .process import ClusterError

if TYPE_CHECKING:
    import ipyparallel

    from .layout import Layout

RESTART_HINT = ("recover with dsr1.workbench.reset_engines(cluster) (it restarts the engines through "
                "the scripts' cluster_restart and resets this kernel's JAX state), then re-run the cells from "
                "\"Initialize\"")


def state_dir(state: str | os.PathLike | None = None) -> Path:
    """The state folder the setup scripts use: ``state``, else ``$MCJAX_STATE``, else ``~/.mcjax``."""
    return Path(state or os.environ.get("MCJAX_STATE") or Path.home() / ".mcjax")


def cluster_info(state: str | os.PathLike | None = None) -> dict[str, Any]:
    """What the setup scripts recorded in ``<state>/cluster.json`` ({} when there is none)."""
    path = state_dir(state) / "cluster.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def connection_file(profile: str | os.PathLike | None = None, cluster_id: str | None = None,
                    state: str | os.PathLike | None = None) -> Path:
    """The controller's client connection file ``<profile_dir>/security/ipcontroller-<id>-client.json``.

    ``profile`` is a profile folder or an ipyparallel profile name (``<state>/profile_<name>``).
    Defaults: ``$MCJAX_PROFILE_DIR`` / ``$MCJAX_CLUSTER_ID``, else what ``cluster.json`` records.
    """
    info = cluster_info(state)
    cluster_id = cluster_id or os.environ.get("MCJAX_CLUSTER_ID") or info.get("cluster_id") or "mcjax"
    if profile is None:
        profile_dir = Path(os.environ.get("MCJAX_PROFILE_DIR") or info.get("profile_dir")
                           or state_dir(state) / "profile_mcjax")
    elif os.sep in str(profile) or Path(profile).is_dir():
        profile_dir = Path(profile)
    else:
        profile_dir = state_dir(state) / f"profile_{profile}"
    return profile_dir / "security" / f"ipcontroller-{cluster_id}-client.json"


@dataclasses.dataclass(eq=False)
class Cluster:
    """The connection to the cluster's controller that :func:`connect` returns and the other
    functions here take.

    ``client``: the ipyparallel Client (``cluster.client.activate()`` for the %px magics,
    ``cluster.client[:]`` for a view of every engine); ``info``: what the setup scripts recorded in
    ``cluster.json``; ``controller_ip``: the controller's address, from its connection file;
    ``layout``: the process numbering of :func:`assign_process_ids` (None before it, and after
    :func:`reset_engines`). On a single host (``MCJAX_SINGLE=1``) there is no controller:
    ``client`` is :class:`~dsr1.workbench.single.NoEngines` and ``single`` is true.
    """
    client: ipyparallel.Client
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    controller_ip: str = "127.0.0.1"
    layout: Layout | None = None

    def describe(self, engine_id: int) -> str:
        """``engine 3 (process 1, host h1, pid 123)`` once numbered, else ``engine 3``."""
        return self.layout.describe(engine_id) if self.layout else f"engine {engine_id}"

    def summary(self) -> str:
        """One line: how many processes, the numbering, where the kernel and each engine are."""
        layout = self.layout
        if layout is None:
            return f"{len(self.client.ids)} engines, not numbered yet"
        if self.single:
            return "a single host: this kernel is the only process (process 0 of 1), no engines"
        return (f"{layout.num_processes} processes, {layout.numbering} numbering: the kernel is process "
                f"{layout.kernel_process_id}; " + "; ".join(e.describe() for e in layout.engines))

    @property
    def single(self) -> bool:
        """A single host: this kernel is the only process, every cell runs here alone."""
        return self.info.get("provider") == "single"

    def push(self, names: dict[str, Any]) -> None:
        """Define ``names`` in every engine's namespace (the kernel keeps its own)."""
        if not self.single:
            self.client[:].push(names, block=True)

    def close(self) -> None:
        """Close the connection (the cluster keeps running)."""
        self.client.close()


def connect_controller(profile: str | os.PathLike | None = None, cluster_id: str | None = None,
            timeout: float = 30.0, *, state: str | os.PathLike | None = None) -> Cluster:
    """Connect to the controller that ``mcjax_setup.sh`` (or ``--local N``) started: the
    connection alone (see :func:`dsr1.workbench.connect` for the notebook's first cell).

    Waits up to ``timeout`` seconds for the connection file, then for the controller to answer;
    raises ClusterError saying how to start or restart the cluster otherwise.
    """
    import ipyparallel as ipp

    path = connection_file(profile, cluster_id, state)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise ClusterError(
                f"no controller connection file {path}: the cluster is not running (or another "
                f"MCJAX_STATE / cluster id). Start it with ./mcjax_setup.sh (real cluster) or "
                f"./mcjax_setup.sh --local N (simulated), check it with cluster_status.")
        time.sleep(0.2)
    try:
        client = ipp.Client(str(path), timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, OSError) as e:
        raise ClusterError(f"the controller of {path} did not answer ({e}): is it running? Check with "
                           f"cluster_status; restart it with `cluster_restart all`.") from e
    info = cluster_info(state)
    return Cluster(client=client, info=info, controller_ip=_controller_ip(path, info))


def _controller_ip(connection: Path, info: dict[str, Any]) -> str:
    """The controller's IP: the ``interface`` of its connection file, else cluster.json's, else loopback."""
    try:
        interface = str(json.loads(connection.read_text()).get("interface", ""))
    except (OSError, ValueError):
        interface = ""
    ip = interface.split("://")[-1].strip("[]") if interface else ""
    return ip or info.get("controller_ip") or "127.0.0.1"


def wait_for_engines(cluster: Cluster, n: int, timeout: float = 120.0) -> list[int]:
    """Wait until ``n`` engines are registered; returns their ids (sorted).

    Raises ClusterError naming how many came up within ``timeout`` seconds.
    """
    client = cluster.client
    try:
        client.wait_for_engines(n, timeout=timeout, interactive=False)
    except TimeoutError:
        ids = sorted(client.ids)
        raise ClusterError(
            f"only {len(ids)} of {n} engines came up within {timeout:.0f}s (engine ids {ids}). See the "
            f"engine logs ($MCJAX_STATE/logs on each host) and cluster_status; {RESTART_HINT}.") from None
    return sorted(client.ids)
