"""Run a notebook cell's own part in a worker thread while the kernel's main thread watches the
engines, so that a dead engine ends the cell with an error naming it instead of a hung cell.

Why a thread: when a process dies in the middle of a collective, the other processes' Gloo (CPU)
or NCCL calls wait for it forever inside native code, where no Python signal or exception can
reach them. The main thread therefore only waits: it polls ``dead()`` (engines that left the
controller or whose process is gone) and raises as soon as one is found. The worker thread stays
blocked in the dead collective (it is a daemon thread, and the JAX state it used is discarded by
``reset_engines``).
"""

from __future__ import annotations

import contextvars
import linecache
import threading
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.5


class _Outcome:
    """What the worker thread returned or raised."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def run_watched(work: Callable[[], Any], dead: Callable[[], list[int]],
                dead_error: Callable[[list[int]], BaseException], *, poll: float = POLL_SECONDS) -> Any:
    """``work()`` in a worker thread (with this thread's context variables, so a kernel routes its
    output to the current cell), while this thread polls ``dead()`` every ``poll`` seconds.

    Returns what ``work`` returned, or raises what it raised; raises ``dead_error(ids)`` as soon as
    ``dead()`` names engines, without waiting for ``work`` (which may be blocked for good on them).
    An error of ``work`` that comes with dead engines (a collective failing because a peer vanished)
    is reported as ``dead_error`` too, chained to it.
    """
    outcome = _Outcome()
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome.value = context.run(work)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.error = e
        finally:
            outcome.done.set()

    threading.Thread(target=target, name="mcjax-cell", daemon=True).start()
    while not outcome.done.wait(poll):
        gone = dead()
        if gone:
            raise dead_error(gone)
    if outcome.error is not None:
        gone = dead()
        if gone:
            raise dead_error(gone) from outcome.error
        raise outcome.error
    return outcome.value


def compile_cell(code: str, label: str, shell: Any = None) -> Any:
    """``code`` (a notebook cell) compiled for ``exec``, its IPython syntax (``%magics``, ``!``)
    transformed when an IPython ``shell`` is given; its lines are registered so tracebacks show
    them."""
    source = shell.transform_cell(code) if shell is not None else code
    filename = f"<{label}-{abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return compile(source, filename, "exec")
