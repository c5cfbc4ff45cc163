"""The multi-host workbench's cluster layer: the shell scripts (shellcheck, cluster_exec, NFS
exports, fstab), the simulated cluster of ./mcjax_setup.sh --local (controller + engines on
127.0.0.1), jax.distributed across its processes through %%px --local, and what happens when
an engine dies or initialize hangs.

The notebook kernel (JAX process N-1) is played by a Python subprocess, because this pytest
process has already started JAX with one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .harness import xla_flags

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 2  # fake CPU devices per process
N = 3  # processes: 2 engines + the kernel


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without MCJAX_* settings or a device count, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCJAX_")}
    env["XLA_FLAGS"] = xla_flags()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- shell scripts

SHELLS = ["bash", pytest.param("zsh", marks=pytest.mark.skipif(shutil.which("zsh") is None,
                                                               reason="zsh is not installed"))]


@pytest.mark.parametrize("shell", SHELLS)
def test_cluster_exec_returns_the_failing_hosts_status(shell, tmp_path):
    env = clean_env(MCJAX_PROVIDER="local", MCJAX_HOSTS="4", MCJAX_STATE=str(tmp_path))

    def cluster_exec(*args: str) -> subprocess.CompletedProcess:
        quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in args)
        return run([shell, "-c", f". ./mcjax_defs.sh && cluster_exec {quoted}"], env=env)

    fail = cluster_exec("0", "3", 'echo "ok $MCJAX_HOST_INDEX"; [ "$MCJAX_HOST_INDEX" != 2 ] || exit 7')
    assert fail.returncode == 7, fail.stdout + fail.stderr
    assert "host 2 (exit status 7)" in fail.stderr and "host 1 " not in fail.stderr
    assert {f"[host {i}] ok {i}" for i in range(4)} <= set(fail.stdout.splitlines())

    two = cluster_exec("0", "3", 'exit $((MCJAX_HOST_INDEX == 3 ? 3 : MCJAX_HOST_INDEX == 1 ? 5 : 0))')
    assert two.returncode == 5, two.stderr  # the first failing host (lowest index), naming both
    assert "host 1 (exit status 5)" in two.stderr and "host 3 (exit status 3)" in two.stderr

    ok = cluster_exec("0", "3", "true")
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr

    one = cluster_exec("2", "2", 'echo "alone $MCJAX_HOST_INDEX"; exit 7')
    assert one.returncode == 7 and one.stdout.strip() == "alone 2" and "host 2" in one.stderr

    outside = cluster_exec("0", "4", "true")
    assert outside.returncode == 2 and "host 4 does not exist" in outside.stderr


def test_nfs_exports_list_exactly_the_hosts(tmp_path):
    ips = ["10.128.0.11", "10.128.0.12", "10.128.0.13", "10.128.0.14"]
    env = clean_env(MCJAX_PROVIDER="ssh", MCJAX_HOST_LIST="10.128.0.11, 10.128.0.12 10.128.0.13,10.128.0.14",
                    MCJAX_NFS_DIR="/mnt/shared", MCJAX_STATE=str(tmp_path))
    done = run([ROOT / "mcjax_setup.sh", "--print-exports"], env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [f"/mnt/shared {ip}(rw,sync,no_subtree_check,root_squash)" for ip in ips]
    # Never a range or a wildcard, even when asked.
    for bad in ("10.128.0.0/16", "*", "10.128.0.*"):
        refused = run(["bash", ROOT / "cluster/nfs.sh", "exports", "10.128.0.11", bad], env=env)
        assert refused.returncode != 0 and "never ranges or '*'" in refused.stderr, refused.stdout


def test_fstab_entry_is_added_once(tmp_path):
    """One line per mount, with nofail (a boot whose host 0 is gone goes on); an earlier setup's line
    for the same mount (without nofail) is replaced, another server's is an error."""
    fstab = tmp_path / "fstab"
    earlier = "10.128.0.11:/mnt/shared /mnt/shared nfs rw,hard,noatime,_netdev 0 0"
    fstab.write_text(f"UUID=abc / ext4 defaults 0 1\n{earlier}\n")
    env = clean_env(MCJAX_PROVIDER="ssh", MCJAX_NFS_DIR="/mnt/shared", MCJAX_FSTAB=str(fstab),
                    MCJAX_STATE=str(tmp_path))
    for _ in range(2):
        done = run(["bash", ROOT / "cluster/nfs.sh", "fstab-ensure", "10.128.0.11"], env=env)
        assert done.returncode == 0, done.stderr
    lines = fstab.read_text().splitlines()
    assert lines == ["UUID=abc / ext4 defaults 0 1",
                     "10.128.0.11:/mnt/shared /mnt/shared nfs rw,hard,noatime,_netdev,nofail 0 0"]
    other = run(["bash", ROOT / "cluster/nfs.sh", "fstab-ensure", "10.128.0.99"], env=env)  # another server
    assert other.returncode != 0 and "different entry for /mnt/shared" in other.stderr
    assert fstab.read_text().splitlines() == lines


