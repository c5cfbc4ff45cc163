"""The notebook workbench: the ipyparallel cluster and ``jax.distributed`` across its processes,
the generation widget (:mod:`.widgets`), decode profiles (:mod:`.profiling`) and a live view of a
server's metrics (:mod:`.server_view`).

The pattern, in a notebook on host 0::

    import dsr1.workbench as mcjax
    cluster = mcjax.connect()                     # a Cluster; reads $MCJAX_STATE/cluster.json
    mcjax.wait_for_engines(cluster, N - 1)
    mcjax.assign_process_ids(cluster)             # PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere
    mcjax.activate(cluster)                       # %px / %%px, and %%everywhere

    %%everywhere
    import dsr1.workbench as mcjax
    mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR)

One module per concern: :mod:`.connection` (the controller, cluster.json), :mod:`.layout` (process
numbering), :mod:`.engines` (calls on every engine), :mod:`.magics` (``%%everywhere``, :func:`px`),
:mod:`.watchdog` (a cell's own part in a worker thread while the kernel watches the engines),
:mod:`.distributed` (``jax.distributed`` everywhere), :mod:`.health`, :mod:`.storage`,
:mod:`.recovery` (stale tasks, restarting engines), :mod:`.scripts` (the setup scripts), and
:mod:`.process`: what runs inside each process (the engines receive those functions through
ipyparallel's ``apply``, the kernel calls them directly).

Troubleshooting: :func:`abort_stale` (queued or running tasks left behind),
:func:`clear_hung_initialize` (an initialize timed out: reset ``jax.distributed`` everywhere so it
can run again), :func:`reset_engines` (after an engine died, or to free the engines' memory:
restart them and reset the kernel's JAX state), :func:`health_check` (same Python, versions and
devices everywhere?).
"""

from .connection import Cluster, cluster_info, connect, connection_file, state_dir, wait_for_engines
from .distributed import clear_hung_initialize, initialize_everywhere, shutdown_everywhere
from .health import HealthReport, clock_skew, health_check
from .layout import DEFAULT_COORDINATOR_PORT, NUMBERINGS, EngineInfo, Layout, assign_process_ids
from .magics import activate, px
from .process import ClusterError, detect_platform, initialize, probe
from .recovery import abort_stale, reset_engines
from .storage import shared_paths, storage_everywhere

__all__ = [
    "DEFAULT_COORDINATOR_PORT", "NUMBERINGS", "Cluster", "ClusterError", "EngineInfo", "HealthReport", "Layout",
    "abort_stale", "activate", "assign_process_ids", "clear_hung_initialize", "clock_skew", "cluster_info",
    "connect", "connection_file", "detect_platform", "health_check", "initialize", "initialize_everywhere", "probe",
    "px", "reset_engines", "shared_paths", "shutdown_everywhere", "state_dir", "storage_everywhere",
    "wait_for_engines",
]
