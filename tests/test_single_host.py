"""One host, no engines (``MCJAX_SINGLE=1``, what ``./mcjax_setup.sh --single`` sets): the same
notebooks run unchanged in a lone kernel on this machine's CPU devices, under nbval."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def test_connect_without_engines_runs_cells_here():
    """connect() on a single host: this process is process 0 of 1, px runs the cell here alone,
    health and storage report this process only."""
    import dsr1.workbench as mcjax

    namespace: dict = {}
    os.environ["MCJAX_SINGLE"] = "1"
    try:
        cluster = mcjax.connect(namespace=namespace)
    finally:
        del os.environ["MCJAX_SINGLE"]
    assert cluster.single and cluster.layout.num_processes == 1 and cluster.layout.engines == ()
    assert (namespace["PROCESS_ID"], namespace["NUM_PROCESSES"], namespace["KERNEL_PROCESS_ID"]) == (0, 1, 0)
    assert mcjax.px(cluster, "y = PROCESS_ID + 41", local=True, namespace=namespace) is None
    assert namespace["y"] == 41
    with pytest.raises(ZeroDivisionError):  # the cell's own error, as it is
        mcjax.px(cluster, "1 / 0", local=True, namespace=namespace)
    cluster.push({"x": 1})  # no engines to reach
    assert cluster.client[:].pull("x", block=True) == []
    report = mcjax.health_check(cluster, namespace=namespace)
    assert report.ok and [p["role"] for p in report.processes] == ["kernel"]
    assert list(mcjax.storage_everywhere(cluster, [str(ROOT)])) == ["kernel"]
    assert mcjax.clock_skew(cluster) == {} and mcjax.abort_stale(cluster) == 0
    assert "single host" in cluster.summary()


@pytest.mark.extended
@pytest.mark.slow
def test_notebooks_run_on_a_single_host():
    pytest.importorskip("nbval")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_"))}
    env["XLA_FLAGS"] = xla_flags()
    env.update(MCJAX_SINGLE="1", JAX_PLATFORMS="cpu")
    notebooks = [str(ROOT / "notebooks" / name) for name in ("main.ipynb", "serve.ipynb")]
    # --noconftest: notebooks/conftest.py would start a simulated cluster for each notebook.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           "--nbval-lax", *notebooks], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.extended
def test_single_on_a_machine_with_chips_installs_the_platform_s_lock_first(tmp_path):
    """--single where the device files show GPUs (injected: MCJAX_DEV_DIR) and no MCJAX_PYTHON is
    given: the venv is synced to cluster/locks/cuda12.txt with dsr1 from this repository (venv.sh
    install; uv here records its calls) before anything starts; its jax still without the CUDA
    plugin, the start is refused naming that lock, and no Jupyter runs."""
    import importlib.util
    import socket

    if importlib.util.find_spec("jax_cuda12_plugin") is not None:
        pytest.skip("this Python has the CUDA plugin: it would use the GPUs")
    log, uv_dir = tmp_path / "uv.log", tmp_path / "uv" / "0.13.9"
    uv_dir.mkdir(parents=True)
    (uv_dir / "uv").write_text(f'#!/bin/sh\necho "$*" >>"{log}"\ncase "$*" in --version) echo "uv 0.13.9";; '
                               f'"python find"*) echo "{sys.executable}";; esac\nexit 0\n')
    (uv_dir / "uv").chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_", "PYTHONPATH", "JAX_"))}
    env.update(HOME=str(tmp_path), MCJAX_STATE=str(tmp_path / "state"), MCJAX_UV_DIR=str(tmp_path / "uv"),
               MCJAX_VENV=str(venv), MCJAX_DEV_DIR=str(tmp_path / "dev"), MCJAX_JUPYTER_PORT=str(port),
               MCJAX_HOST_PYTHON_FROM="uv")
    done = subprocess.run([str(ROOT / "mcjax_setup.sh"), "--single"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    lock = ROOT / "cluster" / "locks" / "cuda12.txt"
    assert f"pip sync --quiet --require-hashes --python {venv}/bin/python {lock}" in calls, calls
    assert f"pip install --quiet --python {venv}/bin/python --no-deps -e {ROOT}" in calls, calls
    assert "has GPU chips" in done.stderr and f"pip install -r {ROOT}/cluster/locks/cuda12.txt" in done.stderr
    assert not (tmp_path / "state" / "pids" / "jupyter.pid").exists()
