"""The notebook side of the multi-host workbench: connect to the ipyparallel cluster that
``mcjax_setup.sh`` started, number the JAX processes, initialize ``jax.distributed`` in all of
them, check they match, and recover from stale tasks, dead engines and a hung initialize.

Process layout (``numbering`` in cluster.json): *kernel-last*, the engines on hosts 1..N-1 are
JAX processes 0..N-2 (ordered by host index) and the notebook kernel on host 0 is process N-1,
with explicit ids; *platform* (TPU pods, Slurm), JAX numbers the processes itself: the kernel is
process 0 and host i is process i, and every process calls ``jax.distributed.initialize()``
without ids. With ``./mcjax_setup.sh --local N [--numbering platform]`` either layout runs on
this machine, each process with ``MCJAX_LOCAL_DEVICES`` fake CPU devices.

The pattern, in a notebook on host 0::

    from dsr1.workbench import cluster as mcjax
    cluster = mcjax.connect()                     # a Cluster; reads $MCJAX_STATE/cluster.json
    mcjax.wait_for_engines(cluster, N - 1)
    mcjax.assign_process_ids(cluster)             # PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere
    mcjax.activate(cluster)                       # %px / %%px, and %%everywhere (below)

    %%everywhere
    from dsr1.workbench import cluster as mcjax
    mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR)

``%%everywhere`` is ``%%px --local`` with a watchdog: the kernel's part runs in a worker thread
while the kernel watches the engines, so an engine that dies in the middle of a collective ends
the cell within a second or two with a ClusterError naming it (``%%px --local`` would wait
forever: the kernel's own part is stuck in the collective). Recovery: :func:`reset_engines`, then
re-run the cells from "Initialize".

``%%px --local`` is safe for ``initialize`` too, which blocks until all N processes have joined:
ipyparallel's magic (8.x, 9.x) submits the cell to the engines *without blocking*, then runs it
in the kernel, then (on the blocking view of ``client.activate()``) waits for the engines and
shows their output; tests/test_cluster.py runs it in an IPython shell acting as process N-1, and
tests/test_recovery.py kills an engine during a ``%%everywhere`` cell in a Jupyter kernel.
Never run the engines' part blocking first (``%px`` / ``%%px`` without
``--local``, ``view.execute(..., block=True)``) and the kernel's afterwards: the engines would
wait for the kernel and the kernel for them (``initialize`` then times out with a ClusterError).
From Python, :func:`initialize_everywhere` does the same as the cell, and :func:`px` with
``local=True`` runs any cell's code that way.

Our own steps run in every process as plain functions (:mod:`dsr1.workbench.process`): on the
engines through ipyparallel's ``apply``, here directly.

Troubleshooting: :func:`abort_stale` (queued or running tasks left behind),
:func:`clear_hung_initialize` (an initialize timed out: reset ``jax.distributed`` everywhere so
it can run again), :func:`reset_engines` (after an engine died, or to free the engines' memory:
restart them and reset the kernel's JAX state),
:func:`health_check` (same Python, versions and devices everywhere?).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .process import (
    ClusterError,
    clock,
    detect_platform,
    initialize,
    prepare_process,
    probe,
    reset_here,
    shutdown_here,
    storage,
    user_namespace,
)
from .watchdog import compile_cell, run_watched

if TYPE_CHECKING:
    import ipyparallel

__all__ = [
    "DEFAULT_COORDINATOR_PORT", "Cluster", "ClusterError", "EngineInfo", "HealthReport", "Layout", "abort_stale",
    "activate", "assign_process_ids", "clear_hung_initialize", "clock_skew", "cluster_info", "connect",
    "connection_file", "detect_platform", "health_check", "initialize", "initialize_everywhere", "probe", "px",
    "reset_engines", "shared_paths", "shutdown_everywhere", "state_dir", "storage_everywhere", "wait_for_engines",
]

DEFAULT_COORDINATOR_PORT = 8476
_RESTART_HINT = ("recover with dsr1.workbench.cluster.reset_engines(cluster) (it restarts the engines through "
                 "the scripts' cluster_restart and resets this kernel's JAX state), then re-run the cells from "
                 "\"Initialize\"")


# ----------------------------------------------------------------------------- connecting

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
    :func:`reset_engines`).
    """
    client: ipyparallel.Client
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    controller_ip: str = "127.0.0.1"
    layout: Layout | None = None

    def describe(self, engine_id: int) -> str:
        """``engine 3 (process 1, host h1, pid 123)`` once numbered, else ``engine 3``."""
        return self.layout.describe(engine_id) if self.layout else f"engine {engine_id}"

    def close(self) -> None:
        """Close the connection (the cluster keeps running)."""
        self.client.close()


