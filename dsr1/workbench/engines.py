"""Calling the engines from the kernel: submit a function (or a cell) to every engine, run the
kernel's own part, and wait for the engines, turning a dead engine, a timeout or an aborted task
into a :class:`~dsr1.workbench.process.ClusterError` that says what to do.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .connection import RESTART_HINT, Cluster
from .process import ClusterError, host_key, probe


def dead_engines(cluster: Cluster, engine_ids: list[int]) -> list[int]:
    """Engines among ``engine_ids`` that left the controller, or whose process on this host is gone.
    An engine is on this host when its probe's ``host_key`` is this host's: hosts cloned from one
    image share a hostname, and a pid of another host says nothing here."""
    registered = set(cluster.client.ids)
    engines = {e.engine_id: e for e in cluster.layout.engines} if cluster.layout else {}
    here = host_key()
    dead = []
    for eid in engine_ids:
        if eid not in registered:
            dead.append(eid)
            continue
        info = engines.get(eid)
        if info is not None and info.host_key == here and not _pid_alive(info.pid):
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


SETTLE_SECONDS = 10.0


def call_everywhere(cluster: Cluster, calls: dict[int, Callable[[], Any]], timeout: float | None,
                    local: Callable[[], Any] | None = None) -> tuple[dict[int, Any], Any]:
    """Call ``calls[e]()`` on each engine ``e`` (ipyparallel's apply: a module function or a
    partial of one), all submitted before ``local()`` (if given) runs here, under :func:`watch`.
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
        done, value = watch(cluster, pending, local if attempt == 0 else None, timeout)
        if attempt == 0:
            mine = value
        results.update({e: v for e, v in done.items() if not aborted([e], [v])})
        todo = {e: call for e, call in todo.items() if e not in results}
        if not todo:
            return results, mine
        time.sleep(0.2)
    raise ClusterError(f"engines {sorted(todo)} keep aborting requests: call abort_stale(cluster) and try again")


def watch(cluster: Cluster, pending: dict[int, Any], local: Callable[[], Any] | None, timeout: float | None, *,
          settle: float = SETTLE_SECONDS, what: str = "the cell") -> tuple[dict[int, Any], Any]:
    """Wait for the engines' tasks ``pending`` (engine id -> its AsyncResult) while ``local()`` runs
    here in a worker thread (:class:`~dsr1.workbench.watchdog.Task`), watching the results as well
    as the engines' liveness. Returns (each engine's result, ``local()``'s value); an engine's
    aborted task comes back as its TaskAborted.

    - An engine dies: ClusterError naming it at once (:func:`dead_error`).
    - A process raises (an engine, or ``local``): the others get ``settle`` seconds to finish (they
      raise the same error, or finish); then the error is raised naming the process, with its
      traceback, and naming the processes still inside ``what``: those wait in a collective for
      the failed one, which never comes, so the error says how to restart them. The kernel's own
      error alone (every engine finished) is raised as it is.
    - ``timeout`` seconds pass (None: no limit) with no failure: ClusterError naming the processes
      still busy.
    """
    from .watchdog import POLL_SECONDS, Task

    task = Task(local) if local is not None else None
    start = time.monotonic()
    failed_at = None
    while True:
        finished = {e for e, ar in pending.items() if ar.ready()}
        running = [e for e in pending if e not in finished]
        dead = dead_engines(cluster, running) + sorted(e for e in finished if _died(_raised(pending[e])))
        if dead:
            error = dead_error(cluster, dead)
            raise error from task.error if task is not None and task.failed else error
        kernel_done = task is None or task.done.is_set()
        if not running and kernel_done:
            break
        failures = [e for e in finished if _raised(pending[e]) is not None]
        if failures or (task is not None and task.failed):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > settle:
                break
        elif timeout is not None and time.monotonic() - start > timeout:
            busy = [cluster.describe(e) for e in running] + ([] if kernel_done else ["this kernel"])
            raise ClusterError(
                f"{', '.join(busy)} did not finish {what} within {timeout:.0f}s. If it waits for the other "
                f"processes (a collective, or jax.distributed.initialize), one of them did not take part. "
                f"Interrupt it with dsr1.workbench.abort_stale(cluster, interrupt=True); after a hung initialize "
                f"call clear_hung_initialize(cluster); if it stays busy, {RESTART_HINT}.")
        if task is not None and not task.done.is_set():
            task.done.wait(POLL_SECONDS)
        else:
            time.sleep(POLL_SECONDS)
    raised = {e: error for e in finished if (error := _raised(pending[e])) is not None}
    stuck = [e for e in pending if e not in finished]
    kernel_stuck = task is not None and not task.done.is_set()
    if raised or stuck or kernel_stuck:
        kernel_error = task.error if task is not None else None
        same = all(_summary(error) == _summary(kernel_error) for error in raised.values())
        if not stuck and not kernel_stuck and kernel_error is not None and same:
            raise kernel_error  # every process raised the same (a mistake in the cell): the kernel's own error
        raise failure_error(cluster, raised, stuck, kernel_stuck, kernel_error, what) from kernel_error
    if task is not None and task.error is not None:
        raise task.error
    return {e: _value(ar) for e, ar in pending.items()}, task.value if task is not None else None