def test_process_numbering_follows_host_index():
    from dsr1.workbench.layout import number_processes

    infos = {7: dict(host_index="3", hostname="h3", pid=30, address="10.0.0.3"),
             2: dict(host_index="1", hostname="h1", pid=10, address="10.0.0.1"),
             5: dict(host_index="2", hostname="h2", pid=20, address="10.0.0.2")}
    gpu = number_processes(list(infos), list(infos.values()), 9999, "kernel-last")
    assert [(e.engine_id, e.process_id) for e in gpu.engines] == [(2, 0), (5, 1), (7, 2)]
    assert (gpu.num_processes, gpu.kernel_process_id, gpu.coordinator) == (4, 3, "10.0.0.1:9999")
    tpu = number_processes(list(infos), list(infos.values()), 9999, "platform")  # JAX numbers TPU workers itself
    assert [(e.host_index, e.process_id) for e in tpu.engines] == [(1, 1), (2, 2), (3, 3)]
    assert (tpu.kernel_process_id, tpu.coordinator, tpu.port) == (0, None, 9999)


def test_platform_numbering_gives_the_kernel_the_platform_variables_and_a_bind_address():
    from dsr1.workbench.connection import Cluster
    from dsr1.workbench.layout import number_processes, process_env

    info = {"numbering": "platform", "kernel_env": {"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                                    "JAX_COORDINATOR_PORT": "1234"}}
    cluster = Cluster(client=None, info=info, controller_ip="10.0.0.5")
    engine = [dict(host_index="1", hostname="h1", pid=1, address="10.0.0.6")]
    layout = number_processes([3], engine, 4321, "platform")
    kernel = process_env(cluster, layout, kernel=True)
    assert kernel == {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "JAX_COORDINATOR_PORT": "4321",
                      "JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.5:4321"}  # a new port wins over kernel_env's
    assert process_env(cluster, layout, kernel=False) == {"JAX_COORDINATOR_PORT": "4321"}
    kernel_last = number_processes([3], engine, 4321, "kernel-last")
    assert process_env(cluster, kernel_last, kernel=True) == {}


def test_an_engine_is_dead_by_its_own_host_not_by_a_shared_hostname():
    """Hosts cloned from one image share a hostname: an engine elsewhere whose pid does not run here
    is alive; one of this host (its probe's host key) whose process is gone is dead, as is one that
    left the controller."""
    from types import SimpleNamespace

    from dsr1.workbench.connection import Cluster
    from dsr1.workbench.engines import dead_engines
    from dsr1.workbench.layout import number_processes
    from dsr1.workbench.process import host_key

    gone = subprocess.Popen(["true"])
    gone.wait()
    here, name = host_key(), socket.gethostname()
    infos = [dict(host_index=str(i), hostname=name, pid=gone.pid, address=f"10.0.0.{i}", host_key=key)
             for i, key in ((1, "another-boot net:[1]"), (2, here), (3, "another-boot net:[1]"))]
    layout = number_processes([0, 1, 2], infos, 9999, "kernel-last")
    assert [e.host_key for e in layout.engines] == ["another-boot net:[1]", here, "another-boot net:[1]"]
    cluster = Cluster(SimpleNamespace(ids=[0, 1]), layout=layout)
    assert dead_engines(cluster, [0, 1, 2]) == [1, 2]
    assert here.split()[0] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_watchdog_ends_a_stuck_call_when_an_engine_is_dead():
    import threading

    from dsr1.workbench.watchdog import run_watched

    stuck, dead = threading.Event(), []
    threading.Timer(0.3, lambda: dead.append(7)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="engine 7 is gone"):
        run_watched(stuck.wait, lambda: list(dead), lambda d: RuntimeError(f"engine {d[0]} is gone"), poll=0.05)
    assert time.monotonic() - start < 2
    stuck.set()
    assert run_watched(lambda: 42, list, lambda d: RuntimeError("no")) == 42
    with pytest.raises(ZeroDivisionError):
        run_watched(lambda: 1 / 0, list, lambda d: RuntimeError("no"))


def test_watch_ends_the_cell_when_an_engine_raises_while_the_kernel_is_stuck():
    """An engine's exception while this kernel waits for it in a collective (here: forever) ends
    the call after the settle time, naming the engine with its traceback and the kernel as stuck;
    an error of every process alike is the kernel's own."""
    import threading

    from dsr1.workbench.connection import Cluster
    from dsr1.workbench.engines import watch

    class Remote(Exception):
        ename, evalue = "ValueError", "no weights on this host"
        traceback = ("\x1b[31mTraceback (most recent call last)\x1b[0m\n  File \"<cell>\", line 3\n"
                     "ValueError: no weights")

    class Result:
        def __init__(self, error=None, value=None):
            self.error, self.value = error, value

        def ready(self):
            return True

        def get(self, timeout=None):
            if self.error is not None:
                raise self.error
            return self.value

    class Client:
        ids = [4, 5]

    cluster = Cluster(client=Client(), info={"provider": "ssh"})
    stuck = threading.Event()
    start = time.monotonic()
    with pytest.raises(mcjax_error()) as error:
        watch(cluster, {4: Result(Remote()), 5: Result(value=1)}, stuck.wait, None, settle=0.5)
    assert time.monotonic() - start < 5
    message = str(error.value)
    assert message.startswith("engine 4 raised ValueError: no weights on this host"), message
    assert "this kernel is still in the cell" in message and "reset_engines" in message
    assert "--- engine 4:\nTraceback (most recent call last)\n  File" in message  # its traceback, colours removed
    stuck.set()

    def mistake():
        raise Remote()

    with pytest.raises(Remote):  # the same error everywhere: the cell's own mistake, raised as it is
        watch(cluster, {4: Result(Remote())}, mistake, None, settle=0.5)
    assert watch(cluster, {4: Result(value=7), 5: Result(value=8)}, lambda: 9, None) == ({4: 7, 5: 8}, 9)

    class Died(Exception):  # ipyparallel's EngineError, as a finished task's result says it
        ename, evalue = "EngineError", "Engine 5 died while running task 'abc'"

    stuck.clear()
    with pytest.raises(mcjax_error()) as error:  # at once, not after the settle time: the engine is gone
        watch(cluster, {4: Result(value=1), 5: Result(Died())}, stuck.wait, None, settle=60)
    assert "engine 5 is gone" in str(error.value) and "reset_engines" in str(error.value), str(error.value)
    stuck.set()


def mcjax_error() -> type:
    from dsr1.workbench import ClusterError

    return ClusterError


def test_engine_calls_skip_an_engine_that_unregisters_meanwhile():
    """A killed engine leaves `client.ids` when the hub notices, possibly between reading the ids and
    a call on them (ipyparallel raises KeyError for its id): the call goes to the engines left."""
    from dsr1.workbench.recovery import on_live_engines

    class Client:
        ids = [0, 1, 2]

        def spin(self):
            pass

    client, calls = Client(), []

    def call(targets):
        calls.append(targets)
        if 0 in targets:
            client.ids = [1, 2]  # engine 0 unregistered just now
            raise KeyError(0)

    on_live_engines(client, call, [0, 1, 2])
    assert calls == [[0, 1, 2], [1, 2]]
    on_live_engines(client, call, [0])  # none left: nothing to call
    assert len(calls) == 2


@pytest.mark.slow
def test_gloo_connection_lines_are_dropped_from_native_stdout():
    code = ("import os, sys\nfrom dsr1.workbench.native_output import drop_native_stdout_lines\n"
            "drop_native_stdout_lines()\n"
            "os.write(1, b'kept 1\\n[Gloo] Rank 0 is connected to 1 peer ranks. Expected number\\nkept 2\\n')\n"
            "os.write(1, b'[Gloo] Rank 1 is conn')\nos.write(1, b'ected to 1 peer ranks\\npart')\n"
            "os.write(1, b'ial line\\n')\nprint('printed at the end', flush=True)\n")
    done = run([sys.executable, "-c", code], env=clean_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout == "kept 1\nkept 2\npartial line\nprinted at the end\n"  # nothing lost at exit


def test_storage_reports_the_mount_and_free_space(tmp_path):
    from dsr1.workbench.process import storage

    here, gone = storage([str(tmp_path), str(tmp_path / "missing")])
    assert here["exists"] and here["free_bytes"] > 0 and here["fstype"] not in ("", "?")
    assert str(tmp_path).startswith(here["mount"])
    assert not gone["exists"] and gone["free_bytes"] is None


def test_health_check_flags_mismatches():
    from dsr1.workbench.health import find_problems

    base = dict(hostname="h", environment="/venv (/usr/bin/python3.11)", python="3.11.7", dsr1="0.1.0", jax="0.10.2",
                jaxlib="0.10.2", provider="gcloud", distributed=True, process_count=3, local_devices=4)
    procs = [dict(base, role="engine 0", hostname="h1", PROCESS_ID=0, process_index=0),
             dict(base, role="engine 1", hostname="h2", PROCESS_ID=1, process_index=1, jax="0.9.0", local_devices=8),
             dict(base, role="kernel", hostname="h0", PROCESS_ID=2, process_index=2,
                  environment="/usr (/usr/bin/python3.11)")]
    problems = "\n".join(find_problems(procs))
    assert "different jax version: 0.10.2 on engine 0, kernel; 0.9.0 on engine 1" in problems
    assert "different Python environment" in problems and "/usr (/usr/bin/python3.11) on kernel" in problems
    assert "different device counts per process" in problems
    assert find_problems([dict(base, role=f"engine {i}", hostname=f"h{i}", PROCESS_ID=i, process_index=i)
                      for i in range(3)]) == []
    same_host = find_problems([dict(base, role=f"engine {i}", PROCESS_ID=i, process_index=i) for i in range(3)])
    assert same_host == ["engine 0, engine 1, engine 2 run on the same host h: one engine per host expected"]
    clones = [dict(base, role=f"engine {i}", PROCESS_ID=i, process_index=i, host_key=f"boot-{i} net:[1]")
              for i in range(3)]  # hosts cloned from one image: one hostname, three machines
    assert find_problems(clones) == []
    clones[2]["host_key"] = clones[1]["host_key"]
    assert find_problems(clones) == ["engine 1, engine 2 run on the same host h: one engine per host expected"]


def test_jax_still_has_the_private_names_the_workbench_relies_on():
    """dsr1.workbench.jax_internals is the one adapter to jax._src: a JAX upgrade that moves what
    it uses fails here, by name, instead of hanging a notebook's clear_hung_initialize."""
    import jax

    try:
        from dsr1.workbench import jax_internals
    except ImportError as e:
        pytest.fail(f"jax {jax.__version__} moved a private module dsr1.workbench.jax_internals imports ({e}): "
                    f"update that adapter (and only it)")
    gone = jax_internals.missing()
    assert not gone, (f"jax {jax.__version__} no longer has {', '.join(gone)}, which "
                      f"dsr1.workbench.jax_internals relies on: update that adapter (and only it)")
    jax.devices()  # starts the backends (this pytest process computes anyway)
    assert jax_internals.backends_are_initialized()
    assert not jax_internals.has_distributed_state()
    jax_internals.abandon_distributed_state(stop_service=True)  # nothing to forget: a no-op
    assert not jax_internals.has_distributed_state() and not jax.distributed.is_initialized()


def test_only_the_adapter_reaches_into_jax_private_modules():
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "dsr1").rglob("*.py"))
                 if "jax._src" in p.read_text() and p.name != "jax_internals.py"]
    assert offenders == [], f"use dsr1.workbench.jax_internals instead of jax._src in {offenders}"


