"""Calling the engines from the kernel: submit a function (or a cell) to every engine, run the
kernel's own part, and wait for the engines, turning a dead engine, a timeout or an aborted task
into a :class:`~dsr1.workbench.process.ClusterError` that says what to do.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .connection import RESTART_HINT, Cluster
from .process import ClusterError, probe


def dead_engines(cluster: Cluster, engine_ids: list[int]) -> list[int]:
    """Engines among ``engine_ids`` that left the controller, or whose process here is gone."""
    registered = set(cluster.client.ids)
    engines = {e.engine_id: e for e in cluster.layout.engines} if cluster.layout else {}
    here = socket.gethostname()
    dead = []
    for eid in engine_ids:
        if eid not in registered:
            dead.append(eid)
            continue
        info = engines.get(eid)
        if info is not None and info.hostname == here and not _pid_alive(info.pid):
            dead.append(eid)
    return dead


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def dead_error(cluster: Cluster, dead: list[int]) -> ClusterError:
    names = ", ".join(cluster.describe(e) for e in dead)
    return ClusterError(
        f"{names} {'is' if len(dead) == 1 else 'are'} gone: the engine died or was stopped (killed, out of memory, "
        f"or a crash in JAX; its log is $MCJAX_STATE/logs/engine-<host index>.log). The other processes cannot go "
        f"on with jax.distributed without it: {RESTART_HINT}.")


def wait_result(cluster: Cluster, ar: Any, engine_ids: list[int], timeout: float | None) -> Any:
    """Wait for ``ar`` (one task per engine of ``engine_ids``), turning dead engines and timeouts
    into ClusterErrors that say what to do. Errors raised by the code itself propagate as usual;
    aborted tasks come back as TaskAborted results (see :func:`aborted`)."""
    import ipyparallel as ipp

    deadline = None if timeout is None else time.monotonic() + timeout
    while not ar.wait(0.25):
        dead = dead_engines(cluster, engine_ids)
        if dead:
            raise dead_error(cluster, dead)
        if deadline is not None and time.monotonic() > deadline:
            outstanding = cluster.client.outstanding
            busy = [e for e, m in zip(engine_ids, ar.msg_ids) if m in outstanding] or engine_ids
            raise ClusterError(
                f"{', '.join(cluster.describe(e) for e in busy)} did not finish within {timeout:.0f}s. If it "
                f"waits for the other processes (a collective, or jax.distributed.initialize), one of them did "
                f"not take part. Interrupt it with dsr1.workbench.abort_stale(cluster, interrupt=True); "
                f"after a hung initialize call clear_hung_initialize(cluster); if it stays busy, {RESTART_HINT}.")
    try:
        return ar.get()
    except ipp.error.TaskAborted as e:  # raised for one target, returned in the list for several
        return e
    except ipp.error.CompositeError as e:
        died = [(info or {}).get("engine_id") for ename, _value, _tb, info in e.elist if ename == "EngineError"]
        if died:
            raise dead_error(cluster, [d for d in died if d is not None] or engine_ids) from e
        raise
    except ipp.error.EngineError as e:
        raise dead_error(cluster, dead_engines(cluster, engine_ids) or engine_ids) from e


def aborted(ids: list[int], results: Any) -> list[int]:
    """The engines whose task came back aborted (ipyparallel returns those without raising)."""
    import ipyparallel as ipp

    return [e for e, r in zip(ids, results) if isinstance(r, ipp.error.TaskAborted)]


def call_everywhere(cluster: Cluster, calls: dict[int, Callable[[], Any]], timeout: float | None,
                     local: Callable[[], Any] | None = None) -> tuple[dict[int, Any], Any]:
    """Call ``calls[e]()`` on each engine ``e`` (ipyparallel's apply: a module function or a
    partial of one), all submitted before ``local()`` (if given) runs here, then wait for them.
    Returns (each engine's return value by engine id, ``local()``'s value).

    An engine drops the requests that reach it while it handles an error in an earlier one
    (ipykernel's stop-on-error): those are sent again.
    """
    dead = dead_engines(cluster, list(calls))
    if dead:
        raise dead_error(cluster, dead)
    results: dict[int, Any] = {}
    mine = None
    todo = dict(calls)
    for attempt in range(5):
        pending = {e: cluster.client[e].apply_async(call) for e, call in todo.items()}
        if attempt == 0 and local is not None:
            mine = local()
        for e, ar in pending.items():
            value = wait_result(cluster, ar, [e], timeout)
            if not aborted([e], [value]):
                results[e] = value
        todo = {e: call for e, call in todo.items() if e not in results}
        if not todo:
            return results, mine
        time.sleep(0.2)
    raise ClusterError(f"engines {sorted(todo)} keep aborting requests: call abort_stale(cluster) and try again")


def engine_targets(cluster: Cluster, targets: list[int] | None) -> list[int]:
    """``targets``, else the numbered engines, else every registered one; raises if one is dead."""
    if targets is None:
        targets = cluster.layout.engine_ids if cluster.layout else cluster.client.ids
    ids = sorted(targets)
    if not ids:
        raise ClusterError(f"no engines are registered with the controller: {RESTART_HINT}")
    dead = dead_engines(cluster, ids)
    if dead:
        raise dead_error(cluster, dead)
    return ids


def probe_everywhere(cluster: Cluster, engine_ids: list[int], devices: bool, timeout: float,
                      namespace: dict | None = None) -> tuple[list[dict], dict]:
    """:func:`probe` on the engines and in this process; returns (engine infos, kernel info)."""
    ip = cluster.controller_ip
    engines, mine = call_everywhere(cluster, {e: functools.partial(probe, ip, devices) for e in engine_ids},
                                     timeout, local=functools.partial(probe, ip, devices, namespace))
    return [engines[e] for e in engine_ids], mine
