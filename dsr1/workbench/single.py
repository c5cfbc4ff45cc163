"""One host, no engines: the notebooks run unchanged on one machine's accelerators.

With ``MCJAX_SINGLE=1`` in the environment (``./mcjax_setup.sh --single`` sets it) there is no
controller and no engine: :func:`dsr1.workbench.connect` returns a :class:`Cluster` whose only
process is this kernel (process 0 of 1), ``%%everywhere`` and ``%%px`` cells run here alone and
``initialize`` has nothing to join. ``cluster.client`` is :class:`NoEngines`, so code written for a
cluster (``cluster.client[:].push(...)``) still runs. ``MCJAX_LOCAL_DEVICES=N`` gives this process N
fake CPU devices (a CPU-only machine standing in for an accelerator host).
"""

from __future__ import annotations

import os
from typing import Any

from .connection import Cluster
from .layout import Layout
from .process import prepare_process, use_fake_cpu_devices

SINGLE = "single"


def single_host_requested() -> bool:
    """Whether the environment asks for a single host (``MCJAX_SINGLE=1``)."""
    return os.environ.get("MCJAX_SINGLE", "").strip().lower() in ("1", "true", "yes")


class NoEngines:
    """The client of a cluster without engines, shaped as much like ipyparallel's as the
    notebooks use: no ids, nothing outstanding, and a view (``client[:]``) that reaches nobody."""

    ids: list[int] = []
    outstanding: frozenset = frozenset()

    def __getitem__(self, key: Any) -> NoEnginesView:
        return NoEnginesView()

    def close(self) -> None:
        pass


class NoEnginesView:
    """A view of no engines: ``push`` reaches nobody, ``pull`` and ``apply_sync`` return ``[]``."""

    targets: list[int] = []

    def push(self, names: dict[str, Any], block: bool | None = None) -> None:
        pass

    def pull(self, names: Any, block: bool | None = None) -> list:
        return []

    def apply_sync(self, f: Any, *args: Any, **kwargs: Any) -> list:
        return []


def connect_single(namespace: dict | None = None) -> Cluster:
    """This kernel as the whole cluster: process 0 of 1, ``PROCESS_ID``, ``NUM_PROCESSES``,
    ``COORDINATOR`` and ``KERNEL_PROCESS_ID`` defined in its namespace, JAX's compilation cache in
    ``$MCJAX_JAX_CACHE`` when set."""
    devices = os.environ.get("MCJAX_LOCAL_DEVICES")
    if devices:
        use_fake_cpu_devices(int(devices))
    cache = os.environ.get("MCJAX_JAX_CACHE")
    cache = None if cache in (None, "", "off") else cache
    layout = Layout(num_processes=1, kernel_process_id=0, coordinator=None, engines=(), numbering=SINGLE)
    prepare_process(0, 1, None, cache_dir=cache, kernel_process_id=0, namespace=namespace)
    return Cluster(client=NoEngines(), info={"provider": SINGLE, "engines": 0, "numbering": SINGLE},
                   controller_ip="127.0.0.1", layout=layout)
