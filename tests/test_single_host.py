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
