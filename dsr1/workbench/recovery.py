"""Recovering the cluster without restarting the kernel: abort stale tasks (:func:`abort_stale`)
and restart the engines (:func:`reset_engines`), after an engine died, a cell hung, or to free the
engines' memory.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import ports
from .connection import Cluster, cluster_info
from .layout import DEFAULT_COORDINATOR_PORT, Layout, assign_process_ids
from .process import ClusterError, reset_here
from .scripts import run_command, run_scripts, scripts_env


def on_live_engines(client: Any, call: Callable[[list[int]], Any], targets: Iterable[int], tries: int = 3) -> None:
    """`call(ids)` on those of `targets` still registered. A dead engine unregisters when the hub
    notices its heartbeat stop, which can fall between reading the ids and the call (ipyparallel then
    raises KeyError for its id): the call is retried on the engines left."""
    targets = set(targets)
    for attempt in range(tries):
        live = sorted(targets & set(client.ids))
        if not live:
            return
        try:
            call(live)
            return
        except KeyError:
            if attempt == tries - 1:
                raise
            client.spin()


def abort_stale(cluster: Cluster, *, interrupt: bool = False, timeout: float = 10.0) -> int:
    """Abort the tasks still queued on the engines (e.g. left by an interrupted cell); with
    ``interrupt=True`` also send SIGINT to engines still running one. Returns how many tasks were
    outstanding. Code blocked inside JAX may ignore SIGINT: then :func:`reset_engines`."""

    client = cluster.client
    outstanding = list(client.outstanding)
    if not outstanding:
        return 0
    ids = client.ids
    on_live_engines(client, lambda targets: client.abort(jobs=outstanding, targets=targets, block=False), ids)
    if interrupt:
        on_live_engines(client, lambda targets: client.send_signal(signal.SIGINT, targets=targets, block=False), ids)
    deadline = time.monotonic() + timeout
    while client.outstanding & set(outstanding) and time.monotonic() < deadline:
        client.spin()
        time.sleep(0.1)
    return len(outstanding)


def reset_engines(cluster: Cluster, *, n: int | None = None, timeout: float = 180.0,
                  command: list[str] | None = None, port: int | None = None,
                  namespace: dict | None = None) -> list[int]:
    """Recover the cluster (after an engine died, a cell hung, or to free the engines' memory):

    1. ask the scripts whether a restart can succeed (``cluster_restart check``): if not, nothing
       is stopped and the error says why;
    2. reset this kernel's JAX state (:func:`~dsr1.workbench.process.reset_here`: leave
       ``jax.distributed``, drop JAX's backends and compiled programs; a collective stuck in a
       thread stays there, harmless), before the engines go: the kernel must not wait on a
       coordinator that vanishes;
    3. abort stale tasks and restart every engine (``cluster_restart engines``, run here on host 0;
       ``command`` overrides it), wait for ``n`` new ones (default: as many as before);
    4. re-read cluster.json and number the processes again (:func:`assign_process_ids`) with a new
       coordinator ``port`` (default: a free one on a local cluster, else the previous one + 1).

    Then re-run the notebook from "Initialize". Returns the new engines' ids. On a single host
    (no engines) only this kernel's JAX state is reset.
    """
    if cluster.single:
        reset_here()
        return []
    client, info, layout = cluster.client, cluster.info or cluster_info(), cluster.layout
    old = set(client.ids)
    n = n or (len(layout.engines) if layout else 0) or int(info.get("engines") or 0) or len(old)
    if not n:
        raise ClusterError("reset_engines: how many engines? (pass n=)")
    if command is None:
        run_scripts(info, "check", timeout)
    reset_here()
    abort_stale(cluster, interrupt=True, timeout=5)
    if old:
        on_live_engines(client, lambda targets: client.shutdown(targets=targets, hub=False, block=False), old)
        deadline = time.monotonic() + 3  # engines stuck in a collective do not exit: the scripts stop them
        while set(client.ids) & old and time.monotonic() < deadline:
            time.sleep(0.2)
    if command is None:
        run_scripts(info, "engines", timeout)
    else:
        run_command(command, scripts_env(info), timeout, "restarting the engines")
    deadline = time.monotonic() + timeout
    while len(set(client.ids) - old) < n or set(client.ids) & old:
        if time.monotonic() > deadline:
            raise ClusterError(f"{len(set(client.ids) - old)} of {n} engines came back within {timeout:.0f}s and "
                               f"{sorted(set(client.ids) & old)} of the old ones are still registered: see "
                               f"cluster_status and the engine logs")
        time.sleep(0.2)
    cluster.info = cluster_info(info.get("state")) or info
    cluster.layout = None  # the old engines' numbering
    assign_process_ids(cluster, port=port or next_port(cluster.info, layout), namespace=namespace)
    return sorted(set(client.ids) - old)


def next_port(info: dict[str, Any], layout: Layout | None) -> int:
    """A coordinator port of the cluster's range (``$MCJAX_PORTS``) for the next initialize: a free
    one on a local cluster (everything runs here), else the previous one + 1 (a port the old
    coordinator may still hold is avoided), back to the range's first after its last."""
    if info.get("provider") == "local":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = ports.port_range()
    previous = (layout.port if layout else None) or info.get("coordinator_port") or DEFAULT_COORDINATOR_PORT
    following = int(previous) + 1
    return following if low <= following <= high else low
