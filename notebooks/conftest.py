"""`pytest --nbval-lax notebooks/` runs each notebook against a fresh simulated cluster.

Before a notebook's first cell, `./mcjax_setup.sh --local N --numbering NUMBERING` starts a
controller and N-1 engines; after its last cell, and in any case when pytest ends, the cluster is
stopped. N is `$MCJAX_TEST_PROCESSES` (default 2: the kernel and one engine, which is all a
notebook needs to run every cell across processes; more processes on a small machine only share
its cores, while the tests of the numbering itself run in tests/test_cluster.py). NUMBERING is
`$MCJAX_TEST_NUMBERING`: `kernel-last` (default; the nbval kernel is process N-1, with explicit
ids) or `platform` (Slurm-style variables, the kernel is process 0 and JAX numbers the processes
itself, as on TPU pods). tests/test_notebooks.py runs cluster_check.ipynb again under the other
numbering, and tests/test_browser.py main.ipynb up to its widget (in JupyterLab).

A fresh cluster per notebook, not one shared: a JAX process cannot join a second
`jax.distributed` group, so the engines that one notebook's kernel initialized must be restarted
for the next anyway, and restarting them costs nearly all that starting a cluster does. What the
notebooks share is one compilation cache: a later cluster reads the programs an earlier one
compiled. The notebooks are marked `slow` (`pytest -m "not slow"` leaves them out).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PROCESSES = int(os.environ.get("MCJAX_TEST_PROCESSES", "2"))
NUMBERING = os.environ.get("MCJAX_TEST_NUMBERING", "kernel-last")
_running: dict[str, Path] = {}


def _setup(*args: str) -> None:
    subprocess.run([str(ROOT / "mcjax_setup.sh"), *args], check=True, cwd=ROOT, timeout=300)


def _stop() -> None:
    """Stop the notebook's cluster and remove its state folder, unless one of its cells failed: then
    the engines' logs stay there to read."""
    if _running.pop("notebook", None) is not None:
        _setup("--stop")
        if _running.pop("failed", None) is None:
            shutil.rmtree(os.environ["MCJAX_STATE"], ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(notebook: Path) -> None:
    """A new state folder (ipyparallel profile) and coordinator port per notebook, so nothing of the
    previous cluster, still shutting down, is in the way. The kernel inherits them."""
    _stop()
    os.environ["MCJAX_STATE"] = tempfile.mkdtemp(prefix=f"mcjax-{notebook.stem}-")
    os.environ["MCJAX_COORDINATOR_PORT"] = str(_free_port())
    os.environ["MCJAX_PYTHON"] = sys.executable  # engines run this environment's Python, as the kernel does
    _running["notebook"] = notebook  # before starting: a failed start is stopped too
    _setup("--local", str(PROCESSES), "--numbering", NUMBERING)


def pytest_configure(config) -> None:
    """One JAX compilation cache for every notebook cluster of this pytest, for the rerun under the
    other numbering (tests/test_notebooks.py) and, with tests/, for the browser test's cluster
    (tests/conftest.py sets the same variable first): a later run reads the programs an earlier one
    compiled instead of compiling them again. Removed at exit."""
    if "MCJAX_JAX_CACHE" not in os.environ:
        cache = tempfile.mkdtemp(prefix="mcjax-jax-cache-")
        os.environ["MCJAX_JAX_CACHE"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)


def pytest_collection_modifyitems(items) -> None:
    """Every notebook cell is `slow`: it runs on a simulated cluster of several processes."""
    for item in items:
        if Path(str(item.fspath)).suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before nbval starts the notebook's kernel, which inherits the environment
def pytest_runtest_setup(item) -> None:
    notebook = Path(str(item.fspath))
    if notebook.suffix == ".ipynb" and _running.get("notebook") != notebook:
        _start(notebook)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed cell's report says where its cluster's logs are kept (`_stop`)."""
    report = (yield).get_result()
    if report.failed and Path(str(item.fspath)).suffix == ".ipynb":
        _running["failed"] = Path(str(item.fspath))
        report.sections.append(("cluster", f"the cluster's state and logs are kept in {os.environ['MCJAX_STATE']}"))


def pytest_sessionfinish(session, exitstatus) -> None:
    _stop()


atexit.register(_stop)  # also when pytest is interrupted