def connect(profile: str | os.PathLike | None = None, cluster_id: str | None = None,
            timeout: float = 30.0, *, state: str | os.PathLike | None = None) -> Cluster:
    """Connect to the controller that ``mcjax_setup.sh`` (or ``--local N``) started.

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
            f"engine logs ($MCJAX_STATE/logs on each host) and cluster_status; {_RESTART_HINT}.") from None
    return sorted(client.ids)


# ----------------------------------------------------------------------------- process ids

@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """One engine: its ipyparallel id, JAX process id and where it runs."""
    engine_id: int
    process_id: int
    hostname: str
    pid: int
    host_index: int | None
    address: str

    def describe(self) -> str:
        return f"engine {self.engine_id} (process {self.process_id}, host {self.hostname}, pid {self.pid})"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The JAX processes. ``numbering`` ``kernel-last``: engines 0..N-2, the kernel N-1, and
    ``coordinator`` process 0's address; ``platform`` (as JAX numbers them on TPU pods and Slurm):
    the kernel 0, the engine of host i process i, ``coordinator`` None (JAX finds it; the kernel
    runs it). ``port``: the coordinator's port."""
    num_processes: int
    kernel_process_id: int
    coordinator: str | None
    engines: tuple[EngineInfo, ...]
    numbering: str = "kernel-last"
    port: int | None = None

    @property
    def engine_ids(self) -> list[int]:
        return [e.engine_id for e in self.engines]

    def describe(self, engine_id: int) -> str:
        for e in self.engines:
            if e.engine_id == engine_id:
                return e.describe()
        return f"engine {engine_id}"


def _probe_everywhere(cluster: Cluster, engine_ids: list[int], devices: bool, timeout: float,
                      namespace: dict | None = None) -> tuple[list[dict], dict]:
    """:func:`probe` on the engines and in this process; returns (engine infos, kernel info)."""
    ip = cluster.controller_ip
    engines, mine = _call_everywhere(cluster, {e: functools.partial(probe, ip, devices) for e in engine_ids},
                                     timeout, local=functools.partial(probe, ip, devices, namespace))
    return [engines[e] for e in engine_ids], mine


NUMBERINGS = ("kernel-last", "platform")


def _layout(engine_ids: list[int], infos: list[dict], port: int, numbering: str) -> Layout:
    """Number the processes from the engines' probes: engines by host index (then engine id)."""
    if numbering not in NUMBERINGS:
        raise ClusterError(f"unknown numbering {numbering!r} (cluster.json): want one of {', '.join(NUMBERINGS)}")

    def order(pair: tuple[int, dict]) -> tuple:
        index = pair[1]["host_index"]
        return (index is None, int(index) if index is not None else 0, pair[0])

    ranked = sorted(zip(engine_ids, infos), key=order)
    n = len(ranked) + 1
    # platform: JAX numbers the processes itself, by TPU worker or Slurm task (= host index): the kernel is 0.
    platform = numbering == "platform"
    first = 1 if platform else 0
    coordinator = None if platform else f"{ranked[0][1]['address']}:{port}"
    engines = tuple(
        EngineInfo(engine_id=eid, process_id=first + rank, hostname=info["hostname"], pid=int(info["pid"]),
                   host_index=None if info["host_index"] is None else int(info["host_index"]),
                   address=info["address"])
        for rank, (eid, info) in enumerate(ranked))
    return Layout(num_processes=n, kernel_process_id=0 if platform else n - 1, coordinator=coordinator,
                  engines=engines, numbering=numbering, port=port)


