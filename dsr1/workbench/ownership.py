"""Which notebook kernel holds the cluster: ``<state>/kernel.json``, written by the kernel whose
:func:`~dsr1.workbench.connect` took the engines. A second kernel (another notebook opened on host 0)
must not restart the engines the first one's ``jax.distributed`` group runs on, nor take its devices:
:func:`claim` refuses it while the recorded kernel lives, naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from .process import ClusterError

RECORD = "kernel.json"


def _start_ticks(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22), telling it from a later process
    given the same pid; None when it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def this_kernel() -> dict[str, Any]:
    """This process as the record names it: pid, host, start time, its Jupyter connection file and
    notebook (where it is a Jupyter kernel)."""
    connection = None
    with contextlib.suppress(Exception):  # not a kernel, or an ipykernel without a connection file
        from ipykernel.connect import get_connection_file

        connection = get_connection_file()
    return {"pid": os.getpid(), "hostname": socket.gethostname(), "started": _start_ticks(os.getpid()),
            "connection_file": connection, "notebook": os.environ.get("JPY_SESSION_NAME")}


def alive(record: dict[str, Any]) -> bool:
    """Whether the recorded kernel still runs: the same pid on this host, started at the same time."""
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    return record.get("hostname") == socket.gethostname() and _start_ticks(pid) == record.get("started")


def describe(record: dict[str, Any]) -> str:
    """``pid 123 on host0 (notebook main.ipynb, connection file /.../kernel-1.json)``."""
    about = [f"notebook {record['notebook']}"] if record.get("notebook") else []
    about += [f"connection file {record['connection_file']}"] if record.get("connection_file") else []
    return f"pid {record.get('pid')} on {record.get('hostname')}" + (f" ({', '.join(about)})" if about else "")


def claim(state: Path, take_over: bool = False) -> dict[str, Any]:
    """Record this kernel as the cluster's (``<state>/kernel.json``, under a lock) unless another
    kernel that still runs holds it: then a ClusterError names that kernel and says how to free the
    cluster. ``take_over``: take it anyway. Returns the record written."""
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    mine = this_kernel()
    path = state / RECORD
    with open(state / f"{RECORD}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            held = json.loads(path.read_text())
        except (OSError, ValueError):
            held = {}
        if not take_over and held.get("pid") != mine["pid"] and alive(held):
            raise ClusterError(
                f"the cluster's engines are held by another notebook kernel, {describe(held)} (recorded in "
                f"{path}); connecting here would restart them under it and take its devices. Shut that kernel "
                f"down (Kernel > Shut Down in its notebook, or kill {held['pid']}) and run this cell again, or "
                f"connect(take_over=True) to restart the engines anyway.")
        tmp = path.with_name(f"{RECORD}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(mine))
        tmp.replace(path)
    return mine
