"""``jax.distributed`` in every process of the cluster: initialize, shut down, and clear a hung
initialize. The per-process steps are :mod:`dsr1.workbench.process`'s; these run them on every
engine and in the kernel in the order collectives need.
"""

from __future__ import annotations

import functools

from .connection import Cluster
from .engines import call_everywhere, engine_targets
from .layout import Layout, assign_process_ids
from .process import initialize, reset_here, shutdown_here
from .recovery import abort_stale


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
    call_everywhere(cluster, calls, timeout + 30,
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
    ids = engine_targets(cluster, None)
    layout = cluster.layout
    if layout is None:
        call_everywhere(cluster, {e: shutdown_here for e in ids}, timeout, local=shutdown_here)
        return
    first = [e.engine_id for e in layout.engines if e.process_id != 0 and e.engine_id in ids]
    last = [e.engine_id for e in layout.engines if e.process_id == 0 and e.engine_id in ids]
    kernel_first = layout.kernel_process_id != 0
    call_everywhere(cluster, {e: shutdown_here for e in first}, timeout, local=shutdown_here if kernel_first else None)
    call_everywhere(cluster, {e: shutdown_here for e in last}, timeout,
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
    ids = engine_targets(cluster, None)
    # The engines first, without waiting, then here: a finished initialize shuts down in a barrier.
    engines, mine = call_everywhere(cluster, {e: reset_here for e in ids}, timeout, local=reset_here)
    return {"kernel": mine} | {f"engine {e}": engines[e] for e in ids}
