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

from .connection import Cluster
from .engines import aborted, dead_engines, dead_error, engine_targets, wait_result
from .process import ClusterError, user_namespace
from .watchdog import compile_cell, run_watched


def px(cluster: Cluster, code: str, *, local: bool = False, namespace: dict | None = None,
       targets: list[int] | None = None, timeout: float | None = None) -> Any:
    """``%%px [--local]`` from Python, with a watchdog: run the cell ``code`` on the engines (all
    those numbered by :func:`assign_process_ids`, or ``targets``) and, with ``local=True``, in this
    process too (in ``namespace``, else IPython's user namespace). ``%%everywhere`` (see
    :func:`activate`) is ``px(cluster, cell, local=True)``.

    The engines' execution is submitted without blocking, then the local one runs, then the
    engines are awaited (``timeout`` seconds at most): the order collective code such as
    ``jax.distributed.initialize`` needs. The local part runs in a worker thread while this thread
    watches the engines: an engine that dies meanwhile (killed, out of memory) ends the call within
    about a second with a ClusterError naming it, even when the local part is stuck for good in a
    collective with it. A timeout raises ClusterError too; an error in ``code`` itself is raised as
    such. Returns the engines' AsyncResult (``.display_outputs()`` shows their output).
    """
    ids = engine_targets(cluster, targets)
    ar = cluster.client[ids].execute(code, silent=False, block=False)
    if local:
        shell = ipython_shell()
        cell = compile_cell(code, "everywhere", shell if namespace is None else None)
        scope = user_namespace(namespace)
        run_watched(lambda: exec(cell, scope), lambda: dead_engines(cluster, ids),  # the user's cell, as %%px runs it
                    lambda dead: dead_error(cluster, dead))
    dropped = aborted(ids, wait_result(cluster, ar, ids, timeout))
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
    """The notebook's magics: ipyparallel's ``%px`` / ``%%px`` on a blocking view of every engine,
    and ``%%everywhere [--timeout S]``: the cell on every numbered engine and in this kernel, as
    ``%%px --local`` does, with the watchdog of :func:`px` (an engine dying during the cell ends it
    with an error naming the engine). Use ``%%everywhere`` for every cell that runs collectives."""
    cluster.client.activate()
    shell = ipython_shell()
    if shell is None:
        raise ClusterError("activate needs IPython (a notebook kernel): from Python, use px(cluster, code, local=True)")

    def everywhere(line: str, cell: str) -> None:
        words = line.split()
        timeout = float(words[words.index("--timeout") + 1]) if "--timeout" in words else None
        px(cluster, cell, local=True, timeout=timeout).display_outputs()

    shell.register_magic_function(everywhere, magic_kind="cell", magic_name="everywhere")
