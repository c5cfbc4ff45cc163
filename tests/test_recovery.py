"""The notebook's failures and recoveries in a real Jupyter kernel (ipykernel, driven with
jupyter_client) against a simulated cluster of 2 processes (``./mcjax_setup.sh --local 2``: the
kernel and one engine), under both numberings (platform: the kernel is process 0 and runs JAX's
coordinator, as on TPU pods and Slurm; kernel-last: the engine is process 0):

- an engine raises in the first collective of a cell, and after one successful collective: the
  cell fails within 60 s naming the engine, with its traceback; the same for an exception in the
  generation widget's engine part;
- the notebook's first cell (``connect()``) then restarts the stuck engines by itself;
- "Restart kernel" and running the cells again works without touching the cluster;
- an engine SIGKILLed mid-collective: the cell fails within 60 s naming it, and ``reset_engines``
  brings the notebook back to a working generation.

One cluster per numbering, shared by the module's steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .harness import xla_flags

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 2

# The notebook's first cells (notebooks/main.py), with the tiny random model (the demo's vocabulary).
SETUP = """
import dsr1.workbench as mcjax
cluster = mcjax.connect()
VICTIM = cluster.layout.engines[-1].process_id
cluster.push({"VICTIM": VICTIM})
print("CONNECTED", cluster.summary())
"""
INITIALIZE = """
import jax
mcjax.initialize_everywhere(cluster, timeout=120)
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
"""
MODEL = """%%everywhere
import dataclasses
import dsr1
mesh = dsr1.make_mesh()
model = dsr1.init_random(dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=4096), mesh=mesh)
tokenizer = dsr1.load_tokenizer(dsr1.demo_checkpoint())   # the demo's 4,096 tokens
"""
GENERATE = """
from dsr1.workbench.widgets import GenerationWidget
widget = GenerationWidget(model, tokenizer, cluster=cluster, max_new_tokens=12)
widget.prompt.value = "Explain multi-head latent attention."
widget.button.click()
assert widget.result.completions[0].tokens and widget.output.value == widget.result.completions[0].text
print("GENERATED", repr(widget.output.value), widget.status.value)
"""
_SUM = """
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
x = jax.device_put(jnp.ones(jax.device_count() * 4), NamedSharding(mesh, P(mesh.axis_names)))
"""
# The victim raises before the first collective of the cell; the others wait in it.
RAISE_FIRST = "%%everywhere\nimport jax" + _SUM + """
total = jax.jit(lambda v: jnp.sum(v * 2), out_shardings=NamedSharding(mesh, P()))   # a new program
if PROCESS_ID == VICTIM:
    raise ValueError(f"no weights on process {PROCESS_ID}")
float(total(x))
"""
# One collective succeeds everywhere, then the victim raises and the others go on with collectives.
RAISE_AFTER = "%%everywhere\nimport jax" + _SUM + """
assert float(total(x)) == jax.device_count() * 4
if PROCESS_ID == VICTIM:
    raise ValueError(f"out of memory on process {PROCESS_ID}")
for _ in range(1000):
    float(total(x))
"""
# Collectives for up to ~5 minutes; the kernel says when they run, so the test kills an engine mid-cell.
COLLECTIVES = "%%everywhere\nimport time\nimport jax" + _SUM + """
float(total(x))
if PROCESS_ID == KERNEL_PROCESS_ID:
    print("COLLECTIVES RUNNING", flush=True)
end = time.monotonic() + 300
while time.monotonic() < end:
    float(total(x))
