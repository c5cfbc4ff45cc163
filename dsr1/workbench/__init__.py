"""The notebook workbench: the ipyparallel cluster and ``jax.distributed`` across its processes,
the generation widget (:mod:`.widgets`), decode profiles (:mod:`.profiling`) and a live view of a
server's metrics (:mod:`.server_view`).

The pattern, in a notebook on host 0::

    import dsr1.workbench as mcjax
    cluster = mcjax.connect()            # engines restarted if stale, processes numbered, %%everywhere
    mcjax.initialize_everywhere(cluster) # jax.distributed in every process
    model, tokenizer = mcjax.load_everywhere(cluster, checkpoint)   # in every process

    %%everywhere
    out = dsr1.generate(model, prompts, tokenizer=tokenizer)        # every process, same programs

:func:`connect` reads ``$MCJAX_STATE/cluster.json`` (what the setup scripts recorded), restarts
engines that cannot join this kernel (after "Restart kernel"), numbers the processes
(``PROCESS_ID``, ``NUM_PROCESSES``, ``COORDINATOR`` in every namespace) and defines
``%%everywhere``: ``%%px --local`` under a watchdog that ends the cell when a process dies or raises,
naming it with its traceback. With ``MCJAX_SINGLE=1`` (one host) there are no engines and every
cell runs in the kernel alone (:mod:`.single`).

One module per concern: :mod:`.notebook` (the notebook's steps, one call each),
:mod:`.connection` (the controller, cluster.json), :mod:`.layout` (process
numbering), :mod:`.engines` (calls on every engine), :mod:`.magics` (``%%everywhere``, :func:`px`),
:mod:`.watchdog` (a cell's own part in a worker thread while the kernel watches the engines),
:mod:`.distributed` (``jax.distributed`` everywhere), :mod:`.health`, :mod:`.storage`,
:mod:`.recovery` (stale tasks, restarting engines), :mod:`.scripts` (the setup scripts),
:mod:`.single` (one host, no engines), and
:mod:`.process`: what runs inside each process (the engines receive those functions through
ipyparallel's ``apply``, the kernel calls them directly).

Troubleshooting: :func:`abort_stale` (queued or running tasks left behind),
:func:`clear_hung_initialize` (an initialize timed out: reset ``jax.distributed`` everywhere so it
can run again), :func:`reset_engines` (after an engine died, or to free the engines' memory:
restart them and reset the kernel's JAX state), :func:`health_check` (same Python, versions and
devices everywhere?).
"""

from .connection import Cluster, cluster_info, connect_controller, connection_file, state_dir, wait_for_engines
from .distributed import clear_hung_initialize, initialize_everywhere, shutdown_everywhere
from .health import HealthReport, clock_skew, health_check
from .layout import DEFAULT_COORDINATOR_PORT, NUMBERINGS, EngineInfo, Layout, assign_process_ids
from .magics import activate, px
from .notebook import connect, load_everywhere
from .process import ClusterError, detect_platform, initialize, probe
from .recovery import abort_stale, reset_engines
from .storage import shared_paths, storage_everywhere

__all__ = [
    "DEFAULT_COORDINATOR_PORT", "NUMBERINGS", "Cluster", "ClusterError", "EngineInfo", "HealthReport", "Layout",
    "abort_stale", "activate", "assign_process_ids", "clear_hung_initialize", "clock_skew", "cluster_info",
    "connect", "connect_controller", "connection_file", "detect_platform", "health_check", "initialize",
    "initialize_everywhere", "load_everywhere", "probe", "px", "reset_engines", "shared_paths",
    "shutdown_everywhere", "state_dir", "storage_everywhere", "wait_for_engines",
]
