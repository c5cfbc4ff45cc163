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
import re
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


# ----------------------------------------------------------------------------- the smoke check

LOCK = """# This file was autogenerated by uv via the following command:
#    uv pip compile pyproject.toml cluster/locks/cpu.in --extra notebook --generate-hashes --python-version 3.12
jax==0.10.2 \\
    --hash=sha256:aaaa
    # via -r cluster/locks/cpu.in
jaxlib==0.10.2 ; sys_platform == 'linux' \\
    --hash=sha256:bbbb
ml-dtypes==0.5.3 \\
    --hash=sha256:cccc
"""


def _report(**over):
    base = dict(hostname="h", host_index="0", pid=1, python="3.12.11", cwd="/run", jax="0.10.2", jaxlib="0.10.2",
                dsr1="0.1.0", dsr1_file="/x/dsr1/__init__.py", dsr1_api=True)
    return dict(base, **over)


def test_the_lock_pins_and_the_problems_name_the_host(tmp_path):
    from dsr1.workbench import smoke

    lock = tmp_path / "cpu.txt"
    lock.write_text(LOCK)
    pins = smoke.read_lock(lock)
    assert pins == {"python": "3.12", "jax": "0.10.2", "jaxlib": "0.10.2", "ml-dtypes": "0.5.3"}
    found = smoke.problems({"host 0": _report(), "host 1": _report(jax="0.9.0"),
                            "host 2": _report(python="3.11.7", dsr1=None, dsr1_api=False,
                                              dsr1_file="namespace package ['/mnt/mcjax/dsr1']")}, pins)
    assert found["host 0"] == []
    assert found["host 1"] == ["jax 0.9.0, the lock pins 0.10.2"]
    assert found["host 2"][0].startswith("dsr1 is not the installed package (namespace package ['/mnt/mcjax/dsr1']")
    assert found["host 2"][1] == "Python 3.11.7, the lock's is 3.12"
    # without a lock: host 0 (the first report) is the reference
    assert smoke.problems({"host 0": _report(), "host 1": _report(jaxlib="0.10.1")}, None)["host 1"] == [
        "jaxlib 0.10.1, host 0 has 0.10.2"]
    bad = tmp_path / "bad.txt"
    bad.write_text("numpy==2.0\n")
    with pytest.raises(ValueError, match="no pinned jax"):
        smoke.read_lock(bad)


