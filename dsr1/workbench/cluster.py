"""The notebook side of the multi-host workbench: connect to the ipyparallel cluster that
``mcjax_setup.sh`` started, number the JAX processes, initialize ``jax.distributed`` in all of
them, check they match, and recover from stale tasks, dead engines and a hung initialize.

Process layout: the engines on hosts 1..N-1 are JAX processes 0..N-2 (ordered by host index);
the notebook kernel on host 0 is process N-1. On TPU VMs JAX numbers the processes itself, by
TPU worker: there the kernel is process 0 and host i is process i. With
``./mcjax_setup.sh --local N`` the layout runs on this machine, each process with
``MCJAX_LOCAL_DEVICES`` fake CPU devices.

The pattern, in a notebook on host 0::

    from dsr1 import cluster
    client = cluster.connect()                    # reads $MCJAX_STATE/cluster.json
    cluster.wait_for_engines(client, N - 1)
    cluster.assign_process_ids(client)            # PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere
    client.activate()                             # the %px / %%px magics, on a blocking view

    %%px --local
    from dsr1 import cluster
    cluster.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR)

``%%px --local`` is safe for ``initialize``, which blocks until all N processes have joined:
ipyparallel's magic (8.x, 9.x) submits the cell to the engines *without blocking*, then runs it
in the kernel, then (on the blocking view of ``client.activate()``) waits for the engines and
shows their output. tests/test_cluster.py runs exactly this cell in an IPython shell acting as
process N-1. Never run the engines' part blocking first (``%px`` / ``%%px`` without
``--local``, ``view.execute(..., block=True)``) and the kernel's afterwards: the engines would
wait for the kernel and the kernel for them (``initialize`` then times out with a ClusterError).
From Python, :func:`initialize_everywhere` (or :func:`px` with ``local=True``) does the same as
the cell.

Troubleshooting: :func:`abort_stale` (queued or running tasks left behind),
:func:`clear_hung_initialize` (an initialize timed out: reset ``jax.distributed`` everywhere so
it can run again), :func:`reset_engines` (restart the engines, e.g. to free their memory),
:func:`health_check` (same Python, versions and devices everywhere?).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ipyparallel

DEFAULT_COORDINATOR_PORT = 8476
# jax's own initialization timeout ends the *process* (a fatal error, not an exception), so jax
# gets one that never fires and `initialize` enforces its own timeout, raising ClusterError.
_JAX_INIT_TIMEOUT = 10**7
_RESTART_HINT = ("restart the engines: `source mcjax_defs.sh && cluster_restart` (or "
                 "dsr1.cluster.reset_engines(client)), then assign_process_ids and initialize again")


class ClusterError(RuntimeError):
    """A cluster problem with what to do about it in the message."""


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


def connect(profile: str | os.PathLike | None = None, cluster_id: str | None = None,
            timeout: float = 30.0, *, state: str | os.PathLike | None = None) -> ipyparallel.Client:
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
    client._mcjax_info = cluster_info(state)  # type: ignore[attr-defined]
    return client


def wait_for_engines(client: ipyparallel.Client, n: int, timeout: float = 120.0) -> list[int]:
    """Wait until ``n`` engines are registered; returns their ids (sorted).

    Raises ClusterError naming how many came up within ``timeout`` seconds.
    """
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
    """The JAX processes: engines 0..N-2, the kernel N-1, and process 0's coordinator address
    (on TPU: the kernel 0, engines 1..N-1, coordinator None, as JAX numbers them there)."""
    num_processes: int
    kernel_process_id: int
    coordinator: str | None
    engines: tuple[EngineInfo, ...]

    @property
    def engine_ids(self) -> list[int]:
        return [e.engine_id for e in self.engines]

    def describe(self, engine_id: int) -> str:
        for e in self.engines:
            if e.engine_id == engine_id:
                return e.describe()
        return f"engine {engine_id}"


# Runs in every process (engines through execute, the kernel through exec): who and what it is.
# Devices are only read once JAX is initialized: reading them earlier would start JAX's backend
# and make jax.distributed.initialize impossible in that process.
_PROBE = r'''
def _mcjax_probe(controller_ip, devices):
    import os, socket, sys
    info = {"hostname": socket.gethostname(), "pid": os.getpid(), "executable": sys.executable,
            "environment": f"{sys.prefix} ({os.path.realpath(sys.executable)})", "python": sys.version.split()[0],
            "host_index": os.environ.get("MCJAX_HOST_INDEX"),
            "provider": os.environ.get("MCJAX_PROVIDER"),
            "PROCESS_ID": globals().get("PROCESS_ID"), "NUM_PROCESSES": globals().get("NUM_PROCESSES")}
    try:  # the address this host uses to reach the controller: where process 0's coordinator listens
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((controller_ip, 9))
            info["address"] = s.getsockname()[0]
    except OSError:
        info["address"] = "127.0.0.1"
    try:
        import dsr1.workbench.cluster
        info["accelerator"] = dsr1.workbench.cluster.detect_platform()
    except Exception:
        info["accelerator"] = "unknown"
    for name in ("dsr1", "jax", "jaxlib", "ipyparallel"):
        try:
            info[name] = getattr(__import__(name), "__version__", "?")
        except Exception as e:
            info[name] = f"missing ({type(e).__name__}: {e})"
    if devices and not info["jax"].startswith("missing"):
        import jax
        from jax._src import xla_bridge
        info["distributed"] = jax.distributed.is_initialized()
        if info["distributed"] or xla_bridge.backends_are_initialized():
            info.update(platform=jax.default_backend(), local_devices=jax.local_device_count(),
                        devices=jax.device_count(), process_index=jax.process_index(),
                        process_count=jax.process_count())
    return info
'''


def _namespace(namespace: dict | None) -> dict:
    """The kernel's namespace: ``namespace``, else IPython's user namespace, else ``__main__``'s."""
    if namespace is not None:
        return namespace
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except ImportError:
        pass
    import __main__

    return __main__.__dict__


