"""Processes started as on a real host import the installed dsr1, and the smoke check of
``./mcjax_setup.sh --check`` (dsr1.workbench.smoke) passes on a healthy cluster and names the host
whose environment differs.

A real host keeps the repository on the shared folder as ``$MCJAX_NFS_DIR/dsr1``: a folder named
like the package but without ``__init__.py``. The tests here build that layout (a symlink to this
repository) and start the controller, the engines and a Jupyter kernel with the scripts a real host
runs (cluster/ipcluster.sh), from that folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _kill_leftovers(state: Path, marker: str) -> None:
    for pidfile in (state / "pids").glob("*.pid"):
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.exists() and marker in cmdline.read_text(errors="replace"):
            os.killpg(pid, signal.SIGKILL)


def _venv(tmp_path: Path) -> Path:
    """A stand-in for the host's venv: its bin/python is this Python."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    return venv


def _host_env(tmp_path: Path, nfs: Path, cluster_id: str, hosts: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MCJAX_", "SLURM_", "JUPYTER_", "PYTHONPATH", "PYTHONSAFEPATH"))}
    (tmp_path / "home").mkdir(exist_ok=True)
    env.update(HOME=str(tmp_path / "home"), MCJAX_PROVIDER="ssh", MCJAX_HOST_LIST=" ".join(["127.0.0.1"] * hosts),
               MCJAX_INTERNAL_IPS=" ".join(["127.0.0.1"] * hosts), MCJAX_NFS_DIR=str(nfs),
               MCJAX_VENV=str(_venv(tmp_path)), MCJAX_STATE=str(tmp_path / "state"), MCJAX_CLUSTER_ID=cluster_id,
               MCJAX_START_TIMEOUT="90", MCJAX_JAX_CACHE="off", JAX_PLATFORMS="cpu")
    return env


def _ipcluster(env: dict[str, str], host: int, *args: str, cwd: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "cluster" / "ipcluster.sh"), *args],
                          env=dict(env, MCJAX_HOST_INDEX=str(host)), cwd=cwd, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"ipcluster.sh {' '.join(args)} on host {host}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.slow
def test_engines_and_a_notebook_at_jupyters_root_import_the_installed_dsr1(tmp_path):
    """The repository at $MCJAX_NFS_DIR/dsr1, every script run from $MCJAX_NFS_DIR: both engines and
    a notebook created at Jupyter's root ($MCJAX_NFS_DIR) get the installed package (its version,
    make_mesh), never the source folder as an empty namespace package."""
    ipp = pytest.importorskip("ipyparallel")
    pytest.importorskip("nbclient")
    import nbformat
    from nbclient import NotebookClient

    nfs = tmp_path / "nfs"
    nfs.mkdir()
    (nfs / "dsr1").symlink_to(ROOT)  # the repository root: dsr1/ without __init__.py
    cluster_id = f"paths-{os.getpid()}"
    env = _host_env(tmp_path, nfs, cluster_id, hosts=3)
    state = Path(env["MCJAX_STATE"])
    try:
        _ipcluster(env, 0, "controller", "start", "127.0.0.1", cwd=nfs)
        for host in (1, 2):
            _ipcluster(env, host, "engine", "start", cwd=nfs)
        _ipcluster(env, 0, "wait", "2", cwd=nfs)
        security = nfs / ".mcjax" / "profile_mcjax" / "security"
        client = ipp.Client(str(security / f"ipcontroller-{cluster_id}-client.json"))
        try:
            view = client[:]
            view.execute("import os, dsr1; seen = (dsr1.__version__, dsr1.__file__, callable(dsr1.make_mesh), "
                         "os.getcwd())", block=True)
            seen = view.pull("seen", block=True)
        finally:
            client.close()
        import dsr1

        assert len(seen) == 2
        for version, file, make_mesh, cwd in seen:
            assert (version, make_mesh) == (dsr1.__version__, True)
            assert Path(file).resolve() == (ROOT / "dsr1" / "__init__.py").resolve()
            assert cwd == str(state / "run")

        # A notebook at Jupyter's root, run by the kernel the jupyter step installs.
        _ipcluster(env, 0, "jupyter", "kernel", cwd=nfs)
        spec = json.loads((tmp_path / "home/.local/share/jupyter/kernels/mcjax/kernel.json").read_text())
        assert spec["argv"][1] == "-P" and spec["env"]["PYTHONSAFEPATH"] == "1"
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("import os, dsr1\nprint(dsr1.__version__, callable(dsr1.make_mesh), "
                                              "dsr1.__file__, os.getcwd())")]
        old = dict(os.environ)
        try:  # nbclient finds the kernel spec through HOME (jupyter's data folder)
            os.environ.clear()
            os.environ.update(env)
            NotebookClient(nb, kernel_name="mcjax", timeout=120,
                           resources={"metadata": {"path": str(nfs)}}).execute()
        finally:
            os.environ.clear()
            os.environ.update(old)
        version, make_mesh, file, cwd = nb.cells[0].outputs[0]["text"].split()
        assert (version, make_mesh, cwd) == (dsr1.__version__, "True", str(nfs))
        assert Path(file).resolve() == (ROOT / "dsr1" / "__init__.py").resolve()
    finally:
        for host in (1, 2):
            subprocess.run(["bash", str(ROOT / "cluster" / "ipcluster.sh"), "engine", "stop"],
                           env=dict(env, MCJAX_HOST_INDEX=str(host)), capture_output=True, timeout=60)
        subprocess.run(["bash", str(ROOT / "cluster" / "ipcluster.sh"), "controller", "stop"],
                       env=dict(env, MCJAX_HOST_INDEX="0"), capture_output=True, timeout=60)
        _kill_leftovers(state, cluster_id)
