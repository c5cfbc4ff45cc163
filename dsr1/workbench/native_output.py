"""Drop known noise that native libraries write straight to this process's stdout.

Gloo (JAX's CPU collectives across processes) prints ``[Gloo] Rank N is connected to M peer
ranks...`` with ``std::cout`` each time it connects a group of processes, with no setting to turn
it off. Jupyter's kernels forward file descriptor 1 to the notebook, so a cell that runs its first
collectives shows dozens of those lines. :func:`drop_native_stdout_lines` puts a pipe in front of
fd 1 and forwards every line except the ones that start with a given prefix. Python's own
``print`` does not go through fd 1 in a kernel (``sys.stdout`` is the kernel's stream), and in a
plain process it is forwarded unchanged.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

GLOO_CONNECTED = "[Gloo] Rank "

# The filter of this process (one per process: it owns fd 1), with a lock for installing it.
_FILTER: _LineFilter | None = None
_LOCK = threading.Lock()


class _LineFilter:
    """Forwards what is written to fd 1 to where fd 1 went before, less the lines with ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = tuple(p.encode() for p in prefixes)
        self.target = os.dup(1)  # where fd 1 pointed: the terminal, a log file or the kernel's pipe
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self.thread = threading.Thread(target=self._forward, args=(read,), name="mcjax-stdout-filter", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Forward what is still in the pipe and give fd 1 back (at exit: the forwarding thread is a
        daemon, which would otherwise die with the last lines of a plain script unforwarded)."""
        sys.stdout.flush()
        os.dup2(self.target, 1)  # closes the pipe's write end: the thread reads to its end and stops
        self.thread.join(timeout=2)

    def _forward(self, read: int) -> None:
        pending = b""
        while chunk := os.read(read, 65536):
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()  # an unfinished line waits for its end
            kept = [line for line in lines if not line.startswith(self.prefixes)]
            if kept:
                os.write(self.target, b"\n".join(kept) + b"\n")
        if pending:
            os.write(self.target, pending)


def drop_native_stdout_lines(prefixes: tuple[str, ...] = (GLOO_CONNECTED,)) -> None:
    """From now on, lines that native code writes to fd 1 starting with one of ``prefixes`` are
    dropped (default: Gloo's connection messages). Installed once per process; later calls keep
    the first filter."""
    global _FILTER
    with _LOCK:
        if _FILTER is None:
            _FILTER = _LineFilter(prefixes)
