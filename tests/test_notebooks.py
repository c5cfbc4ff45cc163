"""The committed notebooks are what their jupytext sources say.

Each ``notebooks/<name>.ipynb`` is generated from ``notebooks/<name>.py`` (jupytext percent
format, which reviews as plain Python): after editing either, run
``jupytext --sync notebooks/<name>.py`` (the newer file of the pair wins) and commit both.
Outputs and metadata do not matter here; cell types and sources do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .harness import xla_flags

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def jupytext_sources() -> list[Path]:
    """The notebooks' .py sources: the .py files with a jupytext header."""
    return sorted(p for p in NOTEBOOKS.glob("*.py") if p.read_text().startswith("# ---\n# jupyter:\n#   jupytext:"))


def cells(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def test_every_notebook_has_a_jupytext_source():
    sources = {p.stem for p in jupytext_sources()}
    notebooks = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    assert notebooks and notebooks == sources, (
        f"notebooks without a jupytext source: {sorted(notebooks - sources)}; sources without a notebook: "
        f"{sorted(sources - notebooks)} (create the missing one with `jupytext --to py:percent` or "
        f"`jupytext --to ipynb`, then pair them with `jupytext --set-formats ipynb,py:percent`)")


@pytest.mark.parametrize("source", jupytext_sources(), ids=lambda p: p.name)
def test_notebook_matches_its_jupytext_source(source: Path):
    jupytext = pytest.importorskip("jupytext")
    import nbformat

    notebook = source.with_suffix(".ipynb")
    expected = cells(jupytext.read(source))
    committed = cells(nbformat.read(notebook, as_version=4))
    stale = [i for i, (a, b) in enumerate(zip(expected, committed)) if a != b]
    assert committed == expected, (
        f"{notebook.name} differs from its source {source.name} ({len(committed)} cells vs {len(expected)}; first "
        f"differing cell: {(stale or [min(len(committed), len(expected))])[0]}): run "
        f"`jupytext --sync notebooks/{source.name}` and commit both files")


# Run again under the platform's numbering: the cluster check. main.ipynb runs under it, up to its
# widget, in JupyterLab (tests/test_browser.py); serve.ipynb runs once, under kernel-last, where
# process 0 (which serves HTTP) is an engine rather than the kernel: each run of a notebook on a
# simulated cluster costs minutes of CPU.
PLATFORM_NUMBERED = ("cluster_check.ipynb",)


@pytest.mark.slow
def test_notebooks_pass_under_platform_numbering():
    """`pytest --nbval-lax notebooks` runs them with kernel-last numbering (notebooks/conftest.py);
    here the cluster check runs again, in a pytest of their own, with the platform's numbering
    (the kernel is process 0, JAX numbers the processes from Slurm-style variables, as on TPU pods).
    Both runs share one compilation cache ($MCJAX_JAX_CACHE, notebooks/conftest.py)."""
    pytest.importorskip("nbval")
    pytest.importorskip("ipyparallel")
    if os.environ.get("MCJAX_TEST_NUMBERING") == "platform":
        pytest.skip("this pytest already runs the notebooks with platform numbering")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCJAX_")}
    env["XLA_FLAGS"] = xla_flags()
    env["MCJAX_TEST_NUMBERING"] = "platform"
    if "MCJAX_JAX_CACHE" in os.environ:
        env["MCJAX_JAX_CACHE"] = os.environ["MCJAX_JAX_CACHE"]
    start = time.monotonic()
    notebooks = [str(NOTEBOOKS / name) for name in PLATFORM_NUMBERED]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", *notebooks],
                          cwd=NOTEBOOKS.parent, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
    print(f"notebooks under platform numbering: {time.monotonic() - start:.0f} s; {done.stdout.splitlines()[-1]}")
