"""What runs inside each JAX process of the workbench cluster: the engines receive these functions
through ipyparallel's ``apply``, the notebook kernel calls them directly.

- :func:`probe`: who and what this process is (host, environment, versions, devices);
- :func:`initialize`: ``jax.distributed.initialize`` with a timeout that raises instead of hanging;
- :func:`prepare_process`, :func:`shutdown_here`, :func:`reset_here`: the per-process steps of
  ``assign_process_ids``, ``shutdown_everywhere``, ``clear_hung_initialize`` and ``reset_engines``
  in :mod:`dsr1.workbench`.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

# jax's own initialization timeout ends the *process* (a fatal error, not an exception), so jax
# gets one that never fires and `initialize` enforces its own timeout, raising ClusterError.
_JAX_INIT_TIMEOUT = 10**7


class ClusterError(RuntimeError):
    """A cluster problem with what to do about it in the message."""


def user_namespace(namespace: dict | None = None) -> dict:
    """Where notebook cells keep their names: ``namespace``, else IPython's user namespace (the
    kernel's, or an engine's), else ``__main__``'s."""
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


def define_process_names(process_id: int, num_processes: int, coordinator: str | None,
                          namespace: dict | None = None, *, kernel_process_id: int | None = None) -> None:
    """``PROCESS_ID``, ``NUM_PROCESSES``, ``COORDINATOR`` and ``KERNEL_PROCESS_ID`` (the notebook
    kernel's id, e.g. to show progress there only) in this process's user namespace, for the
    ``%%everywhere`` / ``%%px --local`` cells."""
    user_namespace(namespace).update(PROCESS_ID=process_id, NUM_PROCESSES=num_processes, COORDINATOR=coordinator,
                                     KERNEL_PROCESS_ID=kernel_process_id)


def prepare_process(process_id: int, num_processes: int, coordinator: str | None, *,
                    env: dict[str, str] | None = None, cache_dir: str | None = None,
                    kernel_process_id: int | None = None, namespace: dict | None = None,
                    cwd: str | None = None) -> None:
    """This process's part of ``assign_process_ids``, before ``initialize``: the names of
    :func:`define_process_names`, the environment variables ``env`` (the platform's variables
    from which JAX numbers the processes itself, ``JAX_COORDINATOR_PORT``,
    ``JAX_COORDINATOR_BIND_ADDRESS``), with ``cache_dir`` JAX's persistent compilation cache and,
    with ``cwd`` (the kernel's working folder: the notebook's, on the shared folder) that working
    folder where this host has it, so that relative paths in cells mean the same everywhere.
    """
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    os.environ.update(env or {})
    if cache_dir:
        use_compilation_cache(cache_dir)
    define_process_names(process_id, num_processes, coordinator, namespace, kernel_process_id=kernel_process_id)


def use_fake_cpu_devices(count: int) -> None:
    """This process's JAX on ``count`` CPU devices (read when JAX starts its backend): the device
    count replaces any in ``$XLA_FLAGS``; the caller's other XLA flags stay."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={int(count)}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in ``path`` (the cluster's shared folder), for every
    program however fast it compiled (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``, default 0 as
    the cluster scripts set it). Must come before this process compiles its first program: JAX
    decides once, at its first compilation, whether it uses a cache, so a process that already
    computed is left as it is."""
    import jax

    from . import jax_internals

    if jax_internals.backends_are_initialized():
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")))


# ----------------------------------------------------------------------------- probe

ACCELERATOR_FILES = {"tpu": ("accel*", "vfio/[0-9]*"), "gpu": ("nvidia[0-9]*", "kfd")}  # under /dev
LOCKS = {"tpu": "tpu", "gpu": "cuda12"}  # the cluster/locks/<name>.txt that brings JAX's plugin for each


def accelerator_files() -> dict[str, list[str]]:
    """The accelerator chips' device files by platform: under ``$MCJAX_DEV_DIR`` (a test's stand-in
    for this machine's devices), else ``/dev``."""
    root = os.environ.get("MCJAX_DEV_DIR") or "/dev"
    return {kind: sorted(f for pattern in patterns for f in glob.glob(f"{root}/{pattern}"))
            for kind, patterns in ACCELERATOR_FILES.items()}


def detect_platform() -> str:
    """``tpu``, ``gpu`` or ``cpu``, without starting JAX: from ``JAX_PLATFORMS``, else an installed
    plugin (libtpu, jax's CUDA/ROCm plugins) together with the chips' device files. A plugin alone
    says nothing: libtpu is also installed to compile for TPUs on machines that have none."""
    first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    chips = accelerator_files()
    if importlib.util.find_spec("libtpu") is not None and chips["tpu"]:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in
           ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")) and chips["gpu"]:
        return "gpu"
    return "cpu"