def _numbering(cluster: Cluster, kernel: dict, engines: list[dict]) -> str:
    """cluster.json's numbering; without one, platform on TPU (JAX numbers TPU workers itself)."""
    recorded = cluster.info.get("numbering")
    if recorded:
        return str(recorded)
    tpu = kernel["accelerator"] == "tpu" and all(i["accelerator"] == "tpu" for i in engines)
    return "platform" if tpu else "kernel-last"


def _coordinator_port(cluster: Cluster, port: int | None) -> int:
    """``port``, else cluster.json's, else ``$MCJAX_COORDINATOR_PORT`` / ``$JAX_COORDINATOR_PORT``, else 8476."""
    for candidate in (port, cluster.info.get("coordinator_port"), os.environ.get("MCJAX_COORDINATOR_PORT"),
                      os.environ.get("JAX_COORDINATOR_PORT")):
        if candidate:
            return int(candidate)
    return DEFAULT_COORDINATOR_PORT


def _process_env(cluster: Cluster, layout: Layout, kernel: bool) -> dict[str, str]:
    """The environment a process needs before initialize. Platform numbering: every process gets
    ``JAX_COORDINATOR_PORT`` (so a new port reaches engines started with another one), and the
    kernel, process 0, cluster.json's ``kernel_env`` (the platform's variables) and
    ``JAX_COORDINATOR_BIND_ADDRESS``: its coordinator listens on host 0's internal address only."""
    if layout.numbering != "platform":
        return {}
    env = {"JAX_COORDINATOR_PORT": str(layout.port)}
    if kernel:
        env = {**{k: str(v) for k, v in (cluster.info.get("kernel_env") or {}).items()}, **env,
               "JAX_COORDINATOR_BIND_ADDRESS": f"{cluster.controller_ip}:{layout.port}"}
    return env


def assign_process_ids(cluster: Cluster, *, port: int | None = None, timeout: float = 60.0,
                       namespace: dict | None = None) -> Layout:
    """Number the JAX processes as cluster.json's ``numbering`` says and prepare every process
    for ``initialize``.

    kernel-last: the engines get 0..N-2 (in host index order), the kernel N-1, and
    ``COORDINATOR`` is process 0's address with ``port`` (default: cluster.json's
    ``coordinator_port``, ``$MCJAX_COORDINATOR_PORT``, or 8476). platform (TPU pods, Slurm): JAX
    numbers the processes itself, the kernel (host 0) is process 0 and host i process i, and
    ``COORDINATOR`` is None; the kernel takes cluster.json's ``kernel_env`` into its environment,
    and every process the coordinator's port as ``JAX_COORDINATOR_PORT``.

    Sets ``PROCESS_ID``, ``NUM_PROCESSES`` and ``COORDINATOR`` in each engine's namespace and in the
    kernel's (``namespace``, else IPython's user namespace), so one ``%%everywhere`` cell reads the
    right values everywhere; turns on JAX's compilation cache in cluster.json's ``jax_cache_dir``
    everywhere; keeps the layout in ``cluster.layout``. Run it again after engines were restarted
    (:func:`reset_engines` does).
    """
    ids = sorted(cluster.client.ids)
    if not ids:
        raise ClusterError(f"no engines are registered with the controller: {_RESTART_HINT}")
    infos, mine = _probe_everywhere(cluster, ids, devices=False, timeout=timeout, namespace=namespace)
    layout = _layout(ids, infos, _coordinator_port(cluster, port), _numbering(cluster, mine, infos))
    n, coordinator, cache = layout.num_processes, layout.coordinator, cluster.info.get("jax_cache_dir")
    engine_env = _process_env(cluster, layout, kernel=False)
    _call_everywhere(
        cluster, {e.engine_id: functools.partial(prepare_process, e.process_id, n, coordinator, env=engine_env,
                                                 cache_dir=cache, kernel_process_id=layout.kernel_process_id)
                  for e in layout.engines}, timeout,
        local=functools.partial(prepare_process, layout.kernel_process_id, n, coordinator,
                                env=_process_env(cluster, layout, kernel=True), cache_dir=cache,
                                kernel_process_id=layout.kernel_process_id, namespace=namespace))
    cluster.layout = layout
    return layout