def _controller_ip(client: ipyparallel.Client) -> str:
    interface = str(getattr(client, "_config", {}).get("interface", ""))
    ip = interface.split("://")[-1].strip("[]") if interface else ""
    return ip or getattr(client, "_mcjax_info", {}).get("controller_ip") or "127.0.0.1"


def _probe(client: ipyparallel.Client, engine_ids: list[int], devices: bool, timeout: float,
           namespace: dict | None = None) -> tuple[list[dict], dict]:
    """Run the probe on the engines and in this process; returns (engine infos, kernel info)."""
    ip = _controller_ip(client)
    code = f"{_PROBE}\n_mcjax_probe_result = _mcjax_probe({ip!r}, {devices!r})\n"
    _run(client, {e: code for e in engine_ids}, timeout)
    infos = _pull(client, engine_ids, "_mcjax_probe_result", timeout)
    ns = dict(_namespace(namespace))  # a copy: the probe's helper names stay out of the kernel's namespace
    exec(compile(code, "<mcjax probe>", "exec"), ns)
    return list(infos), ns["_mcjax_probe_result"]


def _layout(engine_ids: list[int], infos: list[dict], port: int, tpu: bool) -> Layout:
    """Number the processes from the engines' probes: engines by host index (then engine id)."""
    def order(pair: tuple[int, dict]) -> tuple:
        index = pair[1]["host_index"]
        return (index is None, int(index) if index is not None else 0, pair[0])

    ranked = sorted(zip(engine_ids, infos), key=order)
    n = len(ranked) + 1
    # TPU: JAX numbers the processes itself, by TPU worker (= host index): the kernel is 0.
    first = 1 if tpu else 0
    coordinator = None if tpu else f"{ranked[0][1]['address']}:{port}"
    engines = tuple(
        EngineInfo(engine_id=eid, process_id=first + rank, hostname=info["hostname"], pid=int(info["pid"]),
                   host_index=None if info["host_index"] is None else int(info["host_index"]),
                   address=info["address"])
        for rank, (eid, info) in enumerate(ranked))
    return Layout(num_processes=n, kernel_process_id=0 if tpu else n - 1, coordinator=coordinator, engines=engines)


