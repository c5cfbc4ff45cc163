"""What the scripts do on a host, run here against fakes (no cluster, no root needed): the code
step's receiving end deletes only what the repository dropped, gcsfuse's fstab line is the live
mount's (with nofail), host 0's key is accepted from host 0 only and removed on --stop, a shared
home's other pid files are not reported as stale, a public address is warned about, a shared file
system is checked instead of exported, and the kernel's shell-out to the scripts (reset_engines)
ends in a ClusterError when a host stops answering.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from dsr1.workbench.process import ClusterError
from dsr1.workbench.scripts import run_command, run_scripts

from .test_dry_run import PROVIDERS, ROOT, base_env, calls, commands, fake_tools, remote_words, repo_copy, run


def archive(files: dict[str, str]) -> bytes:
    """A gzipped tar of FILES (path: text) under "./", as the code step makes it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in sorted({str(Path(p).parent) for p in files} - {"."}):
            info = tarfile.TarInfo(f"./{name}")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def receive(tmp_path: Path, target: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", PATH=os.environ["PATH"])
    return subprocess.run(["bash", str(ROOT / "cluster/nfs.sh"), "receive", str(target)], input=archive(files),
                          env=env, capture_output=True, timeout=60)


def test_the_code_copy_loses_what_the_repository_dropped_and_nothing_else(tmp_path):
    target = tmp_path / "shared" / "dsr1 copy"
    first = receive(tmp_path, target, {"README.md": "a", "old/gone.py": "x", "old/kept/also.py": "y",
                                       "dsr1/api.py": "1", "dsr1/old.py": "2"})
    assert first.returncode == 0, first.stderr
    (target / "notebooks").mkdir()
    (target / "notebooks" / "mine.ipynb").write_text("{}")  # made on the cluster
    (target / "old" / "kept" / "results.txt").write_text("r")  # made on the cluster, in a dropped folder
    (target / "dsr1.egg-info").mkdir()  # the editable install's metadata
    second = receive(tmp_path, target, {"README.md": "b", "dsr1/api.py": "3", "dsr1/new.py": "4"})
    assert second.returncode == 0, second.stderr
    left = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    assert left == [".mcjax-manifest", ".mcjax-sums", "README.md", "dsr1", "dsr1.egg-info", "dsr1/api.py",
                    "dsr1/new.py", "notebooks", "notebooks/mine.ipynb", "old", "old/kept", "old/kept/results.txt"], left
    assert (target / "README.md").read_text() == "b"
    assert "deleted 3 that the repository no longer has" in second.stderr.decode() + second.stdout.decode()


def test_setup_again_keeps_notebooks_edited_on_the_cluster(tmp_path):
    """A file the last copy brought and that was edited on the cluster since (a notebook saved in
    Jupyter) is neither overwritten nor deleted by the next copy: the repository's version goes next
    to it (main.repo.ipynb); a file not edited is updated; one deleted on the cluster comes back."""
    target = tmp_path / "dsr1"
    notebook, dropped = target / "notebooks" / "main.ipynb", target / "notebooks" / "old.ipynb"
    first = receive(tmp_path, target, {"notebooks/main.ipynb": "a", "notebooks/old.ipynb": "o", "dsr1/api.py": "1"})
    assert first.returncode == 0, first.stderr
    notebook.write_text("mine")
    dropped.write_text("mine too")
    second = receive(tmp_path, target, {"notebooks/main.ipynb": "b", "dsr1/api.py": "2"})
    assert second.returncode == 0, second.stderr
    assert (notebook.read_text(), (target / "notebooks" / "main.repo.ipynb").read_text()) == ("mine", "b")
    assert dropped.read_text() == "mine too" and (target / "dsr1" / "api.py").read_text() == "2"
    assert "kept notebooks/main.ipynb as edited on the cluster; the repository's version is " \
           "notebooks/main.repo.ipynb" in second.stdout.decode()
    third = receive(tmp_path, target, {"notebooks/main.ipynb": "c", "dsr1/api.py": "2"})
    assert third.returncode == 0, third.stderr
    assert (notebook.read_text(), (target / "notebooks" / "main.repo.ipynb").read_text()) == ("mine", "c")
    assert not list(target.rglob("*.mcjax-edited"))
    notebook.unlink()  # given up on the cluster: the repository's comes back
    assert receive(tmp_path, target, {"notebooks/main.ipynb": "d", "dsr1/api.py": "2"}).returncode == 0
    assert notebook.read_text() == "d"


def test_installing_without_root_or_apt_fails_at_once_saying_why(tmp_path):
    """A user whose sudo asks for a password (or a host without apt-get) is told so before apt's
    retries (ten tries, 10 s apart), and apt-get is never run."""
    bin_dir, log = fake_tools(tmp_path, sudo="exit 1", id='case "$1" in -u) echo 1000;; -un) echo alice;; esac',
                              **{"apt-get": "exit 0"})
    env = base_env(tmp_path, bin_dir, MCJAX_PROVIDER="ssh")
    start = time.monotonic()
    done = run(["bash", "-c", ". cluster/common.sh && mcjax_apt_install nfs-common"], env, ROOT)
    assert done.returncode == 1 and time.monotonic() - start < 5
    assert "installing nfs-common needs root, and sudo asks this user (alice) for a password or refuses" in done.stderr
    assert not [c for c in calls(log) if c.startswith("apt-get")]
    (bin_dir / "apt-get").unlink()
    tools = tmp_path / "tools"  # this host's tools, but apt-get
    tools.mkdir()
    for tool in ("bash", "dirname", "sed", "tr", "awk", "sort", "cat", "mkdir", "grep"):
        (tools / tool).symlink_to(shutil.which(tool))
    no_apt = run([tools / "bash", "-c", ". cluster/common.sh && mcjax_apt_install nfs-common"],
                 dict(env, PATH=f"{bin_dir}{os.pathsep}{tools}"), ROOT)
    assert no_apt.returncode == 1 and "needs apt-get, which this host lacks" in no_apt.stderr, no_apt.stderr


def test_gcsfuse_mounts_as_its_fstab_line_says_and_the_line_has_nofail(tmp_path):
    bin_dir, log = fake_tools(tmp_path, mount="exit 0", mountpoint="exit 1", sudo='exec "$@"', gcsfuse="exit 0",
                              chown="exit 0")
    fstab = tmp_path / "fstab"
    older = f"my-weights {tmp_path}/bucket gcsfuse rw,_netdev,allow_other,implicit_dirs,uid=1,gid=1 0 0"
    fstab.write_text(f"UUID=abc / ext4 defaults 0 1\n{older}\n")
    env = base_env(tmp_path, bin_dir, MCJAX_PROVIDER="gcloud", MCJAX_BUCKET="my-weights",
                   MCJAX_BUCKET_DIR=str(tmp_path / "bucket"), MCJAX_FSTAB=str(fstab))
    done = run(["bash", ROOT / "cluster/gcsfuse.sh", "mount"], env, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = fstab.read_text().splitlines()
    assert lines[0] == "UUID=abc / ext4 defaults 0 1" and len(lines) == 2, lines  # the older line replaced
    bucket, where, kind, options, *_ = lines[1].split()
    assert (bucket, where, kind) == ("my-weights", str(tmp_path / "bucket"), "gcsfuse")
    assert "nofail" in options.split(",") and "_netdev" in options.split(",")
    mounted = [c for c in calls(log) if c.startswith("mount ")]
    assert len(mounted) == 1
    words = mounted[0].split(" [")
    live = words[words.index("-o]") + 1].rstrip("]")
    assert live.split(",") == [o for o in options.split(",") if o not in ("nofail", "_netdev")]
    again = run(["bash", ROOT / "cluster/gcsfuse.sh", "mount"], env, ROOT)
    assert again.returncode == 0 and fstab.read_text().splitlines() == lines


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="no ssh-keygen")
def test_host_0_key_is_accepted_from_host_0_only_and_removed(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAmine me@laptop\n")
    env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", HOME=str(home), PATH=os.environ["PATH"])

    def ssh_sh(*args: str) -> None:
        done = run(["bash", ROOT / "cluster/ssh.sh", *args], env, ROOT)
        assert done.returncode == 0, done.stderr

    authorized = home / ".ssh" / "authorized_keys"
    ssh_sh("authorize", "ssh-ed25519 AAAAhost0", "10.0.0.10")
    ssh_sh("authorize", "ssh-ed25519 AAAAhost0", "10.0.0.10")
    assert authorized.read_text().splitlines() == [
        "ssh-ed25519 AAAAmine me@laptop", 'from="10.0.0.10" ssh-ed25519 AAAAhost0 mcjax-host0']
    ssh_sh("authorize", "ssh-ed25519 AAAAhost0", "10.0.0.99")  # host 0 moved: one line, the new address
    assert authorized.read_text().splitlines()[1:] == ['from="10.0.0.99" ssh-ed25519 AAAAhost0 mcjax-host0']
    ssh_sh("unauthorize")
    assert authorized.read_text().splitlines() == ["ssh-ed25519 AAAAmine me@laptop"]
    assert authorized.stat().st_mode & 0o777 == 0o600
    bad = run(["bash", ROOT / "cluster/ssh.sh", "authorize", "ssh-ed25519 AAAAhost0", 'x" command="sh'], env, ROOT)
    assert bad.returncode == 2


def test_setup_authorizes_from_host_0_and_stop_removes_the_key(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])

    def remote(out: str, command: str) -> list[list[str]]:
        return [w[2:] for w in map(remote_words, commands(out)) if w[2:3] == [command]]

    setup = run([ROOT / "mcjax_setup.sh", "--dry-run", "--steps", "keys"], env, ROOT)
    assert setup.returncode == 0, setup.stderr
    assert remote(setup.stdout, "authorize") == [["authorize", "<host 0 public key>", "10.0.0.10"]] * 3
    open_key = run([ROOT / "mcjax_setup.sh", "--dry-run", "--steps", "keys"], dict(env, MCJAX_KEY_FROM="off"), ROOT)
    assert remote(open_key.stdout, "authorize") == [["authorize", "<host 0 public key>"]] * 3
    stop = run([ROOT / "mcjax_setup.sh", "--stop", "--dry-run", "--provider", "ssh"], env, ROOT)
    assert stop.returncode == 0, stop.stderr
    assert remote(stop.stdout, "unauthorize") == [["unauthorize"]] * 3
    slurm = run([ROOT / "mcjax_setup.sh", "--stop", "--dry-run", "--provider", "slurm"],
                base_env(tmp_path, bin_dir, **PROVIDERS["slurm"]), ROOT)
    assert slurm.returncode == 0 and "unauthorize" not in slurm.stdout, slurm.stderr


def test_status_on_a_shared_home_speaks_only_of_its_own_host(tmp_path):
    state = tmp_path / "state"
    (state / "pids").mkdir(parents=True)
    for name, host in (("engine-1", "node02"), ("engine-2", None), ("controller", "node01")):
        (state / "pids" / f"{name}.pid").write_text("999999\n")  # no such process
        if host:
            (state / "pids" / f"{name}.host").write_text(f"{host}\n")
    env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="slurm", PATH=os.environ["PATH"], MCJAX_HOST_INDEX="2")
    done = run(["bash", ROOT / "cluster/ipcluster.sh", "status"], env, ROOT)
    assert done.returncode == 0, done.stderr
    assert "engine-2: NOT RUNNING (stale pid file)" in done.stdout
    assert "engine-1" not in done.stdout and "controller" not in done.stdout
    assert "2 processes of other hosts" in done.stdout
    stop = run(["bash", "-c", ". cluster/common.sh && mcjax_stop engine-1"], env, ROOT)
    assert stop.returncode == 0 and (state / "pids" / "engine-1.pid").exists(), stop.stderr