# ----------------------------------------------------------------------------- running code

def _dead_engines(cluster: Cluster, engine_ids: list[int]) -> list[int]:
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


def _dead_error(cluster: Cluster, dead: list[int]) -> ClusterError:
    names = ", ".join(cluster.describe(e) for e in dead)
    return ClusterError(
        f"{names} {'is' if len(dead) == 1 else 'are'} gone: the engine died or was stopped (killed, out of memory, "
        f"or a crash in JAX; its log is $MCJAX_STATE/logs/engine-<host index>.log). The other processes cannot go "
        f"on with jax.distributed without it: {_RESTART_HINT}.")


def _wait(cluster: Cluster, ar: Any, engine_ids: list[int], timeout: float | None) -> Any:
    """Wait for ``ar`` (one task per engine of ``engine_ids``), turning dead engines and timeouts
    into ClusterErrors that say what to do. Errors raised by the code itself propagate as usual;
    aborted tasks come back as TaskAborted results (see :func:`_aborted`)."""
    import ipyparallel as ipp

    deadline = None if timeout is None else time.monotonic() + timeout
    while not ar.wait(0.25):
        dead = _dead_engines(cluster, engine_ids)
        if dead:
            raise _dead_error(cluster, dead)
        if deadline is not None and time.monotonic() > deadline:
            outstanding = cluster.client.outstanding
            busy = [e for e, m in zip(engine_ids, ar.msg_ids) if m in outstanding] or engine_ids
            raise ClusterError(
                f"{', '.join(cluster.describe(e) for e in busy)} did not finish within {timeout:.0f}s. If it "
                f"waits for the other processes (a collective, or jax.distributed.initialize), one of them did "
                f"not take part. Interrupt it with dsr1.workbench.cluster.abort_stale(cluster, interrupt=True); "
                f"after a hung initialize call clear_hung_initialize(cluster); if it stays busy, {_RESTART_HINT}.")
    try:
        return ar.get()
    except ipp.error.TaskAborted as e:  # raised for one target, returned in the list for several
        return e
    except ipp.error.CompositeError as e:
        died = [(info or {}).get("engine_id") for ename, _value, _tb, info in e.elist if ename == "EngineError"]
        if died:
            raise _dead_error(cluster, [d for d in died if d is not None] or engine_ids) from e
        raise
    except ipp.error.EngineError as e:
        raise _dead_error(cluster, _dead_engines(cluster, engine_ids) or engine_ids) from e


def _aborted(ids: list[int], results: Any) -> list[int]:
    """The engines whose task came back aborted (ipyparallel returns those without raising)."""
    import ipyparallel as ipp

    return [e for e, r in zip(ids, results) if isinstance(r, ipp.error.TaskAborted)]


def _call_everywhere(cluster: Cluster, calls: dict[int, Callable[[], Any]], timeout: float | None,
                     local: Callable[[], Any] | None = None) -> tuple[dict[int, Any], Any]:
    """Call ``calls[e]()`` on each engine ``e`` (ipyparallel's apply: a module function or a
    partial of one), all submitted before ``local()`` (if given) runs here, then wait for them.
    Returns (each engine's return value by engine id, ``local()``'s value).

    An engine drops the requests that reach it while it handles an error in an earlier one
    (ipykernel's stop-on-error): those are sent again.
    """
    dead = _dead_engines(cluster, list(calls))
    if dead:
        raise _dead_error(cluster, dead)
    results: dict[int, Any] = {}
    mine = None
    todo = dict(calls)
    for attempt in range(5):
        pending = {e: cluster.client[e].apply_async(call) for e, call in todo.items()}
        if attempt == 0 and local is not None:
            mine = local()
        for e, ar in pending.items():
            value = _wait(cluster, ar, [e], timeout)
            if not _aborted([e], [value]):
                results[e] = value
        todo = {e: call for e, call in todo.items() if e not in results}
        if not todo:
            return results, mine
        time.sleep(0.2)
    raise ClusterError(f"engines {sorted(todo)} keep aborting requests: call abort_stale(cluster) and try again")