def _local_env(tmp_path: Path, cluster_id: str, python: str = sys.executable, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_", "PYTHONPATH"))}
    env.update(MCJAX_STATE=str(tmp_path / "state"), MCJAX_PYTHON=python, MCJAX_CLUSTER_ID=cluster_id,
               MCJAX_START_TIMEOUT="120", **extra)
    return env


def _setup(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "mcjax_setup.sh"), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_smoke_check_passes_then_names_the_host_whose_jax_differs(tmp_path):
    """A kernel-last simulated cluster passes --check (every engine imports the installed dsr1, the
    same versions, one psum of the right value across the 3 processes). Then the engine of host 2
    is restarted in an environment that holds another jax distribution: --check fails naming it."""
    pytest.importorskip("ipyparallel")
    other = tmp_path / "other-jax"
    (other / "jax-0.0.1.dist-info").mkdir(parents=True)
    (other / "jax-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: jax\nVersion: 0.0.1\n")
    flag = tmp_path / "host-2-has-other-jax"
    python = tmp_path / "python"  # host 2's Python sees the other jax once the flag exists
    python.write_text(f'#!/bin/sh\nif [ "$MCJAX_HOST_INDEX" = 2 ] && [ -e "{flag}" ]; then '
                      f'export PYTHONPATH="{other}"; fi\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    cluster_id = f"smoke-{os.getpid()}"
    env = _local_env(tmp_path, cluster_id, str(python))
    state = tmp_path / "state"
    try:
        done = _setup(env, "--local", "3")
        assert done.returncode == 0, done.stdout + done.stderr
        check = _setup(env, "--check")
        assert check.returncode == 0, check.stdout + check.stderr
        out = check.stdout
        assert "smoke check: ok" in out and "kernel-last numbering" in out
        for host in (1, 2):
            assert re.search(rf"^host {host} \(.*engine \d+.*\): Python .* dsr1 0\.1\.0 from .*dsr1/__init__\.py: ok$",
                             out, re.M), out
        # 3 processes x 2 devices, each adding its process index + 1: 2 * (1 + 2 + 3)
        assert len(re.findall(r"psum = 12 \(expected 12, 6 cpu devices\): ok", out)) == 3, out

        flag.touch()
        restart = subprocess.run(["bash", str(ROOT / "cluster" / "local.sh"), "restart", "engines"], env=env,
                                 capture_output=True, text=True, timeout=300)
        assert restart.returncode == 0, restart.stdout + restart.stderr
        bad = _setup(env, "--check")
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert re.search(r"^host 2 \(.*\): .*jax 0\.0\.1.*: MISMATCH$", bad.stdout, re.M), bad.stdout
        assert re.search(r"^  - host 2 \(.*\): jax 0\.0\.1, host 0 has \S+$", bad.stdout, re.M), bad.stdout
        assert re.search(r"^host 1 \(.*: ok$", bad.stdout, re.M) and "collective: not run" in bad.stdout
    finally:
        _setup(env, "--stop", timeout=120)
        _kill_leftovers(state, cluster_id)


@pytest.mark.extended
@pytest.mark.slow
def test_smoke_check_passes_under_platform_numbering(tmp_path):
    pytest.importorskip("ipyparallel")
    cluster_id = f"smokep-{os.getpid()}"
    env = _local_env(tmp_path, cluster_id)
    try:
        done = _setup(env, "--local", "3", "--numbering", "platform")
        assert done.returncode == 0, done.stdout + done.stderr
        check = _setup(env, "--check")
        assert check.returncode == 0, check.stdout + check.stderr
        assert "platform numbering" in check.stdout and "smoke check: ok" in check.stdout
        # this process (host 0) is process 0, the engine of host i process i
        assert re.search(r"^  host 0 \(.*this process.*\): process 0: psum = 12 ", check.stdout, re.M), check.stdout
        assert re.search(r"^  host 2 \(.*engine.*\): process 2: psum = 12 ", check.stdout, re.M), check.stdout
    finally:
        _setup(env, "--stop", timeout=120)
        _kill_leftovers(tmp_path / "state", cluster_id)


# ----------------------------------------------------------------------------- the lock

def test_the_locks_pin_one_jax_for_every_platform_and_the_hosts_python():
    from dsr1.workbench import smoke

    host_python = re.search(r'MCJAX_HOST_PYTHON:=([0-9.]+)', (ROOT / "mcjax_defs.sh").read_text()).group(1)
    pins = {p: smoke.read_lock(ROOT / "cluster" / "locks" / f"{p}.txt") for p in ("cpu", "tpu", "cuda12")}
    assert len({(v["jax"], v["jaxlib"]) for v in pins.values()}) == 1, pins
    assert {v["python"] for v in pins.values()} == {host_python}
    assert "libtpu" in pins["tpu"] and "jax-cuda12-plugin" in pins["cuda12"] and "ipyparallel" in pins["cpu"]
    for p in ("cpu", "tpu", "cuda12"):  # every requirement carries its hashes
        text = (ROOT / "cluster" / "locks" / f"{p}.txt").read_text()
        assert text.count("--hash=sha256:") >= len(pins[p]) - 1


@pytest.mark.slow
def test_venv_syncs_to_the_lock_and_check_names_what_differs(tmp_path):
    """venv.sh deps installs with `uv pip sync --require-hashes LOCK` (a venv with other versions is
    brought to the lock), and venv.sh check fails on what a sync would still change."""
    log = tmp_path / "uv.log"
    uv_dir = tmp_path / "uv"
    (uv_dir / "0.13.9").mkdir(parents=True)
    uv = uv_dir / "0.13.9" / "uv"
    uv.write_text(f'#!/bin/sh\necho "$*" >>"{log}"\ncase "$*" in --version) echo "uv 0.13.9";; '
                  f'"python find"*) echo "{sys.executable}";; '
                  '*"--dry-run"*) printf " - dsr1==0.1.0\\n - jax==0.9.0\\n + jax==0.10.2\\n" >&2;; esac\nexit 0\n')
    uv.chmod(0o755)
    venv = _venv(tmp_path)
    repo = tmp_path / "repo"
    (repo / "cluster" / "locks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (repo / "cluster" / "locks" / "cuda12.txt").write_text(LOCK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCJAX_")}
    env.update(MCJAX_PROVIDER="ssh", MCJAX_UV_DIR=str(uv_dir), MCJAX_VENV=str(venv), MCJAX_REPO_DIR=str(repo),
               MCJAX_STATE=str(tmp_path / "state"), MCJAX_HOST_PYTHON=".".join(map(str, sys.version_info[:2])))
    deps = subprocess.run(["bash", str(ROOT / "cluster" / "venv.sh"), "deps"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert deps.returncode == 0, deps.stdout + deps.stderr
    lock = repo / "cluster" / "locks" / "cuda12.txt"
    assert f"pip sync --quiet --require-hashes --python {venv}/bin/python {lock}" in log.read_text().splitlines()
    check = subprocess.run(["bash", str(ROOT / "cluster" / "venv.sh"), "check"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 1 and f"differs from the lock {lock}" in check.stderr, check.stdout + check.stderr
    assert " + jax==0.10.2" in check.stderr and "dsr1" not in check.stderr.split("lock")[-1]
    off = subprocess.run(["bash", str(ROOT / "cluster" / "venv.sh"), "deps"], env=dict(env, MCJAX_LOCK="off"),
                         capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and "pip install --quiet" in log.read_text().splitlines()[-1], off.stderr


def test_a_venv_of_another_patch_release_is_made_anew(tmp_path):
    """The venv is reused only when its Python is the very CPython uv installed for
    MCJAX_HOST_PYTHON (3.12.9), not any 3.12: a 3.12.4 venv is made anew with that interpreter."""
    log, uv_dir = tmp_path / "uv.log", tmp_path / "uv"
    (uv_dir / "0.13.9").mkdir(parents=True)

    def fake_python(path: Path, version: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\necho {version}\n")
        path.chmod(0o755)
        return path

    managed = fake_python(tmp_path / "managed" / "bin" / "python3.12", "3.12.9")
    uv = uv_dir / "0.13.9" / "uv"
    uv.write_text(f'#!/bin/sh\necho "$*" >>"{log}"\ncase "$*" in --version) echo "uv 0.13.9";; '
                  f'"python find"*) echo "{managed}";; esac\nexit 0\n')
    uv.chmod(0o755)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCJAX_")}
    env.update(MCJAX_PROVIDER="ssh", MCJAX_UV_DIR=str(uv_dir), MCJAX_VENV=str(venv), MCJAX_LOCK="off",
               MCJAX_REPO_DIR=str(tmp_path / "repo"), MCJAX_STATE=str(tmp_path / "state"), MCJAX_HOST_PYTHON="3.12",
               MCJAX_HOST_PYTHON_FROM="uv")
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "pyproject.toml").write_text("")

    def deps() -> str:
        done = subprocess.run(["bash", str(ROOT / "cluster" / "venv.sh"), "deps"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    fake_python(venv / "bin" / "python", "3.12.4")
    made = deps()
    assert "creating the venv" in made and "with CPython 3.12.9 (it had 3.12.4)" in made, made
    assert f"venv --clear --seed --python {managed} {venv}" in log.read_text().splitlines()
    fake_python(venv / "bin" / "python", "3.12.9")
    log.write_text("")
    kept = deps()
    assert "reusing the venv" in kept and "venv --clear" not in log.read_text(), kept


# ----------------------------------------------------------------------------- one machine

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_single_records_the_machine_and_starts_jupyter_with_mcjax_single(tmp_path):
    """--single on this CPU machine: no controller or engines; single.env and cluster.json record
    it; Jupyter runs from the run folder with MCJAX_SINGLE=1, safe-path mode and CPU devices; a
    local cluster is refused while it runs; --stop stops it and forgets the record."""
    pytest.importorskip("jupyterlab")
    port = _free_port()
    env = _local_env(tmp_path, f"single-{os.getpid()}", MCJAX_JUPYTER_PORT=str(port), MCJAX_LOCAL_DEVICES="4")
    state = tmp_path / "state"
    dry = _setup(dict(env, MCJAX_DRY_RUN="1"), "--single")
    assert dry.stdout == f"+ bash {ROOT}/cluster/single.sh start\n" and not state.exists()
    try:
        done = _setup(env, "--single", timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        record = dict(line.split("=", 1) for line in (state / "single.env").read_text().splitlines())
        assert record["MCJAX_SINGLE"] == "1" and record["MCJAX_PLATFORM"] == "cpu"
        assert record["MCJAX_JUPYTER_PORT"] == str(port)
        info = json.loads((state / "cluster.json").read_text())
        assert info["single"] is True and info["engines"] == 0 and info["local_devices"] == 4
        assert not list((state / "pids").glob("controller*")) and not list((state / "pids").glob("engine*"))
        pid = int((state / "pids" / "jupyter.pid").read_text())
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                       if "=" in item)
        assert environ["MCJAX_SINGLE"] == "1" and environ["PYTHONSAFEPATH"] == "1"
        assert environ["JAX_PLATFORMS"] == "cpu" and "device_count=4" in environ["XLA_FLAGS"]
        assert os.readlink(f"/proc/{pid}/cwd") == str(state / "run")
        assert _setup(env, "--status").returncode == 0
        local = _setup(env, "--local", "2")
        assert local.returncode == 1 and "single-host workbench" in local.stderr
        stop = _setup(env, "--stop", timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert not (state / "single.env").exists() and not (state / "cluster.json").exists()
        assert _setup(env, "--status").returncode == 1
    finally:
        _kill_leftovers(state, f"--port={port}")


@pytest.mark.slow
def test_single_on_an_accelerator_machine_leaves_the_kernel_its_devices(tmp_path):
    """--single where JAX would use the TPU (libtpu here, chips injected through MCJAX_DEV_DIR):
    Jupyter, and so the kernel, gets neither JAX_PLATFORMS=cpu nor MCJAX_LOCAL_DEVICES' fake CPU
    devices (the kernel would take them in connect())."""
    pytest.importorskip("jupyterlab")
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("no libtpu: JAX here would not take the injected chips for a TPU")
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "accel0").touch()
    port = _free_port()
    env = _local_env(tmp_path, f"single-{os.getpid()}", MCJAX_JUPYTER_PORT=str(port), MCJAX_DEV_DIR=str(dev),
                     MCJAX_LOCAL_DEVICES="4", PYTHONPATH=str(ROOT))
    env.pop("JAX_PLATFORMS", None)
    state = tmp_path / "state"
    try:
        done = _setup(env, "--single", timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "one machine (tpu)" in done.stdout
        pid = int((state / "pids" / "jupyter.pid").read_text())
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                       if "=" in item)
        assert environ["MCJAX_SINGLE"] == "1" and "MCJAX_LOCAL_DEVICES" not in environ
        assert "JAX_PLATFORMS" not in environ and "device_count" not in environ.get("XLA_FLAGS", "")
        assert _setup(env, "--stop", timeout=120).returncode == 0
    finally:
        _kill_leftovers(state, f"--port={port}")


def test_single_with_chips_but_a_cpu_only_jax_is_refused_naming_the_lock(tmp_path, monkeypatch):
    """--single on a machine whose device files show GPUs (injected: MCJAX_DEV_DIR) while its jax
    has no CUDA plugin: refused before Jupyter starts, naming cluster/locks/cuda12.txt; JAX_PLATFORMS=cpu
    is the explicit way to the CPU."""
    import importlib.util

    from dsr1.workbench import process

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    (dev / "nvidia1").touch()
    monkeypatch.setenv("MCJAX_DEV_DIR", str(dev))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    message = process.unused_accelerator("/repo")
    assert message and "has GPU chips (" in message and "pip install -r /repo/cluster/locks/cuda12.txt" in message
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert process.unused_accelerator("/repo") is None
    monkeypatch.undo()
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:
        pytest.skip("this Python has the CUDA plugin: it would use the GPUs")
    env = _local_env(tmp_path, f"single-{os.getpid()}", MCJAX_JUPYTER_PORT=str(_free_port()), MCJAX_DEV_DIR=str(dev),
                     PYTHONPATH=str(ROOT))
    env.pop("JAX_PLATFORMS", None)
    done = _setup(env, "--single", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "has GPU chips" in done.stderr and f"pip install -r {ROOT}/cluster/locks/cuda12.txt" in done.stderr
    assert not (tmp_path / "state" / "pids" / "jupyter.pid").exists()


@pytest.mark.parametrize("plugin,devices,expected", [
    ("libtpu", [], "cpu"), ("libtpu", ["/dev/accel0"], "tpu"), ("libtpu", ["/dev/vfio/0"], "tpu"),
    ("jax_cuda12_plugin", [], "cpu"), ("jax_cuda12_plugin", ["/dev/nvidia0"], "gpu"), (None, ["/dev/accel0"], "cpu")])
def test_a_plugin_without_chips_is_a_cpu_machine(monkeypatch, plugin, devices, expected):
    """libtpu is installed on CPU machines too (to compile for TPUs): the platform needs the chips' device files."""
    import glob
    import importlib.util

    from dsr1.workbench import process

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == plugin else None)
    present = lambda pattern: [d for d in devices if d.startswith(pattern.split("[")[0].rstrip("*"))]  # noqa: E731
    monkeypatch.setattr(glob, "glob", present)
    monkeypatch.setattr(os.path, "exists", lambda path: path in devices)
    assert process.detect_platform() == expected
