"""The kernel's shell-outs to the setup scripts (``cluster_restart`` of ``mcjax_defs.sh``), with
the cluster's settings from cluster.json in their environment.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
from typing import Any

from .process import ClusterError


def scripts_env(info: dict[str, Any]) -> dict[str, str]:
    """This environment plus the cluster's settings from cluster.json, for the scripts."""
    env = dict(os.environ)
    for key, name in (("provider", "MCJAX_PROVIDER"), ("state", "MCJAX_STATE"), ("cluster_id", "MCJAX_CLUSTER_ID"),
                      ("profile_dir", "MCJAX_PROFILE_DIR"), ("python", "MCJAX_PYTHON"),
                      ("local_devices", "MCJAX_LOCAL_DEVICES")):
        if info.get(key):
            env[name] = str(info[key])
    return env


def run_scripts(info: dict[str, Any], what: str, timeout: float) -> None:
    """``cluster_restart WHAT`` of the scripts in cluster.json's ``root`` (with its mcjax.env on a host)."""
    root = info.get("root") or os.environ.get("MCJAX_ROOT")
    if not root:
        raise ClusterError("reset_engines: no cluster.json naming the scripts' folder: run cluster_restart yourself")
    script = '[ ! -f "$1/mcjax.env" ] || . "$1/mcjax.env"; . "$1/mcjax_defs.sh" && cluster_restart "$2"'
    failure = "a restart of the engines cannot succeed (nothing was stopped)" if what == "check" else \
        "restarting the engines"
    run_command(["bash", "-c", script, "mcjax-reset-engines", str(root), what], scripts_env(info), timeout, failure)


def run_command(command: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    """Run ``command`` (the scripts reaching the hosts) to its end, within ``timeout`` seconds.
    Failure, and a command that does not end in time (it and everything it started are killed),
    raise ClusterError naming this host, the command and what to do."""
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            try:
                out, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a process outside the group holds the output open
                out = ""
            raise ClusterError(
                f"{what}: `{shlex.join(command)}` on {socket.gethostname()} did not finish within {timeout:.0f}s "
                f"(stopped). A host it reaches stopped answering; the usual cause is a dead NFS server under the "
                f"`hard` mount of the shared folder, which blocks every process touching it. Find the host with "
                f"cluster_status (the one that does not answer), check host 0's NFS server "
                f"(`sudo systemctl status nfs-server`) or reboot the stuck host, then call reset_engines again."
                + (f"\nIts output so far:\n{out[-3000:]}" if out else "")) from None
    if proc.returncode != 0:
        raise ClusterError(f"{what} (exit status {proc.returncode}):\n{out[-3000:]}")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