def _raised(ar: Any) -> BaseException | None:
    """The error an engine's finished task raised (None when it succeeded or was aborted)."""
    import ipyparallel as ipp

    try:
        ar.get(0)
    except ipp.error.TaskAborted:
        return None
    except ipp.error.CompositeError as e:  # one engine's error, wrapped when its task was one of several
        if len(e.elist) == 1:
            return ipp.error.RemoteError(*e.elist[0])
        return e
    except Exception as e:  # noqa: BLE001 - the engine's error, reported by the caller
        return e
    return None


def _died(error: BaseException | None) -> bool:
    """Whether a task's error is ipyparallel's word that its engine died (unregistered mid-task)."""
    return (getattr(error, "ename", None) or type(error).__name__) == "EngineError"


def _summary(error: BaseException | None) -> tuple[str, str]:
    """An error's type name and message, for a kernel's and an engine's (RemoteError) alike."""
    return (getattr(error, "ename", None) or type(error).__name__, str(getattr(error, "evalue", None) or error))


def _value(ar: Any) -> Any:
    """A finished task's value (its TaskAborted when it was aborted)."""
    import ipyparallel as ipp

    try:
        return ar.get(0)
    except ipp.error.TaskAborted as e:
        return e
    except ipp.error.EngineError as e:
        raise ClusterError(f"an engine died while running its task: {e}; {RESTART_HINT}") from e


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def remote_traceback(error: BaseException) -> str:
    """An engine's error as text: its traceback as the engine printed it (colours removed), else
    ``Type: message``."""
    trace = getattr(error, "traceback", None) or ""
    if isinstance(trace, list):
        trace = "\n".join(trace)
    text = _ANSI.sub("", trace).strip()
    name, value = _summary(error)
    return text or f"{name}: {value}"


def failure_error(cluster: Cluster, raised: dict[int, BaseException], stuck: list[int], kernel_stuck: bool,
                  kernel_error: BaseException | None, what: str = "the cell") -> ClusterError:
    """The error of a process that raised while others were (or still are) in ``what``: who
    raised, each traceback, and who is still inside it."""
    parts = []
    for e, error in raised.items():
        name, value = _summary(error)
        parts.append(f"{cluster.describe(e)} raised {name}: {value}")
    if kernel_error is not None:
        parts.append(f"this kernel{_kernel_process(cluster)} raised {type(kernel_error).__name__}: {kernel_error}")
    message = "; ".join(parts)
    kernel = [f"this kernel{_kernel_process(cluster)}"] if kernel_stuck else []
    waiting = [cluster.describe(e) for e in stuck] + kernel
    if waiting:
        message += (f".\n{', '.join(waiting)} {'is' if len(waiting) == 1 else 'are'} still in {what}: waiting in a "
                    f"collective for the process that failed, which will not come. Their JAX state is lost: "
                    f"{RESTART_HINT} (or run the notebook's first cell again: connect() restarts such engines).")
    for e, error in raised.items():
        message += f"\n\n--- {cluster.describe(e)}:\n{remote_traceback(error)}"
    return ClusterError(message)


def _kernel_process(cluster: Cluster) -> str:
    layout = cluster.layout
    return f" (process {layout.kernel_process_id})" if layout is not None else ""


def busy_engines(cluster: Cluster, engine_ids: list[int]) -> list[int]:
    """Engines among ``engine_ids`` whose queue, as the controller counts it, holds a task (an
    earlier cell still running there, perhaps stuck in a collective)."""
    if not engine_ids:
        return []
    status = cluster.client.queue_status(targets=engine_ids, verbose=False)
    return [e for e in engine_ids if (status.get(e) or {}).get("queue", 0)]


def engine_targets(cluster: Cluster, targets: list[int] | None) -> list[int]:
    """``targets``, else the numbered engines, else every registered one; raises if one is dead.
    On a single host (no engines) there are none."""
    if cluster.single:
        return []
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