def unused_accelerator(root: str = ".") -> str | None:
    """Why this machine would run on CPU although it has accelerator chips (their device files are
    here but JAX's plugin for them is not installed), naming the lock under ``root`` (the repository)
    to install; None when JAX here uses what the machine has, or ``JAX_PLATFORMS`` chose."""
    if os.environ.get("JAX_PLATFORMS") or detect_platform() != "cpu":
        return None
    for kind, files in accelerator_files().items():
        if files:
            lock = os.path.join(root, "cluster", "locks", f"{LOCKS[kind]}.txt")
            return (f"this machine has {kind.upper()} chips ({', '.join(files[:4])}) but {sys.executable}'s jax "
                    f"cannot use them (its {kind} plugin is not installed), so it would run on the CPU: install "
                    f"the platform's lock, pip install -r {lock} (then pip install --no-deps -e {root}), or set "
                    f"JAX_PLATFORMS=cpu to run on the CPU")
    return None


def probe(controller_ip: str, devices: bool, namespace: dict | None = None) -> dict[str, Any]:
    """Who and what this process is: host, pid, Python environment and version, the versions of
    dsr1, jax, jaxlib and ipyparallel, the accelerator, the address on which it reaches the
    controller at ``controller_ip`` (where process 0's coordinator listens), the ``PROCESS_ID`` /
    ``NUM_PROCESSES`` of its user namespace, whether JAX was started here (``jax_started``) and,
    with ``devices``, its JAX devices.

    Devices are only read once JAX is initialized (``jax.distributed`` or a computation): reading
    them earlier would start JAX's backend and make ``jax.distributed.initialize`` impossible here.
    """
    names = user_namespace(namespace)
    info: dict[str, Any] = {
        "hostname": socket.gethostname(), "pid": os.getpid(), "executable": sys.executable,
        "environment": f"{sys.prefix} ({os.path.realpath(sys.executable)})", "python": sys.version.split()[0],
        "host_index": os.environ.get("MCJAX_HOST_INDEX"), "provider": os.environ.get("MCJAX_PROVIDER"),
        "PROCESS_ID": names.get("PROCESS_ID"), "NUM_PROCESSES": names.get("NUM_PROCESSES"),
        "address": address_towards(controller_ip), "accelerator": detect_platform(), "host_key": host_key(),
    }
    info.update({name: _version(name) for name in ("dsr1", "jax", "jaxlib", "ipyparallel")})
    info["jax_started"] = jax_started()
    if devices:
        info.update(_devices_if_started())
    return info


def jax_started() -> bool:
    """Whether this process has joined ``jax.distributed`` (or begun to) or started JAX's devices:
    then it cannot join a new group of processes without a restart."""
    import jax

    from . import jax_internals

    return (_INIT is not None or jax.distributed.is_initialized() or jax_internals.has_distributed_state()
            or jax_internals.backends_are_initialized())


def host_key() -> str:
    """What tells this host from another: the kernel's boot id (a new one each boot, so cloned
    machines with one hostname differ) and the network namespace (hosts sharing a kernel, in
    containers or namespaces, differ there). Processes of one host have the same key."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        network = os.readlink("/proc/self/ns/net")
    except OSError:
        network = ""
    return f"{boot} {network}".strip()


def address_towards(ip: str) -> str:
    """This host's address on the route to ``ip`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception as e:  # noqa: BLE001 - reported, the health check names it
        return f"missing ({type(e).__name__}: {e})"


def _devices_if_started() -> dict[str, Any]:
    import jax

    from . import jax_internals

    info: dict[str, Any] = {"distributed": jax.distributed.is_initialized()}
    if info["distributed"] or jax_internals.backends_are_initialized():
        info.update(platform=jax.default_backend(), local_devices=jax.local_device_count(),
                    devices=jax.device_count(), process_index=jax.process_index(), process_count=jax.process_count())
    return info


def clock() -> float:
    """This host's wall clock (``time.time()``), for the clock skew between hosts."""
    return time.time()


