"""Run a notebook cell's own part in a worker thread while the kernel's main thread watches the
engines, so that a dead engine, or an engine's exception, ends the cell with an error naming it
instead of a hung cell.

Why a thread: when a process dies or raises in the middle of a collective, the other processes'
Gloo (CPU) or NCCL calls wait for it forever inside native code, where no Python signal or
exception can reach them. The main thread therefore only waits: it polls the engines (see
:func:`dsr1.workbench.engines.watch`) and raises as soon as one is gone or failed. The worker thread
stays blocked in the collective (it is a daemon thread, and the JAX state it used is discarded by
``reset_engines``).
"""

from __future__ import annotations

import contextvars
import linecache
import threading
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.25


TASK_THREAD = "mcjax-cell"


def stuck_tasks() -> int:
    """How many :class:`Task` threads of this process still run: after a watched call ended with an
    error, a task left running is stuck (in a collective with a process that failed)."""
    return sum(1 for thread in threading.enumerate() if thread.name == TASK_THREAD and thread.is_alive())


class Task:
    """``work()`` running in a daemon worker thread with the caller's context variables (so a
    kernel routes its output to the current cell): ``done`` is set when it returned or raised,
    then ``value`` or ``error`` holds the outcome."""

    def __init__(self, work: Callable[[], Any], name: str = TASK_THREAD):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        context = contextvars.copy_context()

        def target() -> None:
            try:
                self.value = context.run(work)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=target, name=name, daemon=True).start()

    @property
    def failed(self) -> bool:
        return self.done.is_set() and self.error is not None

    def result(self) -> Any:
        """The value, or raises the error (once done)."""
        if self.error is not None:
            raise self.error
        return self.value


def run_watched(work: Callable[[], Any], dead: Callable[[], list[int]],
                dead_error: Callable[[list[int]], BaseException], *, poll: float = POLL_SECONDS) -> Any:
    """``work()`` in a worker thread while this thread polls ``dead()`` every ``poll`` seconds.

    Returns what ``work`` returned, or raises what it raised; raises ``dead_error(ids)`` as soon as
    ``dead()`` names engines, without waiting for ``work`` (which may be blocked for good on them).
    An error of ``work`` that comes with dead engines (a collective failing because a peer vanished)
    is reported as ``dead_error`` too, chained to it.
    """
    task = Task(work)
    while not task.done.wait(poll):
        gone = dead()
        if gone:
            raise dead_error(gone)
    if task.error is not None:
        gone = dead()
        if gone:
            raise dead_error(gone) from task.error
    return task.result()


def compile_cell(code: str, label: str, shell: Any = None) -> Any:
    """``code`` (a notebook cell) compiled for ``exec``, its IPython syntax (``%magics``, ``!``)
    transformed when an IPython ``shell`` is given; its lines are registered so tracebacks show
    them."""
    source = shell.transform_cell(code) if shell is not None else code
    filename = f"<{label}-{abs(hash(source)):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return compile(source, filename, "exec")
