"""notebooks/main.ipynb in JupyterLab, driven by a real headless browser (Debian's Chromium through
Playwright's Python API) against a simulated cluster: the notebook's cells up to its generation
widget run top to bottom (connect, initialize, load the demo model, the cluster's logits against
one process's, the widget), the widget renders (no "Error displaying widget"), and a click on
Generate streams text into its output box. The cluster numbers its processes as a platform does
(the kernel is process 0); `pytest --nbval-lax notebooks` runs every cell of main.ipynb, kernel-last,
so the cells after the widget (MTP, serving, the decode profile: minutes of CPU) run there only.
Both read and write the run's compilation cache ($MCJAX_JAX_CACHE, tests/conftest.py) on clusters
of the same shape, so the second run of the model's programs compiles nothing.

Needs ``chromium`` (``tests/install_browser.sh``) and the ``playwright`` package; without them the
test is skipped, except under ``CI=true`` where it fails: CI must run it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from .harness import xla_flags

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("MCJAX_TEST_CHROMIUM", "/usr/bin/chromium")
PROCESSES = 2  # one engine and the kernel, as the notebooks' clusters under nbval (notebooks/conftest.py)
WIDGET = "GenerationWidget("  # the code cell that makes the generation widget: the last one run here
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing_or_skip(what: str) -> None:
    """Skip for ``what`` is missing, or fail under CI (where the browser test must run)."""
    message = f"{what} (install with tests/install_browser.sh and pip install -e '.[test,notebook]')"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {message}")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def lab(tmp_path):
    """A simulated cluster and JupyterLab on 127.0.0.1 (its kernels see the cluster's state
    folder); yields the notebook's URL."""
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        missing_or_skip(f"no Chromium at {CHROMIUM}")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing_or_skip("the playwright package is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_", "JAX_"))}
    env["XLA_FLAGS"] = xla_flags()
    if "MCJAX_JAX_CACHE" in os.environ:  # the run's compilation cache, shared with the notebooks' clusters
        env["MCJAX_JAX_CACHE"] = os.environ["MCJAX_JAX_CACHE"]
    env.update(MCJAX_STATE=str(tmp_path / "state"), MCJAX_CLUSTER_ID=f"browser-{uuid.uuid4().hex[:6]}",
               MCJAX_PYTHON=sys.executable, MCJAX_START_TIMEOUT="90", MCJAX_STOP_TIMEOUT="3",
               MCJAX_COORDINATOR_PORT=str(free_port()), JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(lab_settings(tmp_path / "lab-settings")),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"))
    setup = [str(ROOT / "mcjax_setup.sh")]
    port, token = free_port(), uuid.uuid4().hex
    served = tmp_path / "lab"  # a copy: JupyterLab saves the notebook it runs, outputs and all
    served.mkdir()
    up_to_the_widget(ROOT / "notebooks" / "main.ipynb", served / "main.ipynb")
    server = None
    try:
        # Platform numbering (the kernel is process 0): main.ipynb's run under it; nbval runs it kernel-last.
        done = subprocess.run([*setup, "--local", str(PROCESSES), "--numbering", "platform"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        log = (tmp_path / "jupyter.log").open("w")
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}", "--ServerApp.port_retries=0",
             "--allow-root", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            env=env, cwd=served, stdout=log, stderr=subprocess.STDOUT)
        wait_for_http(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=180)
        yield f"http://127.0.0.1:{port}/lab/tree/main.ipynb?token={token}"
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
        subprocess.run([*setup, "--stop"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def up_to_the_widget(notebook: Path, copy: Path) -> None:
    """Write `notebook`'s cells up to and including the code cell that makes the generation widget."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    widget = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and WIDGET in cell.source]
    assert widget, f"{notebook.name} has no code cell making the widget ({WIDGET!r})"
    nb.cells = nb.cells[: widget[0] + 1]
    nbformat.write(nb, copy)


# Each code cell of the open notebook, from JupyterLab's model (the page only renders the visible
# cells): its execution count (null before it ran), its first source line, and the error it raised, if
# any, with the traceback's last lines (the failing line).
CODE_CELLS = """() => Array.from(window.jupyterapp.shell.currentWidget.content.model.cells)
    .filter(c => c.type === 'code')
    .map(c => ({count: c.executionCount,
                source: c.sharedModel.getSource().split('\\n')[0],
                error: c.outputs.toJSON().filter(o => o.output_type === 'error')
                                         .map(o => o.ename + ': ' + o.evalue + ' | '
                                                   + (o.traceback || []).slice(-2).join(' ')
                                                       .replace(/\\u001b\\[[0-9;]*m/g, ''))}))"""


def accept_kernel_dialog(page) -> None:
    """Answer JupyterLab's "Select Kernel" dialog (the notebook's own kernel is preselected)."""
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    if dialog.count():
        dialog.locator("button", has_text="Select").click()


KERNEL_STATUS = "() => window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status ?? 'none'"


def wait_for_idle_kernel(page, timeout: float) -> None:
    """Until the notebook's kernel is started and idle (answering the kernel dialog if it comes):
    "Run All Cells" asked for before that does nothing."""
    deadline = time.monotonic() + timeout
    while (status := page.evaluate(KERNEL_STATUS)) != "idle":
        accept_kernel_dialog(page)
        assert time.monotonic() < deadline, f"the notebook's kernel is {status} after {timeout:.0f} s"
        time.sleep(0.5)


def lab_settings(folder: Path) -> Path:
    """JupyterLab user settings for the test: every cell in the page (no windowing: the widget's
    cell must be there to click), no news pop-up."""
    for plugin, settings in (("notebook-extension/tracker", '{"windowingMode": "none"}'),
                             ("apputils-extension/notification", '{"fetchNews": "false"}')):
        path = folder / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(settings)
    return folder


@pytest.mark.slow
def test_main_notebook_runs_in_jupyterlab_and_the_widget_streams(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    start = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000})
        try:
            page = browser.new_page()
            page.set_default_timeout(120_000)
            page.goto(lab)
            page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell")
            wait_for_idle_kernel(page, timeout=120)
            # Run > Run All Cells, through JupyterLab's command registry (the app is exposed for this);
            # not awaited: its promise ends with the last cell.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            deadline = time.monotonic() + 900
            while True:  # every code cell of the copy ran (an error stops "run all": its later cells stay unrun)
                accept_kernel_dialog(page)
                cells = page.evaluate(CODE_CELLS)
                # Which cell failed, and where: an assert without a message reads "AssertionError: " alone.
                errors = [(i, c["source"], e) for i, c in enumerate(cells) for e in c["error"]]
                assert not errors, errors
                if cells and all(c["count"] for c in cells):
                    break
                if time.monotonic() > deadline:
                    page.screenshot(path=str(tmp_path / "timeout.png"), full_page=True)
                    pytest.fail(f"cells not done after 900 s: {cells} (screenshot: {tmp_path / 'timeout.png'})")
                time.sleep(2)
            ran = time.monotonic() - start
            assert page.get_by_text("Error displaying widget").count() == 0
            outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "[Gloo]" not in outputs  # dsr1.workbench.native_output keeps Gloo's lines out
            box = page.locator(".jupyter-widgets textarea").nth(1)  # the widget's output box (after the prompt)
            first = box.input_value()
            assert first, "the notebook's own generation left no text in the widget"

            # The page records the box's values itself: a poll from here is a round trip to Chromium, which a
            # busy machine can make slower than the whole generation.
            page.evaluate("""() => {
                const box = document.querySelectorAll('.jupyter-widgets textarea')[1];
                window.dsr1Seen = [box.value];
                window.dsr1Watch = setInterval(() => {
                    if (box.value !== window.dsr1Seen[window.dsr1Seen.length - 1]) window.dsr1Seen.push(box.value);
                }, 5);
            }""")
            page.locator(".jupyter-widgets button", has_text="Generate").click()
            seen, deadline = [], time.monotonic() + 120
            while time.monotonic() < deadline:
                seen = page.evaluate("() => window.dsr1Seen")
                if seen[-1] == first and len(seen) > 2:
                    break  # the same prompt and seed: the same text again, once it has grown back
                time.sleep(0.5)
            page.evaluate("() => clearInterval(window.dsr1Watch)")
            print(f"JupyterLab: all cells in {ran:.0f} s; after Generate the output box went through "
                  f"{len(seen)} states; total {time.monotonic() - start:.0f} s")
            assert "" in seen, "Generate did not clear the output box"
            growing = [v for v in seen[seen.index(""):] if v]  # the first poll may still see the old text
            assert growing and growing[-1] == first, seen[-3:]
            assert len(growing) >= 2 and all(b.startswith(a) for a, b in zip(growing, growing[1:])), seen
        finally:
            browser.close()