def _targets(cluster: Cluster, targets: list[int] | None) -> list[int]:
    """``targets``, else the numbered engines, else every registered one; raises if one is dead."""
    if targets is None:
        targets = cluster.layout.engine_ids if cluster.layout else cluster.client.ids
    ids = sorted(targets)
    if not ids:
        raise ClusterError(f"no engines are registered with the controller: {_RESTART_HINT}")
    dead = _dead_engines(cluster, ids)
    if dead:
        raise _dead_error(cluster, dead)
    return ids


def px(cluster: Cluster, code: str, *, local: bool = False, namespace: dict | None = None,
       targets: list[int] | None = None, timeout: float | None = None) -> Any:
    """``%%px [--local]`` from Python, with a watchdog: run the cell ``code`` on the engines (all
    those numbered by :func:`assign_process_ids`, or ``targets``) and, with ``local=True``, in this
    process too (in ``namespace``, else IPython's user namespace). ``%%everywhere`` (see
    :func:`activate`) is ``px(cluster, cell, local=True)``.

    The engines' execution is submitted without blocking, then the local one runs, then the
    engines are awaited (``timeout`` seconds at most): the order collective code such as
    ``jax.distributed.initialize`` needs. The local part runs in a worker thread while this thread
    watches the engines: an engine that dies meanwhile (killed, out of memory) ends the call within
    about a second with a ClusterError naming it, even when the local part is stuck for good in a
    collective with it. A timeout raises ClusterError too; an error in ``code`` itself is raised as
    such. Returns the engines' AsyncResult (``.display_outputs()`` shows their output).
    """
    ids = _targets(cluster, targets)
    ar = cluster.client[ids].execute(code, silent=False, block=False)
    if local:
        shell = _ipython()
        cell = compile_cell(code, "everywhere", shell if namespace is None else None)
        scope = user_namespace(namespace)
        run_watched(lambda: exec(cell, scope), lambda: _dead_engines(cluster, ids),  # the user's cell, as %%px runs it
                    lambda dead: _dead_error(cluster, dead))
    aborted = _aborted(ids, _wait(cluster, ar, ids, timeout))
    if aborted:
        raise ClusterError(
            ", ".join(cluster.describe(e) for e in aborted) + " dropped the code without running it: it arrived "
            "while the engine was handling an error of the previous code (or abort_stale aborted it). Run it again.")
    return ar