def assign_process_ids(client: ipyparallel.Client, *, port: int | None = None, timeout: float = 60.0,
                       namespace: dict | None = None) -> Layout:
    """Give every engine a JAX process id 0..N-2 (in host index order) and the kernel N-1.

    Sets ``PROCESS_ID``, ``NUM_PROCESSES`` and ``COORDINATOR`` (process 0's address and ``port``,
    default ``$MCJAX_COORDINATOR_PORT`` or 8476) in each engine's namespace and in the kernel's
    (``namespace``, else IPython's user namespace), so one ``%%px --local`` cell reads the right
    values everywhere. Run it again after engines were restarted.

    On TPU VMs JAX assigns the process ids itself, by TPU worker: there the kernel (host 0) is
    process 0, engine hosts 1..N-1 are processes 1..N-1 and ``COORDINATOR`` is None (automatic).
    """
    ids = sorted(client.ids)
    if not ids:
        raise ClusterError(f"no engines are registered with the controller: {_RESTART_HINT}")
    infos, mine = _probe(client, ids, devices=False, timeout=timeout, namespace=namespace)
    tpu = mine["accelerator"] == "tpu" and all(i["accelerator"] == "tpu" for i in infos)
    layout = _layout(ids, infos, port or int(os.environ.get("MCJAX_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT)), tpu)
    n, coordinator = layout.num_processes, layout.coordinator
    _run(client, {e.engine_id: f"PROCESS_ID, NUM_PROCESSES, COORDINATOR = {e.process_id}, {n}, {coordinator!r}"
                  for e in layout.engines}, timeout)
    _namespace(namespace).update(PROCESS_ID=layout.kernel_process_id, NUM_PROCESSES=n, COORDINATOR=coordinator)
    client._mcjax_layout = layout  # type: ignore[attr-defined]
    return layout


# ----------------------------------------------------------------------------- running code

def _dead_engines(client: ipyparallel.Client, engine_ids: list[int]) -> list[int]:
    """Engines among ``engine_ids`` that left the controller, or whose process here is gone."""
    registered = set(client.ids)
    layout: Layout | None = getattr(client, "_mcjax_layout", None)
    here = socket.gethostname()
    dead = []
    for eid in engine_ids:
        if eid not in registered:
            dead.append(eid)
            continue
        info = next((e for e in layout.engines if e.engine_id == eid), None) if layout else None
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


def _dead_error(client: ipyparallel.Client, dead: list[int]) -> ClusterError:
    layout: Layout | None = getattr(client, "_mcjax_layout", None)
    names = ", ".join(layout.describe(e) if layout else f"engine {e}" for e in dead)
    return ClusterError(
        f"{names} {'is' if len(dead) == 1 else 'are'} gone: the engine died or was stopped (killed, out of memory, or a crash in JAX; "
        f"its log is $MCJAX_STATE/logs/engine-<host index>.log). The other processes cannot go on "
        f"with jax.distributed without it: {_RESTART_HINT}.")


def _wait(client: ipyparallel.Client, ar: Any, engine_ids: list[int], timeout: float | None) -> Any:
    """Wait for ``ar`` (one task per engine of ``engine_ids``), turning dead engines and timeouts
    into ClusterErrors that say what to do. Errors raised by the code itself propagate as usual;
    aborted tasks come back as TaskAborted results (see :func:`_aborted`)."""
    import ipyparallel as ipp

    deadline = None if timeout is None else time.monotonic() + timeout
    while not ar.wait(0.25):
        dead = _dead_engines(client, engine_ids)
        if dead:
            raise _dead_error(client, dead)
        if deadline is not None and time.monotonic() > deadline:
            outstanding = client.outstanding
            busy = [e for e, m in zip(engine_ids, ar.msg_ids) if m in outstanding] or engine_ids
            layout: Layout | None = getattr(client, "_mcjax_layout", None)
            names = ", ".join(layout.describe(e) if layout else f"engine {e}" for e in busy)
            raise ClusterError(
                f"{names} did not finish within {timeout:.0f}s. If it waits for the other processes "
                f"(a collective, or jax.distributed.initialize), one of them did not take part. "
                f"Interrupt it with dsr1.cluster.abort_stale(client, interrupt=True); after a hung "
                f"initialize call clear_hung_initialize(client); if it stays busy, {_RESTART_HINT}.")
    try:
        return ar.get()
    except ipp.error.TaskAborted as e:  # raised for one target, returned in the list for several
        return e
    except ipp.error.CompositeError as e:
        died = [(info or {}).get("engine_id") for ename, _value, _tb, info in e.elist if ename == "EngineError"]
        if died:
            raise _dead_error(client, [d for d in died if d is not None] or engine_ids) from e
        raise
    except ipp.error.EngineError as e:
        raise _dead_error(client, _dead_engines(client, engine_ids) or engine_ids) from e


def _aborted(ids: list[int], results: Any) -> list[int]:
    """The engines whose task came back aborted (ipyparallel returns those without raising)."""
    import ipyparallel as ipp

    return [e for e, r in zip(ids, results) if isinstance(r, ipp.error.TaskAborted)]


def _run(client: ipyparallel.Client, code: dict[int, str], timeout: float, local: Any = None) -> Any:
    """Our own bookkeeping code, per engine, submitted to all of them before ``local()`` (if
    given: its value is returned) runs here. An engine drops the requests that reach it while it
    handles an error in an earlier one (ipykernel's stop-on-error): those are sent again."""
    todo = dict(code)
    mine = None
    for attempt in range(5):
        ars = {e: client[e].execute(c, silent=False, block=False) for e, c in todo.items()}
        if attempt == 0 and local is not None:
            mine = local()
        todo = {e: todo[e] for e, ar in ars.items() if _aborted([e], [_wait(client, ar, [e], timeout)])}
        if not todo:
            return mine
        time.sleep(0.2)
    raise ClusterError(f"engines {sorted(todo)} keep aborting requests: call abort_stale(client) and try again")


def _pull(client: ipyparallel.Client, ids: list[int], name: str, timeout: float) -> list:
    """The value of ``name`` on each engine of ``ids`` (aborted pulls are sent again)."""
    values: dict[int, Any] = {}
    todo = list(ids)
    for _attempt in range(5):
        results = client[todo].pull(name, block=False).get(timeout=timeout)  # a list: targets is a list
        values.update({e: r for e, r in zip(todo, results) if e not in _aborted([e], [r])})
        todo = [e for e in ids if e not in values]
        if not todo:
            return [values[e] for e in ids]
        time.sleep(0.2)
    raise ClusterError(f"engines {todo} keep aborting requests: call abort_stale(client) and try again")


def _targets(client: ipyparallel.Client, targets: list[int] | None) -> list[int]:
    layout: Layout | None = getattr(client, "_mcjax_layout", None)
    ids = sorted(targets if targets is not None else (layout.engine_ids if layout else client.ids))
    if not ids:
        raise ClusterError(f"no engines are registered with the controller: {_RESTART_HINT}")
    dead = _dead_engines(client, ids)
    if dead:
        raise _dead_error(client, dead)
    return ids


def px(client: ipyparallel.Client, code: str, *, local: bool = False, namespace: dict | None = None,
       targets: list[int] | None = None, timeout: float | None = None) -> Any:
    """``%%px [--local]`` from Python: run ``code`` on the engines (all those numbered by
    :func:`assign_process_ids`, or ``targets``) and, with ``local=True``, in this process too.

    The engines' execution is submitted without blocking, then the local one runs, then the
    engines are awaited (``timeout`` seconds at most): the order collective code such as
    ``jax.distributed.initialize`` needs. A dead engine or a timeout raises ClusterError naming
    the engine and the way out; an error in ``code`` itself is raised as such. Returns the
    engines' AsyncResult (``.display_outputs()`` shows their output).
    """
    ids = _targets(client, targets)
    ar = client[ids].execute(code, silent=False, block=False)
    if local:
        exec(compile(code, "<px --local>", "exec"), _namespace(namespace))
    aborted = _aborted(ids, _wait(client, ar, ids, timeout))
    if aborted:
        layout: Layout | None = getattr(client, "_mcjax_layout", None)
        raise ClusterError(
            ", ".join(layout.describe(e) if layout else f"engine {e}" for e in aborted) + " dropped the code without "
            "running it: it arrived while the engine was handling an error of the previous code (or abort_stale "
            "aborted it). Run it again.")
    return ar


# ----------------------------------------------------------------------------- jax.distributed

def detect_platform() -> str:
    """``tpu``, ``gpu`` or ``cpu``, without starting JAX: from ``JAX_PLATFORMS``, else the
    installed plugins (libtpu, jax CUDA/ROCm plugins)."""
    import importlib.util

    first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in
           ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")):
        return "gpu"
    return "cpu"


@dataclasses.dataclass
class _Init:
    """This process's jax.distributed.initialize, run in a thread so it can time out."""
    args: tuple
    done: threading.Event
    thread: threading.Thread | None = None
    error: BaseException | None = None


_INIT: _Init | None = None
_INIT_LOCK = threading.Lock()


def initialize(process_id: int, num_processes: int, coordinator: str | None = None, *,
               timeout: float = 300.0, platform: str | None = None) -> None:
    """``jax.distributed.initialize`` for this process, with a timeout that raises instead of hanging.

    On TPU (without ``coordinator``) JAX finds the processes itself. On GPU and CPU the
    coordinator ``host:port`` (process 0's address) is required; on CPU the gloo collectives
    are selected. Must run before anything starts JAX's backend (``jax.devices()``, a
    computation) in this process. Calling it again with the same arguments is a no-op (re-running
    the ``%%px --local`` cell is harmless); after a timeout, fix the cause and call it again with
    the same arguments (the first attempt may still complete), or call :func:`clear_hung_initialize`
    and start over with a new port.
    """
    global _INIT
    import jax
    from jax._src import xla_bridge

    platform = (platform or detect_platform()).lower()
    args = (process_id, num_processes, coordinator)
    where = f"process {process_id} of {num_processes} (coordinator {coordinator or 'auto'})"
    with _INIT_LOCK:
        init = _INIT
        if init is not None and init.args != args:
            state = "is still waiting" if not init.done.is_set() else "ran"
            raise ClusterError(
                f"jax.distributed.initialize {state} in this process as process {init.args[0]} of "
                f"{init.args[1]} (coordinator {init.args[2]}): call dsr1.cluster.clear_hung_initialize() "
                f"first (or restart the process) to initialize as {where}.")
        if init is None:
            if xla_bridge.backends_are_initialized():
                raise ClusterError(
                    "JAX has already started its devices in this process (jax.devices(), a computation, "
                    "or a health check before initialize): jax.distributed.initialize must come first. "
                    "Restart this process (reset_engines for engines, restart the kernel) and initialize first.")
            if platform == "tpu" and coordinator is None:
                kwargs: dict[str, Any] = {}
            elif coordinator is None:
                raise ClusterError(f"initialize on {platform} needs the coordinator 'host:port' of process 0 "
                                   f"(assign_process_ids sets COORDINATOR)")
            else:
                # Process 0's coordinator listens on its own address only (JAX's default is [::]).
                kwargs = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                              coordinator_bind_address=coordinator)
            if platform == "cpu":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")

            def run(init: _Init) -> None:
                try:
                    jax.distributed.initialize(initialization_timeout=_JAX_INIT_TIMEOUT, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    init.error = e
                finally:
                    init.done.set()

            init = _Init(args, threading.Event())
            init.thread = threading.Thread(target=run, args=(init,), name="mcjax-initialize", daemon=True)
            _INIT = init
            init.thread.start()
    deadline = time.monotonic() + timeout
    while not init.done.wait(0.2):
        if time.monotonic() > deadline:
            raise ClusterError(
                f"jax.distributed.initialize did not complete within {timeout:.0f}s in {where}: not all "
                f"{num_processes} processes joined. Usual causes: an engine is dead or busy (health_check, "
                f"cluster_status), the engines ran it blocking before the kernel (use %%px --local or "
                f"initialize_everywhere), a wrong NUM_PROCESSES, or the coordinator port is blocked or in "
                f"use. Then call dsr1.cluster.clear_hung_initialize(client) and initialize with a new port.")
    if init.error is not None:
        raise ClusterError(f"jax.distributed.initialize failed in {where}: {init.error}; call "
                           f"clear_hung_initialize before trying again") from init.error


def initialize_everywhere(client: ipyparallel.Client, *, port: int | None = None, timeout: float = 300.0,
                          namespace: dict | None = None) -> Layout:
    """Initialize ``jax.distributed`` on every engine and in this process (process N-1).

    Numbers the processes first (:func:`assign_process_ids`) unless that was done, submits
    ``initialize`` to the engines without blocking, runs it here, then waits for the engines:
    what ``%%px --local`` does. Returns the layout.
    """
    layout = getattr(client, "_mcjax_layout", None)
    if layout is None or port is not None:
        layout = assign_process_ids(client, port=port, namespace=namespace)
    code = ("import dsr1.workbench.cluster as _mcjax_cluster\n"
            f"_mcjax_cluster.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR, timeout={timeout!r})\n")
    px(client, code, local=True, namespace=namespace, timeout=timeout + 30)
    return layout


def shutdown_everywhere(client: ipyparallel.Client, *, timeout: float = 120.0, namespace: dict | None = None) -> None:
    """Leave ``jax.distributed`` cleanly in every process (all must call it: it is a barrier).

    Do this before stopping the cluster or the kernel; otherwise the survivors see a missing
    heartbeat and JAX ends them. JAX cannot be initialized again in a process that computed.
    """
    code = "import dsr1.workbench.cluster as _mcjax_cluster\n_mcjax_cluster._shutdown_here()\n"
    px(client, code, local=True, namespace=namespace, timeout=timeout)


def _shutdown_here() -> None:
    global _INIT
    import jax

    jax.distributed.shutdown()
    _INIT = None


def _reset_here() -> str:
    """Forget this process's jax.distributed state so initialize can run again: a finished
    initialize is shut down (a barrier, so every process must do it), a pending one is abandoned
    (its thread stays blocked on a coordinator that is closed) and the coordinator service of
    process 0 is stopped."""
    global _INIT
    import jax
    from jax._src import distributed

    init, state = _INIT, distributed.global_state
    if init is not None and init.done.is_set() and init.error is None:
        # A barrier with the other processes: bounded, in case one of them is gone.
        done = threading.Event()
        threading.Thread(target=lambda: (jax.distributed.shutdown(), done.set()), daemon=True).start()
        what = "shut down" if done.wait(30) else "reset (the shutdown barrier timed out)"
        if not done.is_set():
            state.client = state.service = state.preemption_sync_manager = None
    elif init is None and state.client is None and state.service is None:
        what = "nothing to reset"
    else:
        state.client = None  # abandoned: the stuck thread keeps its reference
        state.preemption_sync_manager = None
        if state.service is not None:
            state.service.shutdown()
            state.service = None
        what = "reset a pending initialize" if init is not None and not init.done.is_set() else "reset"
    _INIT = None
    return what


def clear_hung_initialize(client: ipyparallel.Client | None = None, *, timeout: float = 60.0) -> dict[str, str]:
    """After ``initialize`` timed out (or a hung ``%%px`` cell was interrupted): reset
    ``jax.distributed`` in this process and, with ``client``, on every engine, so that
    :func:`initialize` / :func:`initialize_everywhere` can run again (use a new port).

    Queued tasks are aborted first. Returns what was done per process; an engine that does not
    answer within ``timeout`` is stuck: restart it (:func:`reset_engines`).
    """
    if client is None:
        return {"kernel": _reset_here()}
    abort_stale(client)
    ids = _targets(client, None)
    # The engines first, without waiting, then here: a finished initialize shuts down in a barrier.
    report = {"kernel": _run(client, {e: "import dsr1.workbench.cluster as _mcjax_cluster\n"
                                         "_mcjax_reset = _mcjax_cluster._reset_here()\n" for e in ids},
                             timeout, local=_reset_here)}
    report.update({f"engine {e}": what for e, what in zip(ids, _pull(client, ids, "_mcjax_reset", timeout))})
    return report


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
        cols = ("role", "PROCESS_ID", "hostname", "pid", "jax", "dsr1", "platform", "local_devices", "executable")
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


def health_check(client: ipyparallel.Client, *, timeout: float = 60.0, namespace: dict | None = None,
                 raise_on_problem: bool = True) -> HealthReport:
    """Compare the engines and this kernel: same Python environment (``sys.prefix`` and the
    real ``sys.executable``, so ``venv/bin/python`` and ``venv/bin/python3`` agree), Python, dsr1,
    jax and jaxlib versions, one engine per host (except on a local cluster) and, once ``jax.distributed`` is
    initialized, process count and index and devices per process. Run it after initialize
    (before, devices are not read: reading them would start JAX's backend).

    Raises ClusterError with the report when something differs (``raise_on_problem=False``:
    returns it, see ``report.problems``).
    """
    ids = _targets(client, None)
    infos, mine = _probe(client, ids, devices=True, timeout=timeout, namespace=namespace)
    processes = [dict(info, role=f"engine {eid}") for eid, info in zip(ids, infos)] + [dict(mine, role="kernel")]
    report = HealthReport(processes=processes, problems=_problems(processes))
    if report.problems and raise_on_problem:
        raise ClusterError(f"cluster health check failed:\n{report}")
    return report


# ----------------------------------------------------------------------------- troubleshooting

def abort_stale(client: ipyparallel.Client, *, interrupt: bool = False, timeout: float = 10.0) -> int:
    """Abort the tasks still queued on the engines (e.g. left by an interrupted cell); with
    ``interrupt=True`` also send SIGINT to engines still running one. Returns how many tasks were
    outstanding. Code blocked inside JAX may ignore SIGINT: then :func:`reset_engines`."""
    import signal

    outstanding = list(client.outstanding)
    if not outstanding:
        return 0
    ids = sorted(client.ids)
    if ids:
        client.abort(jobs=outstanding, targets=ids, block=False)
        if interrupt:
            client.send_signal(signal.SIGINT, targets=ids, block=False)
    deadline = time.monotonic() + timeout
    while client.outstanding & set(outstanding) and time.monotonic() < deadline:
        client.spin()
        time.sleep(0.1)
    return len(outstanding)


def reset_engines(client: ipyparallel.Client, *, n: int | None = None, timeout: float = 180.0,
                  command: list[str] | None = None) -> list[int]:
    """Restart every engine (e.g. to free the memory they hold, or after one died): abort stale
    tasks, ask the engines to exit, run the scripts' ``cluster_restart engines`` (``command``
    overrides it), then wait for ``n`` new engines (default: as many as before). Returns their
    ids; run :func:`assign_process_ids` / :func:`initialize_everywhere` again afterwards.

    For a real cluster the restart runs on this host (host 0), which must reach the others
    with the provider's tools (gcloud or ssh); otherwise run ``cluster_restart`` yourself.
    """
    info = getattr(client, "_mcjax_info", None) or cluster_info()
    layout: Layout | None = getattr(client, "_mcjax_layout", None)
    old = set(client.ids)
    n = n or (len(layout.engines) if layout else 0) or int(info.get("engines") or 0) or len(old)
    if not n:
        raise ClusterError("reset_engines: how many engines? (pass n=)")
    abort_stale(client, interrupt=True, timeout=5)
    if old:
        client.shutdown(targets=sorted(old), hub=False, block=False)
        deadline = time.monotonic() + 10
        while set(client.ids) & old and time.monotonic() < deadline:
            time.sleep(0.2)
    if command is None:
        root = info.get("root") or os.environ.get("MCJAX_ROOT")
        if not root:
            raise ClusterError("reset_engines: no cluster.json naming the scripts' folder: "
                               "run cluster_restart yourself")
        command = ["bash", "-c", '[ ! -f "$1/mcjax.env" ] || . "$1/mcjax.env"; . "$1/mcjax_defs.sh" && '
                   'cluster_restart engines', "mcjax-reset-engines", str(root)]
    env = dict(os.environ)
    for key, name in (("provider", "MCJAX_PROVIDER"), ("state", "MCJAX_STATE"), ("cluster_id", "MCJAX_CLUSTER_ID"),
                      ("profile_dir", "MCJAX_PROFILE_DIR"), ("python", "MCJAX_PYTHON"),
                      ("local_devices", "MCJAX_LOCAL_DEVICES")):
        if info.get(key):
            env[name] = str(info[key])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ClusterError(f"restarting the engines failed (exit status {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    deadline = time.monotonic() + timeout
    while len(set(client.ids) - old) < n or set(client.ids) & old:
        if time.monotonic() > deadline:
            raise ClusterError(f"{len(set(client.ids) - old)} of {n} engines came back within {timeout:.0f}s and "
                               f"{sorted(set(client.ids) & old)} of the old ones are still registered: see "
                               f"cluster_status and the engine logs")
        time.sleep(0.2)
    client._mcjax_layout = None  # type: ignore[attr-defined]
    return sorted(set(client.ids) - old)