def storage(paths: list[str]) -> list[dict[str, Any]]:
    """For each of ``paths`` as this host sees it: whether it exists, the mount it is on (mount
    point, file system type such as ``nfs4`` or ``fuse.gcsfuse``, source) and the free space."""
    mounts = _mounts()
    out = []
    for path in paths:
        real = os.path.realpath(path)
        point = max((m for m in mounts if real == m or real.startswith(m.rstrip("/") + "/")), key=len, default="/")
        fstype, source = mounts.get(point, ("?", "?"))
        entry: dict[str, Any] = {"path": path, "exists": os.path.exists(path), "mount": point, "fstype": fstype,
                                 "source": source, "free_bytes": None}
        if entry["exists"]:
            entry["free_bytes"] = shutil.disk_usage(path).free
        out.append(entry)
    return out


def _mounts() -> dict[str, tuple[str, str]]:
    """Mount point -> (file system type, source), from /proc/mounts (the last mount on a point wins)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return {}
    mounts = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ")
            mounts[point] = (fields[2], fields[0])
    return mounts


# ----------------------------------------------------------------------------- jax.distributed

@dataclasses.dataclass
class _Init:
    """This process's jax.distributed.initialize, run in a thread so it can time out."""
    args: tuple
    done: threading.Event
    thread: threading.Thread | None = None
    error: BaseException | None = None


# The one initialize of this process. Module state on purpose: it mirrors jax.distributed's own
# per-process state (one initialize per process), and every caller in the process (a %%px cell,
# initialize_everywhere, clear_hung_initialize) must see the same one.
_INIT: _Init | None = None
_INIT_LOCK = threading.Lock()


def initialize(process_id: int, num_processes: int, coordinator: str | None = None, *,
               timeout: float = 300.0, platform: str | None = None) -> None:
    """``jax.distributed.initialize`` for this process, with a timeout that raises instead of hanging.

    Without ``coordinator`` (platform numbering: TPU pods, Slurm, ``--local N --numbering
    platform``) ``jax.distributed.initialize()`` gets no ids: JAX finds them from the platform
    (``JAX_COORDINATOR_PORT`` sets the port, ``JAX_COORDINATOR_BIND_ADDRESS`` process 0's bind
    address; ``assign_process_ids`` sets both), and the id it gives must be ``process_id`` (the
    layout's expectation). With ``coordinator`` (kernel-last numbering) the ids are explicit and
    process 0's coordinator binds to its own address only. On CPU the gloo collectives are
    selected and their ``[Gloo] Rank ...`` lines are kept out of the output. Every process runs
    with ``jax_enable_recoverability``: when one process dies the others stay alive (JAX would end
    them) so the notebook can report it and recover. If the process hosting the coordinator (process
    0) dies, JAX still ends the others. Must run before anything starts JAX's backend
    (``jax.devices()``, a computation) in this process. Calling it again with the same arguments is a no-op (re-running
    the ``%%px --local`` cell is harmless); after a timeout, fix the cause and call it again with
    the same arguments (the first attempt may still complete), or call ``clear_hung_initialize``
    and start over with a new port.
    """
    if num_processes == 1 and process_id == 0:
        return  # a single host: no other process to join, JAX runs as it is
    args = (process_id, num_processes, coordinator)
    where = f"process {process_id} of {num_processes} (coordinator {coordinator or 'auto'})"
    init = _start_initialize(args, (platform or detect_platform()).lower(), where)
    deadline = time.monotonic() + timeout
    while not init.done.wait(0.2):
        if time.monotonic() > deadline:
            raise ClusterError(
                f"jax.distributed.initialize did not complete within {timeout:.0f}s in {where}: not all "
                f"{num_processes} processes joined. Usual causes: an engine is dead or busy (health_check, "
                f"cluster_status), the engines ran it blocking before the kernel (use %%px --local or "
                f"initialize_everywhere), a wrong NUM_PROCESSES, or the coordinator port is blocked or in "
                f"use. Then call dsr1.workbench.clear_hung_initialize(cluster) and initialize with a "
                f"new port.")
    if init.error is not None:
        raise ClusterError(f"jax.distributed.initialize failed in {where}: {init.error}; call "
                           f"clear_hung_initialize before trying again") from init.error
    _check_numbering(process_id, num_processes)


def initialized_port() -> int | None:
    """The coordinator port of this process's ``initialize`` (None before one): from its
    coordinator's address (kernel-last), else ``JAX_COORDINATOR_PORT`` (platform numbering)."""
    init = _INIT
    if init is None:
        return None
    coordinator = init.args[2]
    port = coordinator.rsplit(":", 1)[1] if coordinator else os.environ.get("JAX_COORDINATOR_PORT")
    return int(port) if port else None