def _ipython() -> Any:
    """IPython's running shell, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def activate(cluster: Cluster) -> None:
    """The notebook's magics: ipyparallel's ``%px`` / ``%%px`` on a blocking view of every engine,
    and ``%%everywhere [--timeout S]``: the cell on every numbered engine and in this kernel, as
    ``%%px --local`` does, with the watchdog of :func:`px` (an engine dying during the cell ends it
    with an error naming the engine). Use ``%%everywhere`` for every cell that runs collectives."""
    cluster.client.activate()
    shell = _ipython()
    if shell is None:
        raise ClusterError("activate needs IPython (a notebook kernel): from Python, use px(cluster, code, local=True)")

    def everywhere(line: str, cell: str) -> None:
        words = line.split()
        timeout = float(words[words.index("--timeout") + 1]) if "--timeout" in words else None
        px(cluster, cell, local=True, timeout=timeout).display_outputs()

    shell.register_magic_function(everywhere, magic_kind="cell", magic_name="everywhere")


# ----------------------------------------------------------------------------- jax.distributed

def initialize_everywhere(cluster: Cluster, *, port: int | None = None, timeout: float = 300.0,
                          namespace: dict | None = None) -> Layout:
    """Initialize ``jax.distributed`` on every engine and in this process (the kernel).

    Numbers the processes first (:func:`assign_process_ids`) unless that was done (or ``port`` is
    given), submits :func:`initialize` to the engines without blocking, runs it here, then waits for
    the engines: what the ``%%px --local`` cell does. Returns the layout.
    """
    layout = cluster.layout
    if layout is None or port is not None:
        layout = assign_process_ids(cluster, port=port, namespace=namespace)
    n, coordinator = layout.num_processes, layout.coordinator
    calls = {e.engine_id: functools.partial(initialize, e.process_id, n, coordinator, timeout=timeout)
             for e in layout.engines}
    _call_everywhere(cluster, calls, timeout + 30,
                     local=functools.partial(initialize, layout.kernel_process_id, n, coordinator, timeout=timeout))
    return layout


def shutdown_everywhere(cluster: Cluster, *, timeout: float = 120.0) -> None:
    """Leave ``jax.distributed`` cleanly in every process (all must call it).

    Do this before stopping the cluster or the kernel; otherwise the survivors see a missing
    heartbeat and JAX ends them. Process 0, which runs the coordinator, leaves last: with
    ``jax_enable_recoverability`` nobody waits for the others at shutdown, and a process whose
    coordinator is gone before it left is ended by JAX. JAX cannot be initialized again in a
    process that computed (without :func:`reset_engines`).
    """
    ids = _targets(cluster, None)
    layout = cluster.layout
    if layout is None:
        _call_everywhere(cluster, {e: shutdown_here for e in ids}, timeout, local=shutdown_here)
        return
    first = [e.engine_id for e in layout.engines if e.process_id != 0 and e.engine_id in ids]
    last = [e.engine_id for e in layout.engines if e.process_id == 0 and e.engine_id in ids]
    kernel_first = layout.kernel_process_id != 0
    _call_everywhere(cluster, {e: shutdown_here for e in first}, timeout, local=shutdown_here if kernel_first else None)
    _call_everywhere(cluster, {e: shutdown_here for e in last}, timeout,
                     local=None if kernel_first else shutdown_here)


def clear_hung_initialize(cluster: Cluster | None = None, *, timeout: float = 60.0) -> dict[str, str]:
    """After ``initialize`` timed out (or a hung ``%%px`` cell was interrupted): reset
    ``jax.distributed`` in this process and, with ``cluster``, on every engine, so that
    :func:`initialize` / :func:`initialize_everywhere` can run again (use a new port).

    Queued tasks are aborted first. Returns what was done per process; an engine that does not
    answer within ``timeout`` is stuck: restart it (:func:`reset_engines`).
    """
    if cluster is None:
        return {"kernel": reset_here()}
    abort_stale(cluster)
    ids = _targets(cluster, None)
    # The engines first, without waiting, then here: a finished initialize shuts down in a barrier.
    engines, mine = _call_everywhere(cluster, {e: reset_here for e in ids}, timeout, local=reset_here)
    return {"kernel": mine} | {f"engine {e}": engines[e] for e in ids}


# ----------------------------------------------------------------------------- health

@dataclasses.dataclass
class HealthReport:
    """What every process runs on; ``problems`` lists the mismatches (empty when healthy)."""
    processes: list[dict]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        cols = ("role", "PROCESS_ID", "hostname", "pid", "python", "jax", "jaxlib", "dsr1", "platform", "local_devices",
                "executable")
        rows = [[str(p.get(c, "")) for c in cols] for p in self.processes]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        lines += ["problems:"] + [f"  - {p}" for p in self.problems] if self.problems else ["healthy"]
        return "\n".join(lines)


def _problems(processes: list[dict]) -> list[str]:
    """The mismatches between processes (each a probe result with a ``role``)."""
    problems = []
    for key, what in (("environment", "Python environment (sys.prefix, real sys.executable)"),
                      ("python", "Python version"), ("dsr1", "dsr1 version"), ("jax", "jax version"),
                      ("jaxlib", "jaxlib version")):
        values: dict[str, list[str]] = {}
        for p in processes:
            values.setdefault(str(p.get(key)), []).append(p["role"])
        if len(values) > 1:
            problems.append(f"different {what}: " + "; ".join(f"{v} on {', '.join(r)}" for v, r in values.items()))
        problems += [f"{p['role']}: {key} {p[key]}" for p in processes if str(p.get(key, "")).startswith("missing")
                     and len(values) == 1]
    initialized = [p for p in processes if p.get("distributed")]
    if initialized and len(initialized) < len(processes):
        problems.append("jax.distributed is initialized in " + ", ".join(p["role"] for p in initialized)
                        + " but not in " + ", ".join(p["role"] for p in processes if not p.get("distributed")))
    n = len(processes)
    for p in processes:
        if "process_count" in p and p["process_count"] != n:
            problems.append(f"{p['role']}: jax.process_count() is {p['process_count']}, the cluster has {n} processes")
        if "process_index" in p and p.get("PROCESS_ID") is not None and p["process_index"] != p["PROCESS_ID"]:
            problems.append(f"{p['role']}: jax.process_index() is {p['process_index']} "
                            f"but PROCESS_ID is {p['PROCESS_ID']}")
    devices = {p["local_devices"] for p in processes if "local_devices" in p}
    if len(devices) > 1:
        problems.append("different device counts per process: "
                        + ", ".join(f"{p['role']}: {p['local_devices']}" for p in processes if "local_devices" in p))
    if not any(p.get("provider") == "local" for p in processes):
        hosts: dict[str, list[str]] = {}
        for p in processes:
            hosts.setdefault(p["hostname"], []).append(p["role"])
        problems += [f"{', '.join(r)} run on the same host {h}: one engine per host expected"
                     for h, r in hosts.items() if len(r) > 1]
    return problems


def health_check(cluster: Cluster, *, timeout: float = 60.0, namespace: dict | None = None,
                 raise_on_problem: bool = True) -> HealthReport:
    """Compare the engines and this kernel: same Python environment (``sys.prefix`` and the
    real ``sys.executable``, so ``venv/bin/python`` and ``venv/bin/python3`` agree), Python, dsr1,
    jax and jaxlib versions, one engine per host (except on a local cluster) and, once ``jax.distributed`` is
    initialized, process count and index and devices per process. Run it after initialize
    (before, devices are not read: reading them would start JAX's backend).

    Raises ClusterError with the report when something differs (``raise_on_problem=False``:
    returns it, see ``report.problems``).
    """
    ids = _targets(cluster, None)
    infos, mine = _probe_everywhere(cluster, ids, devices=True, timeout=timeout, namespace=namespace)
    processes = [dict(info, role=f"engine {eid}") for eid, info in zip(ids, infos)] + [dict(mine, role="kernel")]
    report = HealthReport(processes=processes, problems=_problems(processes))
    if report.problems and raise_on_problem:
        raise ClusterError(f"cluster health check failed:\n{report}")
    return report


def clock_skew(cluster: Cluster, *, timeout: float = 30.0) -> dict[str, tuple[float, float]]:
    """Each engine's wall clock minus this host's, in seconds, with its uncertainty (half the
    round trip): ``{"engine 3 (process 1, host h, pid p)": (skew, uncertainty)}``. One engine at a
    time, so each round trip is short."""
    skews = {}
    for eid in _targets(cluster, None):
        sent = time.time()
        theirs = _wait(cluster, cluster.client[eid].apply_async(clock), [eid], timeout)
        received = time.time()
        skews[cluster.describe(eid)] = (theirs - (sent + received) / 2, (received - sent) / 2)
    return skews


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
    ids = _targets(cluster, None)
    engines, mine = _call_everywhere(cluster, {e: functools.partial(storage, paths) for e in ids}, timeout,
                                     local=functools.partial(storage, paths))
    return {"kernel": mine} | {cluster.describe(e): engines[e] for e in ids}


# ----------------------------------------------------------------------------- troubleshooting

def _on_live_engines(client: Any, call: Callable[[list[int]], Any], targets: Iterable[int], tries: int = 3) -> None:
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
    import signal

    client = cluster.client
    outstanding = list(client.outstanding)
    if not outstanding:
        return 0
    ids = client.ids
    _on_live_engines(client, lambda targets: client.abort(jobs=outstanding, targets=targets, block=False), ids)
    if interrupt:
        _on_live_engines(client, lambda targets: client.send_signal(signal.SIGINT, targets=targets, block=False), ids)
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

    Then re-run the notebook from "Initialize". Returns the new engines' ids.
    """
    client, info, layout = cluster.client, cluster.info or cluster_info(), cluster.layout
    old = set(client.ids)
    n = n or (len(layout.engines) if layout else 0) or int(info.get("engines") or 0) or len(old)
    if not n:
        raise ClusterError("reset_engines: how many engines? (pass n=)")
    if command is None:
        _run_scripts(info, "check", timeout)
    reset_here()
    abort_stale(cluster, interrupt=True, timeout=5)
    if old:
        _on_live_engines(client, lambda targets: client.shutdown(targets=targets, hub=False, block=False), old)
        deadline = time.monotonic() + 3  # engines stuck in a collective do not exit: the scripts stop them
        while set(client.ids) & old and time.monotonic() < deadline:
            time.sleep(0.2)
    if command is None:
        _run_scripts(info, "engines", timeout)
    else:
        _run(command, _scripts_env(info), timeout, "restarting the engines")
    deadline = time.monotonic() + timeout
    while len(set(client.ids) - old) < n or set(client.ids) & old:
        if time.monotonic() > deadline:
            raise ClusterError(f"{len(set(client.ids) - old)} of {n} engines came back within {timeout:.0f}s and "
                               f"{sorted(set(client.ids) & old)} of the old ones are still registered: see "
                               f"cluster_status and the engine logs")
        time.sleep(0.2)
    cluster.info = cluster_info(info.get("state")) or info
    cluster.layout = None  # the old engines' numbering
    assign_process_ids(cluster, port=port or _next_port(cluster.info, layout), namespace=namespace)
    return sorted(set(client.ids) - old)


def _next_port(info: dict[str, Any], layout: Layout | None) -> int:
    """A coordinator port for the next initialize: a free one on a local cluster (everything runs
    here), else the previous one + 1 (a port the old coordinator may still hold is avoided)."""
    if info.get("provider") == "local":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    previous = (layout.port if layout else None) or info.get("coordinator_port") or DEFAULT_COORDINATOR_PORT
    return int(previous) + 1


def _scripts_env(info: dict[str, Any]) -> dict[str, str]:
    """This environment plus the cluster's settings from cluster.json, for the scripts."""
    env = dict(os.environ)
    for key, name in (("provider", "MCJAX_PROVIDER"), ("state", "MCJAX_STATE"), ("cluster_id", "MCJAX_CLUSTER_ID"),
                      ("profile_dir", "MCJAX_PROFILE_DIR"), ("python", "MCJAX_PYTHON"),
                      ("local_devices", "MCJAX_LOCAL_DEVICES")):
        if info.get(key):
            env[name] = str(info[key])
    return env


def _run_scripts(info: dict[str, Any], what: str, timeout: float) -> None:
    """``cluster_restart WHAT`` of the scripts in cluster.json's ``root`` (with its mcjax.env on a host)."""
    root = info.get("root") or os.environ.get("MCJAX_ROOT")
    if not root:
        raise ClusterError("reset_engines: no cluster.json naming the scripts' folder: run cluster_restart yourself")
    script = '[ ! -f "$1/mcjax.env" ] || . "$1/mcjax.env"; . "$1/mcjax_defs.sh" && cluster_restart "$2"'
    failure = "a restart of the engines cannot succeed (nothing was stopped)" if what == "check" else \
        "restarting the engines"
    _run(["bash", "-c", script, "mcjax-reset-engines", str(root), what], _scripts_env(info), timeout, failure)


def _run(command: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ClusterError(f"{what} (exit status {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