def test_a_second_kernel_is_refused_while_the_first_holds_the_cluster(tmp_path):
    """connect() in a second kernel (another notebook on host 0) while the first still runs: refused
    before it touches the controller or the engines, naming the first kernel, whose record stays; once
    the first is gone (or with take_over=True) the cluster is this kernel's."""
    import dsr1.workbench as mcjax
    from dsr1.workbench import ownership

    state = tmp_path / "state"
    first = subprocess.Popen(["sleep", "60"])
    try:
        held = {"pid": first.pid, "hostname": socket.gethostname(), "started": ownership._start_ticks(first.pid),
                "connection_file": "/run/user/1/jupyter/kernel-first.json", "notebook": "cluster_check.ipynb"}
        state.mkdir()
        (state / "kernel.json").write_text(json.dumps(held))
        with pytest.raises(mcjax.ClusterError) as refused:
            mcjax.connect(state=state, namespace={})
        message = str(refused.value)
        assert f"pid {first.pid} on {socket.gethostname()}" in message, message
        assert "notebook cluster_check.ipynb" in message and "kernel-first.json" in message, message
        assert json.loads((state / "kernel.json").read_text()) == held  # the first kernel's record stays
        assert ownership.claim(state, take_over=True)["pid"] == os.getpid()
        (state / "kernel.json").write_text(json.dumps(held))
    finally:
        first.kill()
        first.wait()
    assert not ownership.alive(held)  # gone (a later process with its pid would have another start time)
    assert ownership.claim(state)["pid"] == os.getpid()
    assert ownership.claim(state)["pid"] == os.getpid()  # connecting again in the same kernel
    assert json.loads((state / "kernel.json").read_text())["pid"] == os.getpid()


