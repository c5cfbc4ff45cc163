"""The notebook's steps, one call each: :func:`connect` (the first cell), then
:func:`~dsr1.workbench.initialize_everywhere` and :func:`load_everywhere`.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from .connection import Cluster, cluster_info, connect_controller, state_dir
from .engines import call_everywhere, engine_targets
from .layout import assign_process_ids
from .magics import activate, ipython_shell
from .ownership import claim
from .process import ClusterError, initialized_port, jax_started, probe, use_fake_cpu_devices, user_namespace
from .recovery import reset_engines
from .single import connect_single, single_host_requested
from .watchdog import stuck_tasks
from .weights_form import AUTO, weights_form


def connect(*, state: str | os.PathLike | None = None, timeout: float = 30.0, probe_timeout: float = 20.0,
            restart: bool = True, namespace: dict | None = None, take_over: bool = False) -> Cluster:
    """The notebook's first cell: connect to the cluster and make it ready for "Initialize".

    1. ``MCJAX_SINGLE=1`` in the environment (``./mcjax_setup.sh --single``): no controller, no
       engine; returns this kernel as a cluster of one process (:mod:`dsr1.workbench.single`),
       whose ``%%everywhere`` cells run here alone.
    2. Claims the cluster for this kernel (:func:`~dsr1.workbench.ownership.claim`,
       ``<state>/kernel.json``): while another kernel that still runs holds it (another notebook
       opened on host 0), a ClusterError names that kernel (pid, connection file, notebook) and
       nothing is touched, so it keeps working. ``take_over=True``: take the cluster anyway.
       On a simulated cluster (``--local N``) this kernel then takes the engines' fake CPU devices.
    3. Connects to the controller (:func:`~dsr1.workbench.connection.connect_controller`).
    4. **Restarts the engines itself** (:func:`~dsr1.workbench.reset_engines`, through the
       scripts' ``cluster_restart``) when they cannot join a new ``jax.distributed`` group with this
       kernel: fewer are registered than cluster.json records (they died, e.g. with the previous
       kernel when it ran JAX's coordinator), one does not answer within ``probe_timeout`` seconds
       (stuck in a collective of an earlier cell), a cell of this kernel is still stuck in one, or
       JAX was started in some processes but not in others (the kernel was restarted while the
       engines kept their ``jax.distributed`` group).
       So "Restart kernel and run all" works under both numberings. When JAX runs everywhere
       (the cell is run again in the same kernel), nothing is restarted. ``restart=False``:
       raise a ClusterError saying what is wrong instead.
    5. Numbers the processes (:func:`~dsr1.workbench.assign_process_ids`: ``PROCESS_ID``,
       ``NUM_PROCESSES``, ``COORDINATOR`` everywhere) and, in IPython, defines ``%%everywhere``
       (:func:`~dsr1.workbench.activate`).

    Returns the :class:`Cluster` (``cluster.layout`` holds the numbering; ``cluster.summary()``).
    """
    if single_host_requested():
        cluster = connect_single(namespace)
    else:
        claim(state_dir(state), take_over)
        info = cluster_info(state)
        if info.get("provider") == "local":
            _use_fake_devices(int(info["local_devices"]))
        cluster = connect_controller(state=state, timeout=timeout)
        expected = int(cluster.info.get("engines") or 0) or len(cluster.client.ids)
        reason = stale_engines(cluster, expected, probe_timeout)
        if reason and not restart:
            raise ClusterError(f"the engines cannot join this kernel: {reason}; run connect(restart=True) or "
                               f"dsr1.workbench.reset_engines(cluster)")
        if reason:
            print(f"restarting the engines: {reason}", flush=True)
            reset_engines(cluster, n=expected, namespace=namespace)
        else:  # the group this kernel is in keeps its port (a first run: cluster.json's)
            assign_process_ids(cluster, port=initialized_port(), namespace=namespace)
    if namespace is None and ipython_shell() is not None:
        activate(cluster)
    return cluster


def _use_fake_devices(count: int) -> None:
    """This kernel's JAX on ``count`` CPU devices, like the simulated cluster's engines (read when
    JAX starts its backend, so only before that)."""
    from . import jax_internals

    if jax_internals.backends_are_initialized():
        return
    use_fake_cpu_devices(count)
    import jax

    jax.config.update("jax_platforms", "cpu")


def stale_engines(cluster: Cluster, expected: int, timeout: float) -> str | None:
    """Why the registered engines cannot join a new group with this kernel, or None when they can:
    a cell of this kernel still stuck in a collective, fewer than ``expected`` engines within a few
    seconds, one that does not answer within ``timeout`` seconds, or JAX started in some processes
    and not in others."""
    if stuck_tasks():
        return "a cell of this kernel is stuck in a collective with a process that failed"
    client = cluster.client
    deadline = time.monotonic() + min(timeout, 10.0)
    while len(client.ids) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    ids = sorted(client.ids)
    if len(ids) < expected:
        return f"{len(ids)} of {expected} engines are registered"
    pending = {e: client[e].apply_async(probe, cluster.controller_ip, False) for e in ids}
    end = time.monotonic() + timeout
    for ar in pending.values():
        ar.wait(max(0.0, end - time.monotonic()))
    silent = [e for e, ar in pending.items() if not ar.ready() or not ar.successful()]
    if silent:
        return f"engine{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} did not answer within {timeout:.0f}s"
    started = {e: bool(ar.get().get("jax_started")) for e, ar in pending.items()}
    mine = jax_started()
    if any(s != mine for s in started.values()):
        engines = [e for e, s in started.items() if s]
        return (f"JAX was started on engine{'s' * (len(engines) > 1)} {', '.join(map(str, engines))} but not in this "
                f"kernel (restarted?)" if engines else "JAX was started in this kernel but not on the engines")
    return None


def load_here(checkpoint: str | None, mtp: bool = False, namespace: dict | None = None, quant: str | None = AUTO,
              kv_cache_dtype: str | None = AUTO) -> None:
    """This process's part of :func:`load_everywhere`: ``mesh``, ``model``, ``tokenizer``,
    ``CHECKPOINT`` and ``WEIGHTS_FORM`` in its user namespace (progress shown in the kernel only)."""
    import dsr1

    names = user_namespace(namespace)
    mesh = dsr1.make_mesh()
    path = checkpoint or dsr1.demo_checkpoint()  # the package ships the demo model on every host
    form = weights_form(path, mesh, quant, kv_cache_dtype, mtp=mtp)
    progress = names.get("PROCESS_ID") == names.get("KERNEL_PROCESS_ID")
    if progress:
        print(f"loading {checkpoint or 'the demo model'} with {form.describe()}", flush=True)
    model = dsr1.load(path, mesh=mesh, quant=form.quant, kv_cache_dtype=form.kv_cache_dtype, mtp=mtp,
                      progress=progress)
    names.update(CHECKPOINT=checkpoint, mesh=mesh, model=model, tokenizer=dsr1.load_tokenizer(path),
                 WEIGHTS_FORM=form)


def load_everywhere(cluster: Cluster, checkpoint: str | None = None, *, mtp: bool = False,
                    quant: str | None = AUTO, kv_cache_dtype: str | None = AUTO,
                    namespace: dict | None = None, timeout: float | None = None) -> tuple[Any, Any]:
    """Load the model in every process, under the watchdog: one mesh over every device of every
    process (``dsr1.make_mesh()``), the weights of ``checkpoint`` (None: the embedded demo model)
    read straight into their shards, and its tokenizer. Defines ``mesh``, ``model``, ``tokenizer``,
    ``CHECKPOINT`` and ``WEIGHTS_FORM`` in every process's namespace, for the ``%%everywhere`` cells
    that follow.

    ``quant`` and ``kv_cache_dtype`` (as :func:`dsr1.load` takes them) default to ``"auto"``: the
    form the capacity plan fits on these devices (:func:`~dsr1.workbench.weights_form.choose_form`:
    full precision where it fits, else int8 weights, else int8 weights and cache; CPU devices:
    full precision). Give them to override. Returns this kernel's (model, tokenizer)."""
    ids = engine_targets(cluster, None)
    load = functools.partial(load_here, checkpoint, mtp, quant=quant, kv_cache_dtype=kv_cache_dtype)
    call_everywhere(cluster, {e: load for e in ids}, timeout, local=functools.partial(load, namespace=namespace))
    names = user_namespace(namespace)
    return names["model"], names["tokenizer"]
