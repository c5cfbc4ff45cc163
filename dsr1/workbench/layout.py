"""How the JAX processes are numbered and laid out over the hosts (``numbering`` in cluster.json).

*kernel-last*: the engines on hosts 1..N-1 are JAX processes 0..N-2 (ordered by host index) and the
notebook kernel on host 0 is process N-1, with explicit ids and process 0's address as the
coordinator. *platform* (TPU pods, Slurm): JAX numbers the processes itself, the kernel is process
0 and host i is process i, and every process calls ``jax.distributed.initialize()`` without ids.
:func:`assign_process_ids` probes every process, numbers them and prepares each for ``initialize``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from .connection import RESTART_HINT, Cluster
from .engines import call_everywhere, probe_everywhere
from .process import ClusterError, prepare_process

DEFAULT_COORDINATOR_PORT = 8476


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """One engine: its ipyparallel id, JAX process id and where it runs."""
    engine_id: int
    process_id: int
    hostname: str
    pid: int
    host_index: int | None
    address: str
    host_key: str = ""  # process.host_key() of the engine's host ("": unknown)

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


NUMBERINGS = ("kernel-last", "platform")


def number_processes(engine_ids: list[int], infos: list[dict], port: int, numbering: str) -> Layout:
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
                   address=info["address"], host_key=info.get("host_key") or "")
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


def process_env(cluster: Cluster, layout: Layout, kernel: bool) -> dict[str, str]:
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
    everywhere; moves each engine to the kernel's working folder where its host has it (the
    notebook's folder, on the shared folder); keeps the layout in ``cluster.layout``. Run it again
    after engines were restarted (:func:`reset_engines` does). On a single host the kernel is the
    only process: its layout stays.
    """
    if cluster.single and cluster.layout is not None:
        return cluster.layout
    ids = sorted(cluster.client.ids)
    if not ids:
        raise ClusterError(f"no engines are registered with the controller: {RESTART_HINT}")
    infos, mine = probe_everywhere(cluster, ids, devices=False, timeout=timeout, namespace=namespace)
    layout = number_processes(ids, infos, _coordinator_port(cluster, port), _numbering(cluster, mine, infos))
    n, coordinator, cache = layout.num_processes, layout.coordinator, cluster.info.get("jax_cache_dir")
    engine_env = process_env(cluster, layout, kernel=False)
    call_everywhere(
        cluster, {e.engine_id: functools.partial(prepare_process, e.process_id, n, coordinator, env=engine_env,
                                                 cache_dir=cache, kernel_process_id=layout.kernel_process_id,
                                                 cwd=os.getcwd())
                  for e in layout.engines}, timeout,
        local=functools.partial(prepare_process, layout.kernel_process_id, n, coordinator,
                                env=process_env(cluster, layout, kernel=True), cache_dir=cache,
                                kernel_process_id=layout.kernel_process_id, namespace=namespace))
    cluster.layout = layout
    return layout