def _check_numbering(process_id: int, num_processes: int) -> None:
    """The ids JAX gave (the platform's numbering) are those of the layout."""
    import jax

    got = (jax.process_index(), jax.process_count())
    if got != (process_id, num_processes):
        raise ClusterError(
            f"JAX numbered this process {got[0]} of {got[1]}, the layout expected {process_id} of "
            f"{num_processes}: the platform's variables (cluster.json's kernel_env, the engines' SLURM_* / "
            f"TPU worker ids) disagree with the host order; run assign_process_ids again after reset_engines")


def _start_initialize(args: tuple, platform: str, where: str) -> _Init:
    """This process's initialize for ``args``: the one already started, else a new one in a thread."""
    global _INIT
    import jax

    from . import jax_internals

    with _INIT_LOCK:
        init = _INIT
        if init is not None and init.args != args:
            state = "is still waiting" if not init.done.is_set() else "ran"
            raise ClusterError(
                f"jax.distributed.initialize {state} in this process as process {init.args[0]} of "
                f"{init.args[1]} (coordinator {init.args[2]}): call "
                f"dsr1.workbench.clear_hung_initialize() first (or restart the process) to "
                f"initialize as {where}.")
        if init is not None:
            return init
        if jax_internals.backends_are_initialized():
            raise ClusterError(
                "JAX has already started its devices in this process (jax.devices(), a computation, "
                "or a health check before initialize): jax.distributed.initialize must come first. "
                "Restart this process (reset_engines for engines, restart the kernel) and initialize first.")
        kwargs = _initialize_arguments(*args)
        if platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            from .native_output import drop_native_stdout_lines

            drop_native_stdout_lines()
        # Survivors of a dead process stay alive (JAX would end them), so the notebook can say which
        # one died and recover; see reset_here.
        jax.config.update("jax_enable_recoverability", True)

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
        return init


def _initialize_arguments(process_id: int, num_processes: int, coordinator: str | None) -> dict[str, Any]:
    """jax.distributed.initialize's arguments: none without a coordinator (JAX finds them from the
    platform, as on TPU pods and Slurm), else the explicit ids."""
    if coordinator is None:
        return {}
    # Process 0's coordinator listens on its own address only (JAX's default is [::]).
    return dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                coordinator_bind_address=coordinator)


def shutdown_here() -> None:
    """Leave jax.distributed in this process (a barrier with the others)."""
    global _INIT
    import jax

    jax.distributed.shutdown()
    _INIT = None


def reset_here() -> str:
    """Forget this process's jax.distributed state so initialize can run again: a finished
    initialize is shut down (a barrier with the processes still alive, so every live process must
    do it; a dead one does not hold it up under ``jax_enable_recoverability``), a pending one is
    abandoned (its thread stays blocked on a coordinator that is closed) and the coordinator
    service of process 0 is stopped. JAX's backends, which were started for the old group of
    processes, are cleared too: arrays and compiled programs made before are invalid, re-create
    them (re-run the notebook from "Initialize"). Returns what was done."""
    global _INIT
    init = _INIT
    what = _reset_distributed(init)
    if init is not None or what != "nothing to reset":
        _clear_backends()
    _INIT = None
    return what


def _clear_backends() -> None:
    """Drop JAX's started backends and compiled programs (a computation stuck in a thread keeps its
    own), so that the next initialize is not refused as coming after computations."""
    import jax
    from jax.extend import backend

    from . import jax_internals

    if jax_internals.backends_are_initialized():
        backend.clear_backends()
        jax.clear_caches()


def _reset_distributed(init: _Init | None) -> str:
    """The jax.distributed part of :func:`reset_here`."""
    import jax

    from . import jax_internals

    if init is not None and init.done.is_set() and init.error is None:
        # A barrier with the other processes: bounded, in case one of them is gone.
        done, failed = threading.Event(), []

        def shutdown() -> None:
            try:
                jax.distributed.shutdown()
            except Exception as e:  # noqa: BLE001 - e.g. the coordinator is gone: forget the state below
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=shutdown, name="mcjax-shutdown", daemon=True).start()
        what = "shut down" if done.wait(30) and not failed else "reset (the shutdown barrier failed or timed out)"
        if failed or not done.is_set():
            jax_internals.abandon_distributed_state(stop_service=bool(failed))
    elif init is None and not jax_internals.has_distributed_state():
        what = "nothing to reset"
    else:
        jax_internals.abandon_distributed_state(stop_service=True)
        what = "reset a pending initialize" if init is not None and not init.done.is_set() else "reset"
    return what
