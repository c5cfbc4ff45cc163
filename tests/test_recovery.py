"""An engine SIGKILLed in the middle of a notebook cell that runs collectives: the cell fails
within 60 s naming the engine, and the notebook's documented recovery (``reset_engines``, then the
cells from "Initialize" again) brings it back to a working generation, without restarting the
kernel or touching the controller.

The notebook is a real Jupyter kernel (ipykernel, driven with jupyter_client) against a simulated
cluster of 4 processes (``./mcjax_setup.sh --local 4``), with the platform's numbering (the
kernel is process 0 and runs JAX's coordinator, as on TPU pods and Slurm) and, on request, with
kernel-last numbering (the victim is not process 0: when the coordinator's process dies JAX ends
every process, the notebook's recovery section says so).
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

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 4

SETUP = """
import os
from dsr1.workbench import cluster as mcjax
info = mcjax.cluster_info()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={info['local_devices']}"
os.environ["JAX_PLATFORMS"] = "cpu"
cluster = mcjax.connect()
engines = mcjax.wait_for_engines(cluster, info["engines"])
layout = mcjax.assign_process_ids(cluster)
mcjax.activate(cluster)
"""

# The notebook's cells from "Initialize" on (notebooks/main.py), with the tiny random model.
INITIALIZE = """%%everywhere
import jax
from dsr1.workbench import cluster as mcjax
mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR, timeout=120)
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
"""
MODEL = """%%everywhere
import dsr1
mesh = dsr1.make_mesh()
model = dsr1.init_random(dsr1.Config.preset("tiny"), mesh=mesh)
tokenizer = dsr1.load_tokenizer(None)
"""
GENERATE = """
from dsr1.workbench.widgets import GenerationWidget
widget = GenerationWidget(model, tokenizer, engines=cluster.client[:], max_new_tokens=12)
widget.prompt.value = "Explain multi-head latent attention."
widget.button.click()
assert widget.result.completions[0].tokens and widget.output.value == widget.result.completions[0].text
print("GENERATED", repr(widget.output.value), widget.status.value)
"""
# Collectives for up to ~5 minutes; the kernel says when they run, so the test kills an engine mid-cell.
COLLECTIVES = """%%everywhere
import time
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
x = jax.device_put(jnp.ones(jax.device_count() * 4), NamedSharding(mesh, P(mesh.axis_names)))
float(total(x))
if PROCESS_ID == KERNEL_PROCESS_ID:
    print("COLLECTIVES RUNNING", flush=True)
end = time.monotonic() + 300
while time.monotonic() < end:
    float(total(x))
"""
RECOVER = "mcjax.reset_engines(cluster)\nprint('RECOVERED', cluster.layout.numbering, cluster.layout.port)"


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
        ``until``, ``on_output()`` is called once when that text first appears."""
        msg_id = self.client.execute(code)
        text, called = [], False
        deadline = time.monotonic() + timeout
        while True:
            msg = self.client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
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
        reply = self.client.get_shell_msg(timeout=30)
        return reply["content"], "".join(text)

    def ok(self, code: str, timeout: float = 240) -> str:
        reply, text = self.run(code, timeout)
        assert reply["status"] == "ok", text[-4000:]
        return text

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def engine_pids(state: Path) -> dict[int, int]:
    """Host index -> engine pid, from the scripts' pid files."""
    return {int(p.stem.split("-")[1]): int(p.read_text().split()[0]) for p in (state / "pids").glob("engine-*.pid")}


# Each numbering takes ~2.5 min on 2 cores: platform (the TPU / Slurm path) by default, both with
# MCJAX_TEST_RECOVERY_NUMBERINGS="platform kernel-last".
NUMBERINGS = os.environ.get("MCJAX_TEST_RECOVERY_NUMBERINGS", "platform").split()


@pytest.mark.slow
@pytest.mark.parametrize("numbering", NUMBERINGS)
def test_engine_killed_mid_collective_fails_the_cell_then_recovery_generates(numbering, tmp_path):
    pytest.importorskip("ipyparallel")
    pytest.importorskip("jupyter_client")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_", "JAX_")) and k != "XLA_FLAGS"}
    env.update(MCJAX_STATE=str(tmp_path), MCJAX_CLUSTER_ID=f"recovery-{uuid.uuid4().hex[:6]}",
               MCJAX_PYTHON=sys.executable, MCJAX_LOCAL_DEVICES="2", MCJAX_START_TIMEOUT="90",
               MCJAX_STOP_TIMEOUT="3", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    setup = [str(ROOT / "mcjax_setup.sh")]
    done = subprocess.run([*setup, "--local", str(PROCESSES), "--numbering", numbering], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    kernel = None
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        kernel = Kernel(env)
        kernel.ok(SETUP)
        kernel.ok(INITIALIZE)
        kernel.ok(MODEL)
        # Host 2's engine: process 2 under platform numbering, 1 under kernel-last (not the coordinator, 0).
        victim = engine_pids(tmp_path)[2]
        killed = []

        def kill() -> None:
            time.sleep(1.0)  # well inside the loop of collectives
            os.kill(victim, signal.SIGKILL)
            killed.append(time.monotonic())

        reply, text = kernel.run(COLLECTIVES, timeout=200, until="COLLECTIVES RUNNING", on_output=kill)
        failed_after = time.monotonic() - killed[0]
        print(f"{numbering}: the cell failed {failed_after:.1f} s after the engine was killed")
        assert reply["status"] == "error" and reply["ename"] == "ClusterError", text[-3000:]
        assert f"pid {victim}" in reply["evalue"] and "is gone" in reply["evalue"], reply["evalue"]
        assert "reset_engines" in reply["evalue"]
        assert failed_after < 60

        # The documented recovery: reset_engines, then the cells from "Initialize" on.
        start = time.monotonic()
        assert "RECOVERED " + numbering in kernel.ok(RECOVER)
        assert victim not in engine_pids(tmp_path).values()
        kernel.ok(INITIALIZE)
        kernel.ok(MODEL)
        out = kernel.ok(GENERATE)
        print(f"{numbering}: recovery to a generation took {time.monotonic() - start:.1f} s")
        assert "GENERATED '" in out and "tokens" in out, out
    finally:
        if kernel is not None:
            kernel.close()
        subprocess.run([*setup, "--stop"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
