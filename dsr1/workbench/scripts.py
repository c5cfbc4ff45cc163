"""The kernel's shell-outs to the setup scripts (``cluster_restart`` of ``mcjax_defs.sh``), with
the cluster's settings from cluster.json in their environment.
"""

from __future__ import annotations

import os
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
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ClusterError(f"{what} (exit status {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