def test_a_public_address_is_warned_about(tmp_path):
    bin_dir, _ = fake_tools(tmp_path)
    public = dict(PROVIDERS["ssh"], MCJAX_INTERNAL_IPS="10.0.0.10 203.0.113.7 172.20.0.3")
    done = run([ROOT / "mcjax_setup.sh", "--dry-run", "--steps", "check"], base_env(tmp_path, bin_dir, **public), ROOT)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "host 1's address 203.0.113.7 is public" in warnings[0], done.stderr


def test_ssh_hosts_on_a_shared_file_system_export_nothing(tmp_path):
    bin_dir, _ = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"], MCJAX_SHARED_FS="1", MCJAX_NFS_DIR="/shared/mcjax")
    done = run([ROOT / "mcjax_setup.sh", "--dry-run", "--steps", "nfs"], env, ROOT)
    assert done.returncode == 0, done.stderr
    assert [w[2:] for w in map(remote_words, commands(done.stdout))] == [
        ["shared-mark", "mcjax-10.0.0.10"], ["shared-check", "mcjax-10.0.0.10"], ["shared-check", "mcjax-10.0.0.10"]]


def test_the_code_step_leaves_out_macos_metadata(tmp_path):
    bin_dir, _ = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])
    done = run([ROOT / "mcjax_setup.sh", "--dry-run", "--steps", "code"], env, ROOT)
    line = next(line for line in done.stdout.splitlines() if line.startswith("+ COPYFILE_DISABLE=1 tar "))
    assert "'--exclude=._*'" in line and "--exclude=.DS_Store" in line
    assert remote_words(commands(line)[0])[2:] == ["receive", "/mnt/mcjax/dsr1"]