"""
# The victim engine's generation raises (its model is gone) while the kernel's streams.
BREAK_VICTIM = """
victim = next(e.engine_id for e in cluster.layout.engines if e.process_id == VICTIM)
cluster.client[victim].execute("model = None", block=True)
"""
RECOVER = "mcjax.reset_engines(cluster)\nprint('RECOVERED', cluster.layout.numbering, cluster.layout.port)"


class KernelDied(RuntimeError):
    """The kernel process ended while it ran a cell."""


class Kernel:
    """A Jupyter kernel run through jupyter_client: ``run(code)`` executes a cell."""

    def __init__(self, env: dict[str, str]):
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=env, cwd=str(ROOT))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 240, until: str | None = None,
            on_output=None) -> tuple[dict, str]:
        """Execute ``code``; returns (the execute reply's content, the text it printed). With
        ``until``, ``on_output()`` is called once when that text first appears. Raises `KernelDied`
        when the kernel process ends before the cell does."""
        import queue

        msg_id = self.client.execute(code)
        text, called = [], False
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                if not self.manager.is_alive():
                    raise KernelDied("".join(text)) from None
                if time.monotonic() > deadline:
                    raise
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind == "error":
                text.append(f"{content['ename']}: {content['evalue']}")
            if until and not called and until in "".join(text):
                called = True
                on_output()
            if kind == "status" and content["execution_state"] == "idle":
                break
        while True:  # skip replies to earlier requests (wait_for_ready's kernel_info)
            reply = self.client.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"], "".join(text)

    def ok(self, code: str, timeout: float = 420) -> str:
        reply, text = self.run(code, timeout)
        assert reply["status"] == "ok", text[-4000:]
        return text

    def restart(self) -> None:
        """Jupyter's "Restart kernel": a new kernel process, the same connection."""
        self.manager.restart_kernel(now=True)
        self.client.wait_for_ready(timeout=60)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def engine_pids(state: Path) -> dict[int, int]:
    """Host index -> engine pid, from the scripts' pid files."""
    return {int(p.stem.split("-")[1]): int(p.read_text().split()[0]) for p in (state / "pids").glob("engine-*.pid")}


# The platform's numbering (the TPU / Slurm path) by default; both with
# MCJAX_TEST_RECOVERY_NUMBERINGS="platform kernel-last".
NUMBERINGS = os.environ.get("MCJAX_TEST_RECOVERY_NUMBERINGS", "platform").split()


@pytest.fixture(scope="module", params=NUMBERINGS)
def notebook(request, tmp_path_factory):
    """A simulated cluster of 2 processes with the given numbering and a Jupyter kernel on it."""
    pytest.importorskip("ipyparallel")
    pytest.importorskip("jupyter_client")
    numbering, state = request.param, tmp_path_factory.mktemp(f"mcjax-{request.param}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_", "JAX_"))}
    env["XLA_FLAGS"] = xla_flags()
    env.update(MCJAX_STATE=str(state), MCJAX_CLUSTER_ID=f"recovery-{uuid.uuid4().hex[:6]}",
               MCJAX_PYTHON=sys.executable, MCJAX_LOCAL_DEVICES="2", MCJAX_START_TIMEOUT="90",
               MCJAX_STOP_TIMEOUT="3", DSR1_CPU_KERNELS="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    setup = [str(ROOT / "mcjax_setup.sh")]
    done = subprocess.run([*setup, "--local", str(PROCESSES), "--numbering", numbering], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    kernel = None
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        kernel = Kernel(env)
        yield numbering, state, kernel
    finally:
        if kernel is not None:
            kernel.close()
        subprocess.run([*setup, "--stop"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def fails_naming_the_engine(kernel: Kernel, cell: str, message: str) -> str:
    """Run ``cell``; it must fail within 60 s with a ClusterError naming the engine, with its traceback."""
    start = time.monotonic()
    reply, text = kernel.run(cell, timeout=120)
    took = time.monotonic() - start
    assert reply["status"] == "error" and reply["ename"] == "ClusterError", text[-3000:]
    error = reply["evalue"]
    assert "engine " in error and "(process " in error and f"raised ValueError: {message}" in error, error
    assert took < 60, f"the cell failed after {took:.0f} s"
    return error


@pytest.mark.slow
def test_engine_exceptions_end_the_cell_and_the_first_cell_recovers(notebook):
    numbering, state, kernel = notebook
    assert "CONNECTED" in kernel.ok(SETUP)
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    error = fails_naming_the_engine(kernel, RAISE_FIRST, "no weights on process")
    assert "raise ValueError" in error  # the engine's own source line, from its traceback
    print(f"{numbering}: raise in the first collective:\n{error[:600]}")

    out = kernel.ok(SETUP)  # the first cell again: the engine is stuck in the collective, it is restarted
    assert "restarting the engines" in out, out
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    error = fails_naming_the_engine(kernel, RAISE_AFTER, "out of memory on process")
    assert "raise ValueError" in error

    assert "restarting the engines" in kernel.ok(SETUP)
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    kernel.ok(BREAK_VICTIM)
    start = time.monotonic()
    _, text = kernel.run(GENERATE, timeout=240)  # a click handler's error is shown, not raised (ipywidgets)
    assert time.monotonic() - start < 60
    assert "ClusterError: engine " in text and "raised AttributeError" in text, text[-3000:]
    assert "still in the generation" in text and "_generate_on_engine" in text  # the engine's traceback


@pytest.mark.extended
@pytest.mark.slow
def test_restart_kernel_and_run_all(notebook):
    """"Restart kernel and run all": the first cell restarts the engines (they died with the
    kernel's coordinator, or keep the old kernel's jax.distributed group) and the rest runs."""
    numbering, state, kernel = notebook
    kernel.ok(SETUP)
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    kernel.ok(GENERATE)
    before = engine_pids(state)
    kernel.restart()
    out = kernel.ok(SETUP, timeout=300)
    assert "restarting the engines" in out, out
    assert engine_pids(state) != before
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    assert "GENERATED '" in kernel.ok(GENERATE)


@pytest.mark.slow
def test_engine_killed_mid_collective_fails_the_cell_then_recovery_generates(notebook):
    numbering, state, kernel = notebook
    kernel.ok(SETUP)
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    victim = engine_pids(state)[1]
    killed = []

    def kill() -> None:
        time.sleep(1.0)  # well inside the loop of collectives
        os.kill(victim, signal.SIGKILL)
        killed.append(time.monotonic())

    if numbering == "kernel-last":  # the victim is process 0, which runs JAX's coordinator
        with pytest.raises(KernelDied):
            kernel.run(COLLECTIVES, timeout=200, until="COLLECTIVES RUNNING", on_output=kill)
        died_after = time.monotonic() - killed[0]
        print(f"kernel-last: JAX ended the kernel {died_after:.1f} s after process 0 was killed")
        assert died_after < 60
        # The documented recovery (main.ipynb, "Recovery"): restart the kernel, run from the top.
        kernel.restart()
        assert "restarting the engines" in kernel.ok(SETUP, timeout=300)
        kernel.ok(INITIALIZE)
        kernel.ok(MODEL)
        assert "GENERATED '" in kernel.ok(GENERATE)
        return
    reply, text = kernel.run(COLLECTIVES, timeout=200, until="COLLECTIVES RUNNING", on_output=kill)
    failed_after = time.monotonic() - killed[0]
    print(f"{numbering}: the cell failed {failed_after:.1f} s after the engine was killed")
    assert reply["status"] == "error" and reply["ename"] == "ClusterError", text[-3000:]
    # Named as gone, whether the liveness check or ipyparallel's EngineError saw it first.
    assert f"pid {victim}" in reply["evalue"] and "is gone" in reply["evalue"], reply["evalue"]
    assert "reset_engines" in reply["evalue"]
    assert failed_after < 60

    # The documented recovery: reset_engines, then the cells from "Initialize" on.
    start = time.monotonic()
    assert "RECOVERED " + numbering in kernel.ok(RECOVER)
    assert victim not in engine_pids(state).values()
    kernel.ok(INITIALIZE)
    kernel.ok(MODEL)
    out = kernel.ok(GENERATE)
    print(f"{numbering}: recovery to a generation took {time.monotonic() - start:.1f} s")
    assert "GENERATED '" in out and "tokens" in out, out