def test_an_engine_works_in_the_kernels_folder_where_its_host_has_it(tmp_path, monkeypatch):
    """prepare_process(cwd=the kernel's folder): an engine moves there when its host has that folder
    (the notebook's, on the shared folder) and stays where it is otherwise."""
    from dsr1.workbench.process import prepare_process

    monkeypatch.chdir(tmp_path)
    notebooks = tmp_path / "shared" / "notebooks"
    notebooks.mkdir(parents=True)
    prepare_process(0, 2, None, namespace={}, cwd=str(tmp_path / "not on this host"))
    assert Path.cwd() == tmp_path
    prepare_process(0, 2, None, namespace={}, cwd=str(notebooks))
    assert Path.cwd() == notebooks


def test_probe_describes_this_process():
    import dsr1.workbench as mcjax

    info = mcjax.probe("127.0.0.1", devices=True, namespace={"PROCESS_ID": 2, "NUM_PROCESSES": 3})
    assert (info["pid"], info["PROCESS_ID"], info["NUM_PROCESSES"]) == (os.getpid(), 2, 3)
    assert info["address"] == "127.0.0.1" and info["environment"].startswith(sys.prefix)
    assert info["dsr1"] == __import__("dsr1").__version__ and not info["jax"].startswith("missing")
    assert info["distributed"] is False  # this pytest process never initializes jax.distributed
    assert set(mcjax.probe("127.0.0.1", devices=False, namespace={})) >= {"hostname", "accelerator", "jaxlib"}


