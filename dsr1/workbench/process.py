"""What runs inside each JAX process of the workbench cluster: the engines receive these functions
through ipyparallel's ``apply``, the notebook kernel calls them directly.

- :func:`probe`: who and what this process is (host, environment, versions, devices);
- :func:`initialize`: ``jax.distributed.initialize`` with a timeout that raises instead of hanging;
- :func:`define_process_names`, :func:`shutdown_here`, :func:`reset_here`: the per-process steps of
  ``assign_process_ids``, ``shutdown_everywhere`` and ``clear_hung_initialize`` in
  :mod:`dsr1.workbench.cluster`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import socket
import sys
import threading
import time
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
                          namespace: dict | None = None) -> None:
    """``PROCESS_ID``, ``NUM_PROCESSES`` and ``COORDINATOR`` in this process's user namespace, for
    the ``%%px --local`` cells."""
    user_namespace(namespace).update(PROCESS_ID=process_id, NUM_PROCESSES=num_processes, COORDINATOR=coordinator)


# ----------------------------------------------------------------------------- probe

def detect_platform() -> str:
    """``tpu``, ``gpu`` or ``cpu``, without starting JAX: from ``JAX_PLATFORMS``, else the
    installed plugins (libtpu, jax CUDA/ROCm plugins)."""
    first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in
           ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")):
        return "gpu"
    return "cpu"


def probe(controller_ip: str, devices: bool, namespace: dict | None = None) -> dict[str, Any]:
    """Who and what this process is: host, pid, Python environment and version, the versions of
    dsr1, jax, jaxlib and ipyparallel, the accelerator, the address on which it reaches the
    controller at ``controller_ip`` (where process 0's coordinator listens), the ``PROCESS_ID`` /
    ``NUM_PROCESSES`` of its user namespace and, with ``devices``, its JAX devices.

    Devices are only read once JAX is initialized (``jax.distributed`` or a computation): reading
    them earlier would start JAX's backend and make ``jax.distributed.initialize`` impossible here.
    """
    names = user_namespace(namespace)
    info: dict[str, Any] = {
        "hostname": socket.gethostname(), "pid": os.getpid(), "executable": sys.executable,
        "environment": f"{sys.prefix} ({os.path.realpath(sys.executable)})", "python": sys.version.split()[0],
        "host_index": os.environ.get("MCJAX_HOST_INDEX"), "provider": os.environ.get("MCJAX_PROVIDER"),
        "PROCESS_ID": names.get("PROCESS_ID"), "NUM_PROCESSES": names.get("NUM_PROCESSES"),
        "address": _address_towards(controller_ip), "accelerator": detect_platform(),
    }
    info.update({name: _version(name) for name in ("dsr1", "jax", "jaxlib", "ipyparallel")})
    if devices:
        info.update(_devices_if_started())
    return info


def _address_towards(ip: str) -> str:
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

    On TPU (without ``coordinator``) JAX finds the processes itself. On GPU and CPU the
    coordinator ``host:port`` (process 0's address) is required; on CPU the gloo collectives
    are selected. Must run before anything starts JAX's backend (``jax.devices()``, a
    computation) in this process. Calling it again with the same arguments is a no-op (re-running
    the ``%%px --local`` cell is harmless); after a timeout, fix the cause and call it again with
    the same arguments (the first attempt may still complete), or call ``clear_hung_initialize``
    and start over with a new port.
    """
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
                f"use. Then call dsr1.workbench.cluster.clear_hung_initialize(cluster) and initialize with a "
                f"new port.")
    if init.error is not None:
        raise ClusterError(f"jax.distributed.initialize failed in {where}: {init.error}; call "
                           f"clear_hung_initialize before trying again") from init.error


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
                f"dsr1.workbench.cluster.clear_hung_initialize() first (or restart the process) to "
                f"initialize as {where}.")
        if init is not None:
            return init
        if jax_internals.backends_are_initialized():
            raise ClusterError(
                "JAX has already started its devices in this process (jax.devices(), a computation, "
                "or a health check before initialize): jax.distributed.initialize must come first. "
                "Restart this process (reset_engines for engines, restart the kernel) and initialize first.")
        kwargs = _initialize_arguments(*args, platform=platform)
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
        return init


def _initialize_arguments(process_id: int, num_processes: int, coordinator: str | None, *,
                          platform: str) -> dict[str, Any]:
    """jax.distributed.initialize's arguments: none on TPU without a coordinator (JAX finds them)."""
    if platform == "tpu" and coordinator is None:
        return {}
    if coordinator is None:
        raise ClusterError(f"initialize on {platform} needs the coordinator 'host:port' of process 0 "
                           f"(assign_process_ids sets COORDINATOR)")
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
    initialize is shut down (a barrier, so every process must do it), a pending one is abandoned
    (its thread stays blocked on a coordinator that is closed) and the coordinator service of
    process 0 is stopped. Returns what was done."""
    global _INIT
    import jax

    from . import jax_internals

    init = _INIT
    if init is not None and init.done.is_set() and init.error is None:
        # A barrier with the other processes: bounded, in case one of them is gone.
        done = threading.Event()
        threading.Thread(target=lambda: (jax.distributed.shutdown(), done.set()), daemon=True).start()
        what = "shut down" if done.wait(30) else "reset (the shutdown barrier timed out)"
        if not done.is_set():
            jax_internals.abandon_distributed_state(stop_service=False)
    elif init is None and not jax_internals.has_distributed_state():
        what = "nothing to reset"
    else:
        jax_internals.abandon_distributed_state(stop_service=True)
        what = "reset a pending initialize" if init is not None and not init.done.is_set() else "reset"
    _INIT = None
    return what