def test_the_code_copy_leaves_out_venvs_runs_and_checkpoints(tmp_path):
    """The archive the code step sends: the sources and the demo model, not a venv, training runs,
    a checkpoint folder or a weights file over 100 MB anywhere in the tree (named as it is left out)."""
    import shlex

    repo = repo_copy(tmp_path)
    files = ["dsr1/api.py", "dsr1/demo_model/model.safetensors", "notebooks/main.ipynb", "venv/bin/python",
             "runs/demo/step-100.npz", "checkpoints/r1/model-00001.safetensors", "my weights/config.json"]
    for name in files:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("x")
    with open(repo / "my weights" / "model-00001.safetensors", "wb") as f:
        f.truncate(101 * 2**20)  # sparse: no disk used
    bin_dir, _ = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])
    done = run([repo / "mcjax_setup.sh", "--dry-run", "--steps", "code"], env, repo)
    assert done.returncode == 0, done.stderr
    assert "code: leaving out ./my weights/model-00001.safetensors (over 100 MB" in done.stderr, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("+ COPYFILE_DISABLE=1 tar "))
    tar = shlex.split(line.split(" | ", 1)[0])[2:]
    assert tar[-3:] == ["-czf", "-", "."]
    archive = tmp_path / "code.tgz"
    made = subprocess.run([*tar[:-2], str(archive), "."], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    with tarfile.open(archive) as t:
        names = {n.removeprefix("./") for n in t.getnames()}
    assert {"dsr1/api.py", "dsr1/demo_model/model.safetensors", "notebooks/main.ipynb", "my weights/config.json",
            "mcjax_setup.sh"} <= names, names
    assert not {n for n in names if n.split("/")[0] in ("venv", "runs", "checkpoints")}, names
    assert "my weights/model-00001.safetensors" not in names


# ----------------------------------------------------------------------------- reset_engines

@pytest.mark.slow
def test_a_restart_that_hangs_is_a_cluster_error_naming_host_and_command(tmp_path):
    """A host that stops answering (a dead NFS server under a hard mount) hangs cluster_restart:
    the kernel gets a ClusterError saying where, what and what to do, and nothing is left running."""
    root = tmp_path / "scripts"
    root.mkdir()
    marker = tmp_path / "hung.pid"
    (root / "mcjax_defs.sh").write_text(
        f'cluster_restart() {{ echo "[host 1] checking"; sleep 300 & echo $! >{marker}; wait; }}\n')
    start = time.monotonic()
    with pytest.raises(ClusterError) as caught:
        run_scripts({"root": str(root)}, "check", timeout=2)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert os.uname().nodename in message and "cluster_restart" in message and "did not finish within 2s" in message
    assert "NFS" in message and "reset_engines again" in message and "[host 1] checking" in message
    hung = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{hung}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{hung}").exists(), "the hung command's child is still running"


def test_a_failing_command_is_a_cluster_error_with_its_output(tmp_path):
    with pytest.raises(ClusterError, match=r"restarting the engines \(exit status 3\):\nboom"):
        run_command(["bash", "-c", "echo boom >&2; exit 3"], dict(os.environ), 10, "restarting the engines")


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="no ssh-keygen")
def test_two_clusters_on_one_home_keep_their_own_key_known_hosts_and_authorized_line(tmp_path):
    """Clusters A (the default id) and B (--name B) whose hosts share a home: each has its own key,
    known hosts and authorized_keys line; B's setup and stop leave A's alone, and the other way round."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAmine me@laptop\n")

    def ssh_sh(cluster_id: str, *args: str) -> str:
        env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", HOME=str(home), PATH=os.environ["PATH"],
                       MCJAX_CLUSTER_ID=cluster_id)
        done = run(["bash", ROOT / "cluster/ssh.sh", *args], env, ROOT)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    a_key, b_key = ssh_sh("mcjax", "key"), ssh_sh("B", "key")
    assert a_key != b_key
    assert (home / ".ssh" / "mcjax_ed25519").exists() and (home / ".ssh" / "mcjax_ed25519-B").exists()
    ssh_sh("mcjax", "authorize", a_key, "10.0.0.10")
    ssh_sh("B", "authorize", b_key, "10.0.1.10")
    ssh_sh("mcjax", "known-hosts", "10.0.0.11 ssh-ed25519 AAAAa")
    ssh_sh("B", "known-hosts", "10.0.1.11 ssh-ed25519 AAAAb")
    authorized = home / ".ssh" / "authorized_keys"
    a_line, b_line = f'from="10.0.0.10" {a_key} mcjax-host0', f'from="10.0.1.10" {b_key} mcjax-host0-B'
    assert authorized.read_text().splitlines() == ["ssh-ed25519 AAAAmine me@laptop", a_line, b_line]
    assert (home / ".ssh" / "mcjax_known_hosts").read_text() == "10.0.0.11 ssh-ed25519 AAAAa\n"
    assert (home / ".ssh" / "mcjax_known_hosts-B").read_text() == "10.0.1.11 ssh-ed25519 AAAAb\n"
    ssh_sh("B", "authorize", b_key, "10.0.1.99")  # B's host 0 moved: A's line stays
    ssh_sh("mcjax", "unauthorize")  # A stops: B's line stays
    assert authorized.read_text().splitlines() == ["ssh-ed25519 AAAAmine me@laptop",
                                                   f'from="10.0.1.99" {b_key} mcjax-host0-B']
    ssh_sh("B", "unauthorize")
    assert authorized.read_text().splitlines() == ["ssh-ed25519 AAAAmine me@laptop"]


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock")
def test_hosts_on_one_home_authorize_at_once_without_losing_a_line(tmp_path):
    """The keys step runs `ssh.sh authorize` on every host at once; on a shared home they all edit
    one authorized_keys: every host's call succeeds and every cluster's line is there once."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAmine me@laptop\n")
    calls = []
    for i in range(12):
        env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", HOME=str(home), PATH=os.environ["PATH"],
                       MCJAX_CLUSTER_ID=f"c{i % 4}")
        calls.append(subprocess.Popen(["bash", ROOT / "cluster/ssh.sh", "authorize", f"ssh-ed25519 AAAA{i % 4}",
                                       f"10.0.0.{i % 4}"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate()[1] for p in calls if p.wait() != 0]
    assert errors == []
    lines = (home / ".ssh" / "authorized_keys").read_text().splitlines()
    assert sorted(lines[1:]) == [f'from="10.0.0.{i}" ssh-ed25519 AAAA{i} mcjax-host0-c{i}' for i in range(4)]


def test_a_named_cluster_gets_its_own_settings_folder_and_key_on_the_hosts(tmp_path):
    """--name B: the hosts' scripts and mcjax.env in ~/.mcjax-setup-B, host 0's key and known hosts
    -B, so B's setup does not rewrite the mcjax.env the default cluster's --stop then reads."""
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **{k: v for k, v in PROVIDERS["ssh"].items() if k != "MCJAX_REMOTE_DIR"})

    def settings(*args: str) -> dict[str, str]:
        done = run([ROOT / "mcjax_setup.sh", *args, "--print-env"], env, ROOT)
        assert done.returncode == 0, done.stderr
        lines = run(["bash", "-c", f"{done.stdout}\nenv | grep ^MCJAX_ | sort"],
                    {"HOME": "/h", "PATH": "/usr/bin:/bin"}, ROOT).stdout
        return dict(line.split("=", 1) for line in lines.splitlines())

    a, b = settings(), settings("--name", "B")
    assert (a["MCJAX_REMOTE_DIR"], b["MCJAX_REMOTE_DIR"]) == (".mcjax-setup", ".mcjax-setup-B")
    assert "-i ~/.ssh/mcjax_ed25519 " in a["MCJAX_SSH_OPTS"] and "mcjax_known_hosts " in a["MCJAX_SSH_OPTS"]
    assert "-i ~/.ssh/mcjax_ed25519-B " in b["MCJAX_SSH_OPTS"] and "mcjax_known_hosts-B " in b["MCJAX_SSH_OPTS"]
    assert b["MCJAX_STATE"].endswith("/clusters/B") and b["MCJAX_CLUSTER_ID"] == "B"
    pushed = run([ROOT / "mcjax_setup.sh", "--name", "B", "--dry-run", "--steps", "push"], env, ROOT)
    assert pushed.returncode == 0, pushed.stderr
    assert ".mcjax-setup-B" in pushed.stdout and " .mcjax-setup " not in pushed.stdout, pushed.stdout
    tags = run(["bash", "-c", ". ./mcjax_defs.sh; echo \"[$(mcjax_cluster_tag)]\"; MCJAX_CLUSTER_ID=x.1 "
                "mcjax_cluster_tag"], env, ROOT).stdout.split()
    assert tags == ["[]", "-x.1"]


# ----------------------------------------------------------------------------- a host that reaches only its index

def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of NAME VERSION (one module) in FOLDER."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{p},sha256={digest(t)},{len(t.encode())}\n" for p, t in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(p, t)
    return path


def _simple_index(root: Path, wheels: list[Path]) -> None:
    """ROOT/simple/<project>/index.html (PEP 503) linking ROOT/files/<wheel> with its sha256."""
    import hashlib

    (root / "files").mkdir(parents=True)
    projects: dict[str, list[str]] = {}
    for wheel in wheels:
        shutil.copy(wheel, root / "files" / wheel.name)
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        project = wheel.name.split("-")[0].lower().replace("_", "-")
        projects.setdefault(project, []).append(f'<a href="../../files/{wheel.name}#sha256={sha}">{wheel.name}</a>')
    for project, links in projects.items():
        (root / "simple" / project).mkdir(parents=True)
        (root / "simple" / project / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    (root / "simple" / "index.html").write_text(
        "<html><body>" + "".join(f'<a href="{p}/">{p}</a>' for p in projects) + "</body></html>")


def _uv_wheel(cache: Path) -> Path:
    """uv's wheel at the version mcjax_defs.sh pins, downloaded once into CACHE (skips without it)."""
    import re
    import sys

    version = re.search(r'MCJAX_UV_VERSION:=([0-9.]+)', (ROOT / "mcjax_defs.sh").read_text()).group(1)
    found = sorted(cache.glob(f"uv-{version}-*manylinux*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--dest", str(cache), f"uv=={version}"], capture_output=True, timeout=300)
        found = sorted(cache.glob(f"uv-{version}-*manylinux*.whl"))
    if not found:
        pytest.skip(f"uv {version}'s wheel could not be downloaded")
    return found[0]


NETWORK_OF_ITS_OWN = shutil.which("unshare") is not None and shutil.which("ip") is not None and \
    subprocess.run(["unshare", "-n", "-m", "true"], capture_output=True).returncode == 0

# In a network (and mount) namespace of its own, with loopback alone: the package index served
# there, pip's global configuration of this machine hidden, then venv.sh.
ONLY_AN_INDEX = r"""
set -eu
ip link set lo up
[ ! -e /etc/pip.conf ] || mount --bind /dev/null /etc/pip.conf
"$INDEX_PYTHON" -m http.server --bind 127.0.0.1 --directory "$INDEX_ROOT" "$INDEX_PORT" >/dev/null 2>&1 &
server=$!
trap 'kill "$server"' EXIT
for _ in $(seq 1 100); do
  "$INDEX_PYTHON" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])))' "$INDEX_PORT" \
    2>/dev/null && break
  sleep 0.1
done
bash "$VENV_SH" deps
"$MCJAX_VENV/bin/python" -c 'import tinydep, pip; print("tinydep", tinydep.VERSION)'
"""


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(not NETWORK_OF_ITS_OWN, reason="needs unshare -n -m (root) and ip")
def test_a_host_reaching_only_its_package_index_builds_python_and_venv_from_it(tmp_path, request):
    """A host whose only route is its package index (named in its pip.conf, which uv does not read):
    venv.sh takes the host's own Python (new enough), fetches uv through pip from that index, and
    seeds and syncs the venv from it; nothing comes from GitHub (uv's CPython downloads)."""
    import ensurepip
    import sys

    base = Path(sys._base_executable).resolve()
    seeds = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("*.whl"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tiny = _wheel(wheels, "tinydep", "1.0")
    stand_in = _wheel(wheels, "wheel", "0.0.1")  # uv seeds wheel too below Python 3.12
    cache = request.config.cache.mkdir("uv-wheel") if getattr(request.config, "cache", None) else tmp_path / "dl"
    _simple_index(tmp_path / "index", [_uv_wheel(Path(cache)), tiny, stand_in, *seeds])
    import hashlib

    lock = tmp_path / "lock.txt"
    lock.write_text(f"tinydep==1.0 \\\n    --hash=sha256:{hashlib.sha256(tiny.read_bytes()).hexdigest()}\n")
    home, pybin = tmp_path / "home", tmp_path / "pybin"
    (home / ".config" / "pip").mkdir(parents=True)
    pybin.mkdir()
    version = ".".join(map(str, sys.version_info[:2]))
    (pybin / f"python{version}").symlink_to(base)
    (pybin / "python3").symlink_to(base)
    port = 18000 + os.getpid() % 1000
    (home / ".config" / "pip" / "pip.conf").write_text(f"[global]\nindex-url = http://127.0.0.1:{port}/simple\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("")
    env = {"HOME": str(home), "USER": "obrien", "LANG": "C.UTF-8", "TMPDIR": str(tmp_path),
           "PATH": f"{pybin}{os.pathsep}/usr/sbin{os.pathsep}/usr/bin{os.pathsep}/sbin{os.pathsep}/bin",
           "MCJAX_PROVIDER": "ssh", "MCJAX_STATE": str(tmp_path / "state"), "MCJAX_HOST_PYTHON": version,
           "MCJAX_UV_DIR": str(tmp_path / "uv"), "MCJAX_VENV": str(tmp_path / "venv"), "MCJAX_REPO_DIR": str(repo),
           "MCJAX_NFS_DIR": str(tmp_path / "nfs"), "MCJAX_LOCK": str(lock), "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
           "UV_PYTHON_INSTALL_DIR": str(tmp_path / "uv-python"), "INDEX_PYTHON": str(base),
           "INDEX_ROOT": str(tmp_path / "index"), "INDEX_PORT": str(port), "VENV_SH": str(ROOT / "cluster/venv.sh")}
    done = run(["unshare", "-n", "-m", "bash", "-c", ONLY_AN_INDEX], env, tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tinydep 1.0" in done.stdout, done.stdout
    assert f"with CPython {sys.version.split()[0]}" in done.stdout and str(pybin) in done.stdout, done.stdout
    assert not (tmp_path / "uv-python").exists()  # no uv-managed CPython was installed


@pytest.mark.slow
def test_uv_gets_pip_s_index_settings_and_setup_forwards_proxies_and_index(tmp_path):
    """pip's configuration (which uv ignores) becomes uv's variables where no UV_* one is set; the
    proxies and UV_*/PIP_* set for setup reach the hosts: mcjax.env, and srun's --export."""
    log, uv_dir = tmp_path / "uv.log", tmp_path / "uv"
    (uv_dir / "0.13.9").mkdir(parents=True)
    uv = uv_dir / "0.13.9" / "uv"
    uv.write_text(f'#!/bin/sh\nenv | grep -E "^(UV_|SSL_CERT_FILE|HTTPS?_PROXY)" | sort >>"{log}"\n'
                  'case "$*" in --version) echo "uv 0.13.9";; esac\nexit 0\n')
    uv.chmod(0o755)
    links = tmp_path / "links"
    links.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = https://mirror.example/simple\nextra-index-url = https://extra.example/simple\n"
                    f"find-links = {links} /no/such/folder\ntrusted-host = mirror.example\ncert = {conf}\n"
                    "proxy = http://proxy.example:3128\n")
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", PATH=os.environ["PATH"], MCJAX_UV_DIR=str(uv_dir),
                   MCJAX_VENV=str(tmp_path / "venv"), MCJAX_LOCK="off", MCJAX_REPO_DIR=str(tmp_path / "repo"),
                   MCJAX_HOST_PYTHON_FROM="system", MCJAX_HOST_PYTHON="3.8", PIP_CONFIG_FILE=str(conf))
    done = run(["bash", ROOT / "cluster/venv.sh", "deps"], env, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = set(log.read_text().splitlines())
    assert {"UV_DEFAULT_INDEX=https://mirror.example/simple", "UV_INDEX=https://extra.example/simple",
            f"UV_FIND_LINKS={links}", "UV_INSECURE_HOST=mirror.example", f"SSL_CERT_FILE={conf}",
            "HTTPS_PROXY=http://proxy.example:3128", "UV_INDEX_STRATEGY=unsafe-best-match"} <= seen, seen
    log.write_text("")
    own = run(["bash", ROOT / "cluster/venv.sh", "deps"], dict(env, UV_DEFAULT_INDEX="https://own.example/simple"),
              ROOT)
    assert own.returncode == 0 and "UV_DEFAULT_INDEX=https://own.example/simple" in log.read_text(), own.stderr

    bin_dir, _ = fake_tools(tmp_path)
    given = dict(https_proxy="http://proxy.corp:3128", UV_DEFAULT_INDEX="https://mirror.corp/simple",
                 PIP_INDEX_URL="https://mirror.corp/simple", UV_CACHE_DIR="/local/cache", PIP_CERT="/local/corp.pem")
    printed = run([ROOT / "mcjax_setup.sh", "--print-env"], base_env(tmp_path, bin_dir, **PROVIDERS["ssh"], **given),
                  ROOT)
    assert printed.returncode == 0, printed.stderr
    for name in ("https_proxy", "UV_DEFAULT_INDEX", "PIP_INDEX_URL"):
        assert f'[ -n "${{{name}+x}}" ] || {name}=' in printed.stdout, printed.stdout
    assert "UV_CACHE_DIR" not in printed.stdout and "PIP_CERT" not in printed.stdout  # local paths of this machine
    slurm = run([ROOT / "mcjax_setup.sh", "--dry-run", "--steps", "venv"],
                base_env(tmp_path, bin_dir, **PROVIDERS["slurm"], **given), ROOT)
    assert slurm.returncode == 0, slurm.stderr
    exports = {w for words in commands(slurm.stdout) for w in words if w.startswith("--export=")}
    assert exports == {"--export=HOME,PATH,USER,PIP_INDEX_URL,UV_DEFAULT_INDEX,https_proxy"}, exports


def test_stop_removes_the_nfs_mounts_their_fstab_lines_and_the_exports(tmp_path):
    """--stop of a cluster whose host 0 exported the shared folder: hosts 1..N-1 drop setup's fstab
    line and the mount (nfs.sh unmount), then host 0 its exports file (nfs.sh unexport); a shared
    file system (Slurm's) has none of that."""
    bin_dir, _ = fake_tools(tmp_path)
    stop = run([ROOT / "mcjax_setup.sh", "--stop", "--dry-run", "--provider", "ssh"],
               base_env(tmp_path, bin_dir, **PROVIDERS["ssh"]), ROOT)
    assert stop.returncode == 0, stop.stderr
    said = [w[2:] for w in map(remote_words, commands(stop.stdout)) if w[2:3] in (["unmount"], ["unexport"])]
    assert said == [["unmount", "10.0.0.10"]] * 2 + [["unexport"]], said
    slurm = run([ROOT / "mcjax_setup.sh", "--stop", "--dry-run", "--provider", "slurm"],
                base_env(tmp_path, bin_dir, **PROVIDERS["slurm"]), ROOT)
    assert slurm.returncode == 0 and "unmount" not in slurm.stdout and "unexport" not in slurm.stdout, slurm.stderr

    fstab, exports, shared = tmp_path / "fstab", tmp_path / "mcjax.exports", tmp_path / "shared"
    shared.mkdir()
    ours = f"10.0.0.10:{shared} {shared} nfs rw,hard,noatime,_netdev,nofail 0 0"
    fstab.write_text(f"UUID=abc / ext4 defaults 0 1\n{ours}\n10.0.0.99:/other /other nfs rw 0 0\n")
    exports.write_text(f"{shared} 10.0.0.11(rw)\n")
    (bin_dir / "exportfs").write_text(f'#!/bin/sh\necho "exportfs $*" >>"{tmp_path}/exportfs.log"\n')
    (bin_dir / "exportfs").chmod(0o755)
    (bin_dir / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "sudo").chmod(0o755)
    env = base_env(tmp_path, bin_dir, MCJAX_PROVIDER="ssh", MCJAX_NFS_DIR=str(shared), MCJAX_FSTAB=str(fstab),
                   MCJAX_EXPORTS_FILE=str(exports))
    done = run(["bash", ROOT / "cluster/nfs.sh", "unmount", "10.0.0.10"], env, ROOT)
    assert done.returncode == 0, done.stderr
    assert fstab.read_text() == "UUID=abc / ext4 defaults 0 1\n10.0.0.99:/other /other nfs rw 0 0\n"
    done = run(["bash", ROOT / "cluster/nfs.sh", "unexport"], env, ROOT)
    assert done.returncode == 0 and not exports.exists(), done.stderr
    assert (tmp_path / "exportfs.log").read_text() == "exportfs -ra\n" and shared.is_dir()