@pytest.mark.slow
def test_real_cluster_pieces_on_one_machine(tmp_path):
    """cluster/ipcluster.sh as mcjax_setup.sh runs it on each host (from ~/.mcjax-setup with the
    mcjax.env of --print-env), here with this machine playing host 0 and two engine hosts."""
    pytest.importorskip("ipyparallel")
    import dsr1.workbench as mcjax

    remote = tmp_path / ".mcjax-setup"
    (remote / "cluster").mkdir(parents=True)
    shutil.copy(ROOT / "mcjax_defs.sh", remote)
    for piece in (ROOT / "cluster").glob("*.sh"):
        shutil.copy(piece, remote / "cluster")
    venv_python = tmp_path / "venv" / "bin" / "python"  # stands for each host's venv
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    venv_python.chmod(0o755)
    cluster_id = f"real-{uuid.uuid4().hex[:6]}"
    settings = clean_env(MCJAX_PROVIDER="ssh", MCJAX_HOST_LIST="127.0.0.1 127.0.0.1 127.0.0.1",
                         MCJAX_CLUSTER_ID=cluster_id, MCJAX_NFS_DIR=str(tmp_path / "nfs"),
                         MCJAX_VENV=str(tmp_path / "venv"), MCJAX_STOP_TIMEOUT="5")
    printed = run([ROOT / "mcjax_setup.sh", "--print-env"], env=settings)
    assert printed.returncode == 0, printed.stderr
    (remote / "mcjax.env").write_text(printed.stdout)

    def host(i: int, *args: str) -> subprocess.CompletedProcess:  # what cluster_exec runs there
        env = clean_env(MCJAX_HOST_INDEX=str(i), MCJAX_STATE=str(tmp_path / f"state{i}"), HOME=str(tmp_path))
        done = subprocess.run(["bash", remote / "cluster" / "ipcluster.sh", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    try:
        host(0, "controller", "start")  # the IP: host 0's, from MCJAX_INTERNAL_IPS in mcjax.env
        host(1, "engine", "start")
        host(2, "engine", "start")
        host(0, "wait", "2")
        assert "keeping it" in host(0, "controller", "start").stdout  # idempotent
        assert "keeping it" in host(1, "engine", "start").stdout
        profile = tmp_path / "nfs" / ".mcjax" / "profile_mcjax"  # on the shared folder: the engines read it
        info = json.loads((tmp_path / "state0" / "cluster.json").read_text())
        assert info["profile_dir"] == str(profile) and info["provider"] == "ssh" and info["engines"] == 2
        assert json.loads((profile / "security" / f"ipcontroller-{cluster_id}-engine.json").read_text())[
            "interface"] == "tcp://127.0.0.1"
        cluster = mcjax.connect_controller(state=tmp_path / "state0", cluster_id=cluster_id, timeout=30)
        try:
            layout = mcjax.assign_process_ids(cluster, namespace={})
            assert [(e.host_index, e.process_id) for e in layout.engines] == [(1, 0), (2, 1)]
        finally:
            cluster.close()
    finally:
        pids = [int(p.read_text()) for p in tmp_path.glob("state*/pids/*.pid")]
        for i in (1, 2):
            host(i, "engine", "stop")
        host(0, "controller", "stop")
    assert len(pids) == 3 and not [p for p in pids if alive(p)]


# ----------------------------------------------------------------------------- the local cluster

@dataclasses.dataclass
class LocalCluster:
    state: Path
    cluster_id: str
    env: dict[str, str]
    first_start: str
    seen: set[int] = dataclasses.field(default_factory=set)  # every pid of ours, for the cleanup

    def pids(self) -> dict[str, int]:
        """The pid files' pids, by name (controller, engine-1, ...)."""
        found = {p.stem: int(p.read_text().split()[0]) for p in (self.state / "pids").glob("*.pid")}
        self.seen.update(found.values())
        return found

    def setup(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return run([ROOT / "mcjax_setup.sh", *args], env=self.env, timeout=timeout)

    def kernel(self, mode: str, *args: object, timeout: float = 240) -> dict:
        """Run KERNEL as the notebook kernel: JAX process N-1 with DEVICES fake CPU devices."""
        script = self.state / "kernel.py"
        script.write_text(KERNEL)
        env = dict(self.env, XLA_FLAGS=xla_flags(DEVICES), JAX_PLATFORMS="cpu",
                   MCJAX_PROVIDER="local")
        done = run([sys.executable, script, mode, *args], env=env, timeout=timeout)
        out = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and out, f"kernel ({mode}) failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return json.loads(out[-1][len("RESULT "):])


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def family(pids) -> set[int]:
    """The pids and their live descendants (controller schedulers, engine nannies)."""
    import psutil

    out = set()
    for pid in pids:
        try:
            out |= {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    pytest.importorskip("ipyparallel")
    pytest.importorskip("psutil")
    import psutil

    state = tmp_path_factory.mktemp("mcjax")
    cluster_id = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    env = clean_env(MCJAX_STATE=str(state), MCJAX_CLUSTER_ID=cluster_id, MCJAX_PYTHON=sys.executable,
                    MCJAX_LOCAL_DEVICES=str(DEVICES), MCJAX_START_TIMEOUT="90", MCJAX_STOP_TIMEOUT="5")
    cluster = LocalCluster(state, cluster_id, env, first_start="")
    try:
        done = cluster.setup("--local", str(N))
        cluster.first_start = done.stdout + done.stderr
        assert done.returncode == 0, cluster.first_start
        cluster.pids()
        yield cluster
    finally:
        cluster.seen |= family(cluster.pids().values())
        cluster.setup("--stop", timeout=120)
        # Last resort, for processes of ours the stop missed: only pids we saw, still ours by command line.
        for pid in cluster.seen:
            try:
                proc = psutil.Process(pid)
                if cluster_id in " ".join(proc.cmdline()) or "ipyparallel.engine.nanny" in " ".join(proc.cmdline()):
                    proc.kill()
            except psutil.Error:
                pass


@pytest.mark.slow
def test_local_setup_starts_engines_and_a_second_run_is_clean(local_cluster):
    import dsr1.workbench as mcjax

    pids = local_cluster.pids()
    assert sorted(pids) == ["controller", "engine-1", "engine-2"]
    assert all(alive(p) for p in pids.values())
    cluster = mcjax.connect_controller(state=local_cluster.state, timeout=30)
    try:
        assert cluster.controller_ip == "127.0.0.1" and cluster.info["provider"] == "local"
        assert len(mcjax.wait_for_engines(cluster, N - 1, timeout=60)) == N - 1
        again = local_cluster.setup("--local", str(N))
        assert again.returncode == 0, again.stdout + again.stderr
        assert "reusing it" in again.stdout
        assert local_cluster.pids() == pids  # nothing restarted, nothing duplicated
        assert sorted(cluster.client.ids) == sorted(mcjax.wait_for_engines(cluster, N - 1, timeout=10))
        assert len(cluster.client.ids) == N - 1
        with pytest.raises(mcjax.ClusterError, match=r"only 2 of 3 engines came up within 1s"):
            mcjax.wait_for_engines(cluster, N, timeout=1)
    finally:
        cluster.close()


@pytest.mark.slow
def test_local_controller_listens_on_localhost_only(local_cluster):
    import psutil

    security = local_cluster.state / "profile_mcjax" / "security"
    files = sorted(security.glob(f"ipcontroller-{local_cluster.cluster_id}-*.json"))
    assert [f.name.rsplit("-", 1)[1] for f in files] == ["client.json", "engine.json"]
    assert security.stat().st_mode & 0o777 == 0o700
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o600, f
        assert json.loads(f.read_text())["interface"] == "tcp://127.0.0.1"
    pids = local_cluster.pids()
    listening = [c.laddr for pid in family(pids.values()) for c in psutil.Process(pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "the controller listens on no port?"
    assert {a.ip for a in listening} == {"127.0.0.1"}, listening


@pytest.mark.slow
def test_px_local_initializes_jax_distributed_across_processes(local_cluster):
    """The notebook's %%px --local cell, run by an IPython shell in the kernel process."""
    out = local_cluster.kernel("px-local", free_port())
    assert out["layout"]["num_processes"] == N and out["layout"]["kernel_process_id"] == N - 1
    assert [e["process_id"] for e in out["layout"]["engines"]] == [0, 1]
    assert [e["host_index"] for e in out["layout"]["engines"]] == [1, 2]
    results = out["results"]
    assert sorted(r["index"] for r in results) == list(range(N))
    total = float(sum(range(1, 4 * N * DEVICES + 1)))
    for r in results:
        # cwd: the engines work in the kernel's folder (the notebook's), not the scripts' run folder.
        assert r == dict(index=r["index"], count=N, devices=N * DEVICES, local=DEVICES, total=total,
                         gathered=list(range(N)), cwd=str(ROOT)), r
    assert out["problems"] == [] and len(out["health"]) == N
    assert {p["local_devices"] for p in out["health"]} == {DEVICES}
    assert sorted(p["PROCESS_ID"] for p in out["health"]) == list(range(N))  # read from each user namespace
    # jax's coordinator, gloo and ipyparallel: every listening socket of every process on loopback.
    assert out["listen"] and {ip.removeprefix("::ffff:") for ip in out["listen"]} == {"127.0.0.1"}, out["listen"]


@pytest.mark.slow
def test_killed_engine_gives_a_clear_error_and_cluster_restart_brings_it_back(local_cluster):
    import dsr1.workbench as mcjax

    cluster = mcjax.connect_controller(state=local_cluster.state, timeout=30)
    client = cluster.client
    try:
        layout = mcjax.assign_process_ids(cluster, namespace={})
        assert cluster.layout == layout
        victim = layout.engines[-1]
        client[layout.engine_ids].execute("import time; time.sleep(30)", block=False)  # in use
        time.sleep(0.5)
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(mcjax.ClusterError) as error:
            mcjax.px(cluster, "x = 1", timeout=60)
        assert time.monotonic() - start < 15
        message = str(error.value)
        assert f"engine {victim.engine_id} (process {victim.process_id}" in message and f"pid {victim.pid}" in message
        assert "cluster_restart" in message

        old = set(client.ids) | {victim.engine_id}
        restart = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_restart"],
                      env=dict(local_cluster.env, MCJAX_PROVIDER="local"))
        assert restart.returncode == 0, restart.stdout + restart.stderr
        pids = local_cluster.pids()
        engines = {k: v for k, v in pids.items() if k.startswith("engine-")}
        assert len(engines) == N - 1 and all(alive(p) for p in engines.values())
        assert victim.pid not in engines.values()
        deadline = time.monotonic() + 60
        while len(set(client.ids) - old) < N - 1 or set(client.ids) & old:
            assert time.monotonic() < deadline, f"engines after the restart: {client.ids}"
            time.sleep(0.2)
        layout = mcjax.assign_process_ids(cluster, namespace={})
        mcjax.px(cluster, "x = 40 + PROCESS_ID", timeout=60)
        assert client[layout.engine_ids].pull("x", block=True) == [40, 41]
    finally:
        cluster.close()


@pytest.mark.slow
def test_hung_initialize_is_cleared_then_initialize_everywhere_works(local_cluster):
    import dsr1.workbench as mcjax

    cluster = mcjax.connect_controller(state=local_cluster.state, timeout=30)
    try:
        before = local_cluster.pids()
        new = mcjax.reset_engines(cluster, timeout=120, namespace={})  # fresh engines: JAX not started yet
        assert sorted(cluster.layout.engine_ids) == sorted(new)  # numbered again, with a new port
        assert len(new) == N - 1
        after = local_cluster.pids()
        assert all(alive(after[f"engine-{i}"]) and after[f"engine-{i}"] != before[f"engine-{i}"] for i in (1, 2))
        assert after["controller"] == before["controller"]
    finally:
        cluster.close()
    out = local_cluster.kernel("recover", free_port(), free_port())
    assert "did not complete within 4s" in out["hung"] and "clear_hung_initialize" in out["hung"]
    assert out["cleared"] == {"kernel": "nothing to reset", "engine " + str(new[0]): "reset a pending initialize",
                              "engine " + str(new[1]): "reset a pending initialize"}
    total = float(sum(range(1, 4 * N * DEVICES + 1)))
    assert [r["total"] for r in out["results"]] == [total] * N
    assert sorted(r["index"] for r in out["results"]) == list(range(N))
    assert out["problems"] == []


@pytest.mark.slow
def test_stop_leaves_no_process_of_the_cluster(local_cluster):
    pids = local_cluster.pids()
    everything = family(pids.values())  # with the controller's schedulers and the engines' nannies
    assert len(everything) > len(pids)
    done = local_cluster.setup("--stop", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 10
    while any(alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in everything if alive(p)]
    assert not list((local_cluster.state / "pids").glob("*.pid"))
    assert not (local_cluster.state / "cluster.json").exists()
    again = local_cluster.setup("--stop")
    assert again.returncode == 0, again.stderr


# The notebook kernel (process N-1), run in a subprocess: `python kernel.py MODE PORT...`.
KERNEL = r'''
import json, os, sys
import psutil
import dsr1.workbench as mcjax

ALLREDUCE = """
import os, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils
mesh = Mesh(np.array(jax.devices()), ("d",))
n = 4 * jax.device_count()
x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("d")), lambda i: np.arange(1, n + 1, dtype=np.float32)[i])
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
gathered = multihost_utils.process_allgather(jnp.array([PROCESS_ID]))
RESULT = dict(index=jax.process_index(), count=jax.process_count(), devices=jax.device_count(),
              local=jax.local_device_count(), total=float(total), gathered=np.asarray(gathered).ravel().tolist(),
              cwd=os.getcwd())
"""

mode, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
out = {}
cluster = mcjax.connect_controller(timeout=30)
client = cluster.client
mcjax.wait_for_engines(cluster, 2, timeout=60)
if mode == "px-local":
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    layout = mcjax.assign_process_ids(cluster, port=ports[0])
    client.activate()  # %px magics on a blocking view
    shell.run_cell("%%px --local\nimport dsr1.workbench as mcjax\n"
                   "mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR, timeout=60)\n").raise_error()
    shell.run_cell("%%px --local\n" + ALLREDUCE).raise_error()
    mine = shell.user_ns["RESULT"]
    out["listen"] = [c.laddr.ip for pid in [e.pid for e in layout.engines] + [os.getpid()]
                     for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                     for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
else:  # recover: the engines initialize without the kernel (a hang), clear it, initialize_everywhere
    layout = mcjax.assign_process_ids(cluster, port=ports[0])
    try:
        mcjax.px(cluster, "import dsr1.workbench as mcjax\n"
                 "mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR, timeout=4)", timeout=60)
        out["hung"] = "no error"
    except Exception as e:
        out["hung"] = str(e)
    out["cleared"] = mcjax.clear_hung_initialize(cluster)
    layout = mcjax.initialize_everywhere(cluster, port=ports[1], timeout=60)
    mcjax.px(cluster, ALLREDUCE, local=True, timeout=120)
    mine = RESULT
report = mcjax.health_check(cluster)
out.update(results=client[layout.engine_ids].pull("RESULT", block=True) + [mine], layout=layout.__dict__ | {
    "engines": [e.__dict__ for e in layout.engines]}, problems=report.problems, health=report.processes)
mcjax.shutdown_everywhere(cluster)
cluster.close()
print("RESULT " + json.dumps(out, default=str), flush=True)
'''


# ----------------------------------------------------------------------------- the one port range

def test_the_port_range_gives_free_ports_of_its_own_and_probes_reach_them(monkeypatch):
    from dsr1.workbench import ports
    from dsr1.workbench.process import ClusterError

    monkeypatch.delenv("MCJAX_PROVIDER", raising=False)
    assert ports.port_range("") == ports.DEFAULT_PORTS == (8476, 8575)
    with pytest.raises(ClusterError, match="MCJAX_PORTS='8476:8575'"):
        ports.port_range("8476:8575")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        s.listen()
        monkeypatch.setenv("MCJAX_PORTS", f"{taken}-{taken + 40}")
        assert ports.free_port("127.0.0.1") > taken  # the taken one is passed over
        assert ports.free_port("127.0.0.1", highest=True) <= taken + 40
        probe = ports.open_probe("127.0.0.1", seconds=5)
        assert taken < probe <= taken + 40 and ports.reaches("127.0.0.1", probe) is None
        monkeypatch.setenv("MCJAX_PORTS", f"{taken}-{taken}")
        with pytest.raises(ClusterError, match=f"range {taken}-{taken}"):
            ports.open_probe("127.0.0.1")
    assert ports.reaches("127.0.0.1", taken, timeout=1) is not None  # closed now


def test_the_serving_control_channel_listens_on_the_cluster_address_in_the_range(monkeypatch):
    from dsr1.serving import control

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        low = s.getsockname()[1]
        s.listen()
        monkeypatch.setenv("DSR1_CONTROL_HOST", "127.0.0.1")
        monkeypatch.setenv("DSR1_CONTROL_PORTS", f"{low}-{low + 20}")
        with control._listen(4) as server:
            host, port = server.getsockname()[:2]
    assert host == "127.0.0.1" and low < port <= low + 20
    monkeypatch.setenv("DSR1_CONTROL_PORTS", "many")
    with pytest.raises(ValueError, match="DSR1_CONTROL_PORTS='many'"):
        control.control_ports()


class _HereClient:
    """ipyparallel's client as far as the port probe uses it: every engine runs here, at once."""

    class _View:
        def apply_async(self, f, *args):
            result = f(*args)
            return type("Done", (), {"get": lambda self, timeout=None: result})()

    def __getitem__(self, engine_id):
        return self._View()


def test_check_probes_the_range_from_every_host_to_host_0_and_back(monkeypatch):
    from dsr1.workbench import ports, smoke

    monkeypatch.delenv("MCJAX_PROVIDER", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        low = s.getsockname()[1]
    monkeypatch.setenv("MCJAX_PORTS", f"{low}-{low + 30}")
    engines = {0: {"hostname": "h1", "host_index": "1", "pid": 1, "address": "127.0.0.1"},
               1: {"hostname": "h2", "host_index": "2", "pid": 2, "address": "127.0.0.1"}}
    lines, failures = smoke._reachability(_HereClient(), engines, "127.0.0.1", timeout=10)
    assert failures == [] and lines[0].startswith(f"ports {low}-{low + 30} (MCJAX_PORTS)") and lines[0].endswith(": ok")
    # A host whose ports host 0 cannot reach (a firewall): named, with the port.
    monkeypatch.setattr(ports, "open_probe", lambda address, highest=False, seconds=60.0: low + 30 if highest else low)
    monkeypatch.setattr(ports, "reaches", lambda address, port, timeout=5.0: None if port != low + 30
                        else f"{address}:{port}: timed out")
    lines, failures = smoke._reachability(_HereClient(), engines, "127.0.0.1", timeout=10)
    assert "BLOCKED" in lines[0] and len(failures) == 4, lines
    assert failures[:2] == [f"host 1 (h1, engine 0, pid 1): cannot reach host 0 at 127.0.0.1:{low + 30}: timed out",
                            f"host 1 (h1, engine 0, pid 1): host 0 cannot reach it at 127.0.0.1:{low + 30}: timed out"]


def test_every_process_gets_the_range_and_its_host_s_cluster_address(tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"], "MCJAX_PROVIDER": "ssh", "MCJAX_STATE": str(tmp_path),
           "MCJAX_HOST_INDEX": "2", "MCJAX_INTERNAL_IPS": "10.0.0.10 10.0.0.11 10.0.0.12", "MCJAX_JAX_CACHE": "off",
           "MCJAX_PORTS": "20000-20099", "MCJAX_VENV": str(Path(sys.executable).parent.parent)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 20090))  # the top of the range is taken: the controller's 32 end below it
        script = ". cluster/common.sh && mcjax_process_env && mcjax_controller_ports 127.0.0.1"
        done = subprocess.run(["bash", "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert {"MCJAX_PORTS=20000-20099", "DSR1_CONTROL_PORTS=20000-20099", "DSR1_CONTROL_HOST=10.0.0.12"} <= set(lines)
    assert lines[-1] == "20058-20089", lines
