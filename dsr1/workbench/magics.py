"""Running notebook cells on every process: :func:`px` (``%%px [--local]`` from Python, with a
watchdog) and :func:`activate`, which defines the notebook's ``%%everywhere`` magic.

``%%everywhere`` is ``%%px --local`` with a watchdog: the kernel's part runs in a worker thread
while the kernel watches the engines (:mod:`dsr1.workbench.watchdog`). The order matters for
collective code such as ``jax.distributed.initialize``, which blocks until every process joined:
the engines' part is submitted without blocking, then the kernel's part runs, then the engines are
awaited. Never run the engines' part blocking first (``%px`` / ``%%px`` without ``--local``,
``view.execute(..., block=True)``) and the kernel's afterwards: each would wait for the other.
"""

from __future__ import annotations

from typing import Any

from .connection import RESTART_HINT, Cluster
from .engines import aborted, busy_engines, engine_targets, watch
from .process import ClusterError, user_namespace
from .watchdog import compile_cell


def px(cluster: Cluster, code: str, *, local: bool = False, namespace: dict | None = None,
       targets: list[int] | None = None, timeout: float | None = None) -> Any:
    """``%%px [--local]`` from Python, with a watchdog: run the cell ``code`` on the engines (all
    those numbered by :func:`assign_process_ids`, or ``targets``) and, with ``local=True``, in this
    process too (in ``namespace``, else IPython's user namespace). ``%%everywhere`` (see
    :func:`activate`) is ``px(cluster, cell, local=True)``. On a single host (no engines) the cell
    runs here alone.

    The engines' execution is submitted without blocking, then the local one runs, then the
    engines are awaited (``timeout`` seconds at most): the order collective code such as
    ``jax.distributed.initialize`` needs. The local part runs in a worker thread while this thread
    watches the engines' liveness and results (:func:`~dsr1.workbench.engines.watch`): an engine
    that dies ends the call within about a second, and an exception in any process within
    ``SETTLE_SECONDS`` or so, with a ClusterError naming the process and showing its traceback,
    even when the others are stuck for good in a collective with it. An error of the local part
    alone (every engine finished) is raised as it is. Refuses to start while an engine still runs
    an earlier cell. Returns the engines' AsyncResult (``.display_outputs()`` shows their
    output), None without engines.
    """
    ids = engine_targets(cluster, targets)
    busy = busy_engines(cluster, ids)
    if busy:
        raise ClusterError(
            f"{', '.join(cluster.describe(e) for e in busy)} still {'runs' if len(busy) == 1 else 'run'} an earlier "
            f"cell (stuck in a collective after another process failed?): this cell would wait for it. Interrupt it "
            f"with dsr1.workbench.abort_stale(cluster, interrupt=True); if it stays busy, {RESTART_HINT}.")
    ar = cluster.client[ids].execute(code, silent=False, block=False) if ids else None
    work = None
    if local:
        shell = ipython_shell()
        cell = compile_cell(code, "everywhere", shell if namespace is None else None)
        scope = user_namespace(namespace)

        def work() -> None:
            exec(cell, scope)  # the user's cell, as %%px --local runs it

    pending = dict(zip(ids, ar.split())) if ar is not None else {}
    results, _ = watch(cluster, pending, work, timeout)
    dropped = aborted(ids, [results[e] for e in ids])
    if dropped:
        raise ClusterError(
            ", ".join(cluster.describe(e) for e in dropped) + " dropped the code without running it: it arrived "
            "while the engine was handling an error of the previous code (or abort_stale aborted it). Run it again.")
    return ar


def ipython_shell() -> Any:
    """IPython's running shell, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def activate(cluster: Cluster) -> None:
    """The notebook's magics: ``%%everywhere [--timeout S]``: the cell on every numbered engine and
    in this kernel, as ``%%px --local`` does, with the watchdog of :func:`px` (an engine dying or
    raising during the cell ends it with an error naming the process); and ipyparallel's ``%px`` /
    ``%%px`` on a blocking view of every engine (on a single host: ``%px`` and ``%%px`` run here).
    Use ``%%everywhere`` for every cell that runs collectives."""
    shell = ipython_shell()
    if shell is None:
        raise ClusterError("activate needs IPython (a notebook kernel): from Python, use px(cluster, code, local=True)")

    def everywhere(line: str, cell: str) -> None:
        words = line.split()
        timeout = float(words[words.index("--timeout") + 1]) if "--timeout" in words else None
        ar = px(cluster, cell, local=True, timeout=timeout)
        if ar is not None:
            ar.display_outputs()

    shell.register_magic_function(everywhere, magic_kind="cell", magic_name="everywhere")
    if cluster.single:
        def here(line: str, cell: str | None = None) -> None:
            px(cluster, line if cell is None else cell, local=True)

        shell.register_magic_function(here, magic_kind="line_cell", magic_name="px")
    else:
        cluster.client.activate()
