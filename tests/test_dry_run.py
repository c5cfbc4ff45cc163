"""What the setup scripts would run on a real cluster, checked without one: the --dry-run
transcripts of setup, restart and stop for the gcloud, ssh and slurm providers (golden files in
tests/data/dry_run/, with settings that need quoting: a home folder with a quote, a repository and
a venv with spaces, a user with a quote), and the choices that decide which cluster a command
reaches: --stop and --status follow the state folder, never MCJAX_PROVIDER.

The providers' tools (gcloud, ssh, srun, scontrol) are fakes on PATH that record every call: a dry
run calls none of them (scontrol only reads the allocation's node list). Two tests start a real
local cluster: the quickstart run from a shell set up for gcloud, and a platform-numbered one.

MCJAX_UPDATE_GOLDEN=1 pytest tests/test_dry_run.py rewrites the golden files.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "dry_run"
HOME = "/home/o'brien"  # never created: a dry run writes nothing

# The call is recorded with one write: tools run in parallel (one ssh per host) append to the
# same log, and a line written in pieces would interleave with theirs.
FAKE_TOOL = """#!/bin/sh
line=$(basename "$0")
for a in "$@"; do line="$line [$a]"; done
printf '%s\\n' "$line" >>"{log}"
{body}
"""


def fake_tools(tmp_path: Path, **bodies: str) -> tuple[Path, Path]:
    """A bin folder whose gcloud, ssh, srun, scontrol record their calls in calls.log and fail,
    unless BODIES gives a tool's shell code (run after the record)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    log.touch()
    nodes = 'if [ "$1 $2" = "show hostnames" ]; then printf "node01\\nnode02\\nnode03\\n"; exit 0; fi; exit 1'
    defaults = {"gcloud": "exit 1", "ssh": "exit 1", "srun": "exit 1", "sbatch": "exit 1", "scontrol": nodes}
    for tool, body in {**defaults, **bodies}.items():
        path = bin_dir / tool
        path.write_text(FAKE_TOOL.format(log=log, body=body))
        path.chmod(0o755)
    return bin_dir, log


def calls(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line]


def repo_copy(tmp_path: Path) -> Path:
    """The scripts in a folder whose path has a space (what the code step archives)."""
    repo = tmp_path / "my repo"
    (repo / "cluster").mkdir(parents=True)
    for name in ("mcjax_setup.sh", "mcjax_defs.sh"):
        shutil.copy(ROOT / name, repo)
    for script in (ROOT / "cluster").glob("*.sh"):
        shutil.copy(script, repo / "cluster")
    return repo


def base_env(tmp_path: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no MCJAX_* or SLURM_* of the caller, the fake tools first on PATH."""
    env = {"HOME": HOME, "USER": "obrien", "LANG": "C.UTF-8", "TMPDIR": str(tmp_path),
           "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "MCJAX_STATE": str(tmp_path / "state")}
    env.update(extra)
    return env


PROVIDERS = {
    "gcloud": dict(MCJAX_PROVIDER="gcloud", MCJAX_CLUSTER="my-v5p-64", MCJAX_ZONE="us-east5-a",
                   MCJAX_PROJECT="my-project", MCJAX_GCLOUD_SSH="iap", MCJAX_HOSTS="3",
                   MCJAX_INTERNAL_IPS="10.130.0.2 10.130.0.3 10.130.0.4", MCJAX_BUCKET="my-weights",
                   MCJAX_REPO_DIR="/mnt/mcjax/dsr1 o'brien"),
    "ssh": dict(MCJAX_PROVIDER="ssh", MCJAX_HOST_LIST="gpu-0 gpu-1 admin@gpu-2", MCJAX_USER="o'brien",
                MCJAX_INTERNAL_IPS="10.0.0.10,10.0.0.11,10.0.0.12", MCJAX_VENV=f"{HOME}/dsr1 venv",
                MCJAX_REMOTE_DIR=".mcjax setup", MCJAX_COORDINATOR_PORT="8477"),
    "slurm": dict(MCJAX_PROVIDER="slurm", SLURM_JOB_ID="4711", SLURM_JOB_NODELIST="node[01-03]",
                  SLURM_JOB_CPUS_PER_NODE="64(x2),48",
                  MCJAX_INTERNAL_IPS="10.2.0.1 10.2.0.2 10.2.0.3", MCJAX_SRUN_OPTS="--gpus-per-node=8",
                  MCJAX_NFS_DIR="/scratch/o'brien/mcjax"),
}


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def transcript(provider: str, tmp_path: Path) -> tuple[str, list[str], Path]:
    """setup, restart, restart all, stop (from the state folder's record) as dry runs; the text with
    the temporary paths replaced, the tools' calls, the repository copy."""
    repo = repo_copy(tmp_path)
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS[provider])
    parts = []

    setup = run([repo / "mcjax_setup.sh", "--dry-run"], env, repo)
    assert setup.returncode == 0 and setup.stderr == "", setup.stdout + setup.stderr
    parts.append(("./mcjax_setup.sh --dry-run", setup.stdout))
    assert not (tmp_path / "state").exists(), "a dry run wrote the state folder"

    for what in ("", "all"):
        restart = run(["bash", "-c", f". ./mcjax_defs.sh && cluster_restart {what}"], dict(env, MCJAX_DRY_RUN="1"),
                      repo)
        assert restart.returncode == 0 and restart.stderr == "", restart.stdout + restart.stderr
        parts.append((f"MCJAX_DRY_RUN=1 cluster_restart {what}".rstrip(), restart.stdout))

    # A setup whose first step fails (the fake tools fail) has already recorded the cluster: stop
    # finds it from the state folder alone, in a shell whose settings name another provider.
    failed = run([repo / "mcjax_setup.sh", "--steps", "check"], env, repo)
    assert failed.returncode == 1 and (tmp_path / "state" / "setup.env").exists(), failed.stdout + failed.stderr
    (tmp_path / "calls.log").write_text("")
    other = base_env(tmp_path, bin_dir, MCJAX_PROVIDER="local" if provider != "local" else "ssh", MCJAX_HOSTS="7")
    stop = run([repo / "mcjax_setup.sh", "--stop", "--dry-run"], other, repo)
    assert stop.returncode == 0 and stop.stderr == "", stop.stdout + stop.stderr
    parts.append(("./mcjax_setup.sh --stop --dry-run (another provider in the environment)", stop.stdout))

    text = "".join(f"### {title}\n{out.strip()}\n\n" for title, out in parts)
    text = text.replace(str(repo), "<repo>").replace(str(tmp_path / "state"), "<state>")
    return text, calls(log), repo


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
@pytest.mark.slow
def test_dry_run_transcripts(provider, tmp_path):
    text, made, _ = transcript(provider, tmp_path)
    made = [c for c in made if not c.startswith("scontrol [show] [hostnames]")]  # reads the node list
    assert made == [], f"a dry run called the provider's tools: {made}"
    golden = GOLDEN / f"{provider}.txt"
    if os.environ.get("MCJAX_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no {golden}: run with MCJAX_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"the {provider} transcript changed (MCJAX_UPDATE_GOLDEN=1 to accept):\n{text}"


def commands(text: str) -> list[list[str]]:
    """Each "+ COMMAND" line as the words a shell would see (a pipe: the command after it)."""
    out = []
    for line in text.splitlines():
        if line.startswith("+ "):
            words = shlex.split(line[2:])
            out.append(words[words.index("|") + 1:] if "|" in words else words)
    return out


def remote_words(words: list[str]) -> list[str]:
    """The words of the command string a host runs, after our `export MCJAX_HOST_INDEX=i;`."""
    if words[0] == "gcloud":
        cmd = next(w for w in words if w.startswith("--command="))[len("--command="):]
    elif words[0] == "ssh":
        cmd = words[-1]
    else:  # srun ... bash -c CMD
        cmd = words[words.index("-c") + 1]
    return shlex.split(cmd.split("MCJAX_HOST_INDEX=", 1)[1].split(";", 1)[1])


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_dry_run_commands_survive_the_quoting(provider, tmp_path):
    """Every printed command parses, reaches the host with the right words, paths with spaces and
    quotes intact; the Python install step is there."""
    text, _, repo = transcript(provider, tmp_path)
    setup = text.split("### ", 2)[1]
    cmds = commands(setup)
    assert cmds and all(c[0] in ("gcloud", "ssh", "srun", "setsid") for c in cmds), cmds
    scripts = [remote_words(c[2:] if c[0] == "setsid" else c) for c in cmds]
    remote_dir = PROVIDERS[provider].get("MCJAX_REMOTE_DIR", ".mcjax-setup")
    venv = [s for s in scripts if s[:2] == ["bash", f"{remote_dir}/cluster/venv.sh"]]
    assert [s[2] for s in venv] == ["install", "deps", "deps", "project", "project", "check", "check", "check"]
    assert "uv 0.13.9 from its wheel on the package index" in setup and "uv python install 3.12" in setup
    if provider == "gcloud":
        assert all("--tunnel-through-iap" in c and "--ssh-flag=-o ConnectTimeout=20 -o ServerAliveInterval=15 "
                   "-o ServerAliveCountMax=4" in c for c in cmds)
        code = next(line for line in setup.splitlines() if line.startswith("+ COPYFILE_DISABLE=1 tar -C '<repo>'"))
        untar = remote_words(shlex.split(code.split(" | ", 1)[1]))
        assert untar == ["bash", ".mcjax-setup/cluster/nfs.sh", "receive", "/mnt/mcjax/dsr1 o'brien"]
        assert ["bash", ".mcjax-setup/cluster/gcsfuse.sh", "mount"] in scripts
    if provider == "ssh":
        assert [c[-2] for c in cmds[:3]] == ["o'brien@gpu-0", "o'brien@gpu-1", "admin@gpu-2"]
        assert ["bash", ".mcjax setup/cluster/ipcluster.sh", "controller", "start", "10.0.0.10"] in scripts
    if provider == "slurm":
        assert [next(w for w in c if w.startswith("--nodelist=")) for c in cmds[:3]] == [
            "--nodelist=node01", "--nodelist=node02", "--nodelist=node03"]
        launched = [c for c in cmds if c[0] == "setsid"]
        assert [remote_words(c[2:])[2:] for c in launched] == [
            ["controller", "run", "10.2.0.1"], ["engine", "run"], ["engine", "run"], ["jupyter", "run"]]
        assert all("--jobid=4711" in c and "--overlap" in c for c in cmds)
        # Each step gets the allocation's CPUs per node (the fewest of "64(x2),48") and the job's memory,
        # not srun's one core.
        assert all("--cpus-per-task=48" in c and "--mem=0" in c for c in cmds)
        assert ("--gpus-per-node=8" in launched[1]) and ("--gpus-per-node=8" not in launched[0])
        assert ["bash", ".mcjax-setup/cluster/nfs.sh", "shared-check", "mcjax-4711"] in scripts


def test_print_env_gives_host_0_what_it_needs_to_restart(tmp_path):
    """mcjax.env: the host list (internal IPs, users kept), user, ssh options with host 0's key and
    the host keys the keys step collected, the transport, numbering and cache settings."""
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])
    done = run([ROOT / "mcjax_setup.sh", "--print-env"], env, ROOT)
    assert done.returncode == 0, done.stderr
    settings = run(["bash", "-c", f"{done.stdout}\nenv | grep ^MCJAX_ | sort"], {"HOME": "/h", "PATH": "/usr/bin:/bin"},
                   ROOT).stdout
    values = dict(line.split("=", 1) for line in settings.splitlines())
    assert values["MCJAX_HOST_LIST"] == "10.0.0.10 10.0.0.11 admin@10.0.0.12"
    assert values["MCJAX_TRANSPORT"] == "ssh" and values["MCJAX_USER"] == "o'brien"
    assert "-i ~/.ssh/mcjax_ed25519" in values["MCJAX_SSH_OPTS"]
    assert "StrictHostKeyChecking=yes" in values["MCJAX_SSH_OPTS"] and "ConnectTimeout=20" in values["MCJAX_SSH_OPTS"]
    assert values["MCJAX_VENV"] == "/h/dsr1 venv" and values["MCJAX_NUMBERING"] == "kernel-last"
    assert values["MCJAX_JAX_CACHE"] == "/mnt/mcjax/jax_cache" and values["MCJAX_COORDINATOR_PORT"] == "8477"
    gcloud = run([ROOT / "mcjax_setup.sh", "--print-env"], base_env(tmp_path, bin_dir, **PROVIDERS["gcloud"]), ROOT)
    assert 'MCJAX_USER=$(id -un)' in gcloud.stdout and "MCJAX_NUMBERING=platform" in gcloud.stdout
    assert calls(log) == []


def test_the_notebooks_settings_given_here_reach_the_hosts(tmp_path):
    """DSR1_CHECKPOINT and DSR1_API_KEY set for setup go into mcjax.env (for host 0's Jupyter and its
    kernels); unset, they are not written, and a host's own value wins."""
    bin_dir, _ = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"], DSR1_CHECKPOINT="/mnt/weights/DeepSeek-R1",
                   DSR1_API_KEY="s3cret key")
    done = run([ROOT / "mcjax_setup.sh", "--print-env"], env, ROOT)
    assert done.returncode == 0, done.stderr
    shown = run(["bash", "-c", f"{done.stdout}\necho \"$DSR1_CHECKPOINT|$DSR1_API_KEY\""],
                {"HOME": "/h", "PATH": "/usr/bin:/bin"}, ROOT).stdout.strip()
    assert shown == "/mnt/weights/DeepSeek-R1|s3cret key"
    own = run(["bash", "-c", f"{done.stdout}\necho \"$DSR1_CHECKPOINT\""],
              {"HOME": "/h", "PATH": "/usr/bin:/bin", "DSR1_CHECKPOINT": "/local/r1"}, ROOT).stdout.strip()
    assert own == "/local/r1"
    plain = run([ROOT / "mcjax_setup.sh", "--print-env"], base_env(tmp_path, bin_dir, **PROVIDERS["ssh"]), ROOT)
    assert "DSR1_" not in plain.stdout


def test_a_one_host_cluster_is_pointed_to_single(tmp_path):
    """A TPU VM of one host (a v6e-8): setup stops, naming --single, the way to use one machine."""
    bin_dir, _ = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **dict(PROVIDERS["gcloud"], MCJAX_CLUSTER="my-v6e-8", MCJAX_HOSTS="1",
                                             MCJAX_INTERNAL_IPS="10.130.0.2"))
    done = run([ROOT / "mcjax_setup.sh", "--dry-run"], env, ROOT)
    assert done.returncode == 1 and "a cluster needs at least 2 hosts" in done.stderr, done.stdout + done.stderr
    assert "this one has 1: for one machine (a TPU VM such as a v6e-8, one GPU box) run ./mcjax_setup.sh " \
           "--single on it" in done.stderr


def test_port_forward_takes_a_local_port_apart_from_host_0s(tmp_path):
    """cluster_port_forward [LOCAL [REMOTE]]: REMOTE (default Jupyter's port) on host 0's loopback,
    reached from LOCAL here (default the same): a port taken here needs only another LOCAL."""
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"], MCJAX_JUPYTER_PORT="8890")
    for args, forward in (("", "127.0.0.1:8890:127.0.0.1:8890"), ("9999", "127.0.0.1:9999:127.0.0.1:8890"),
                          ("9000 8000", "127.0.0.1:9000:127.0.0.1:8000")):
        log.write_text("")
        run(["bash", "-c", f". ./mcjax_defs.sh && cluster_port_forward {args}"], env, ROOT)
        assert f"[-L] [{forward}] [o'brien@gpu-0]" in log.read_text(), (args, log.read_text())
    bad = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_port_forward 9000 http"], env, ROOT)
    assert bad.returncode == 2 and "bad port 'http'" in bad.stderr


def test_the_quoted_commands_run_as_printed(tmp_path):
    """What a dry run prints is what runs: a fake ssh that runs its command string in a "remote"
    home gets the words intact (a copy into a folder whose name has a space and a quote)."""
    remote_home = tmp_path / "remote home"
    remote_home.mkdir()
    bin_dir, log = fake_tools(tmp_path, ssh='for last; do :; done; cd "$REMOTE_HOME" && exec sh -c "$last"')
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"], REMOTE_HOME=str(remote_home))
    src = tmp_path / "a file 'x'.txt"
    src.write_text("payload\n")
    cat = "cat \"it's here/a file 'x'.txt\""
    script = (". ./mcjax_defs.sh && cluster_exec 0 2 'echo \"i=$MCJAX_HOST_INDEX\"' && "
              f"cluster_scp {shlex.quote(str(src))} \"it's here\" 1 2 && cluster_exec 1 1 {shlex.quote(cat)}")
    done = run(["bash", "-c", script], env, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"[host 0] i=0", "[host 1] i=1", "[host 2] i=2"} <= set(done.stdout.splitlines())
    assert done.stdout.splitlines()[-1] == "payload"
    assert (remote_home / "it's here" / "a file 'x'.txt").read_text() == "payload\n"
    assert "[o'brien@gpu-1]" in log.read_text() and "[admin@gpu-2]" in log.read_text()


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="no ssh-keygen")
def test_host_0_key_is_made_once_and_authorized_once(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", HOME=str(home), PATH=os.environ["PATH"])

    def ssh_sh(*args: str) -> subprocess.CompletedProcess:
        done = run(["bash", ROOT / "cluster/ssh.sh", *args], env, ROOT)
        assert done.returncode == 0, done.stderr
        return done

    pub = ssh_sh("key").stdout.strip()
    assert pub.startswith("ssh-ed25519 ") and ssh_sh("key").stdout.strip() == pub
    ssh_sh("authorize", pub)
    ssh_sh("authorize", pub)
    authorized = (home / ".ssh" / "authorized_keys").read_text().splitlines()
    assert authorized == [f"{pub} mcjax-host0"]
    ssh_sh("known-hosts", "10.0.0.2 ssh-ed25519 AAAA1", "10.0.0.3 ssh-ed25519 AAAA2")
    known = home / ".ssh" / "mcjax_known_hosts"
    assert known.read_text().splitlines() == ["10.0.0.2 ssh-ed25519 AAAA1", "10.0.0.3 ssh-ed25519 AAAA2"]
    assert {f.stat().st_mode & 0o777 for f in (home / ".ssh").iterdir() if f.name != "mcjax_ed25519.pub"} == {0o600}
    assert (home / ".ssh").stat().st_mode & 0o777 == 0o700
    bad = run(["bash", ROOT / "cluster/ssh.sh", "authorize", "not a key"], env, ROOT)
    assert bad.returncode == 2 and "'not a key'" in bad.stderr


# ----------------------------------------------------------------------------- which cluster

def test_stop_acts_on_the_state_folders_local_cluster_not_on_mcjax_provider(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    state = tmp_path / "state"
    (state / "pids").mkdir(parents=True)
    (state / "local.env").write_text("MCJAX_HOSTS=2\nMCJAX_LOCAL_DEVICES=2\nMCJAX_CLUSTER_ID=mine\n")
    env = base_env(tmp_path, bin_dir, **PROVIDERS["gcloud"])
    done = run([ROOT / "mcjax_setup.sh", "--stop"], env, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "local cluster 'mine' stopped" in done.stdout and not (state / "local.env").exists()
    assert calls(log) == []
    nothing = run([ROOT / "mcjax_setup.sh", "--stop"], env, ROOT)
    assert nothing.returncode == 0 and "records no cluster: nothing to stop" in nothing.stdout
    status = run([ROOT / "mcjax_setup.sh", "--status"], env, ROOT)
    assert status.returncode == 1 and calls(log) == []


def test_stop_on_host_0_does_not_take_the_real_cluster_for_a_local_one(tmp_path):
    """Host 0's state folder holds the controller's pid files and cluster.json, but no setup.env: --stop,
    --status and --check there say which cluster it is and where to stop it, and stop nothing."""
    bin_dir, log = fake_tools(tmp_path)
    state = tmp_path / "state"
    (state / "pids").mkdir(parents=True)
    (state / "pids" / "controller.pid").write_text("4242\n")
    (state / "cluster.json").write_text(json.dumps({"provider": "gcloud", "cluster_id": "big", "engines": 15},
                                                   indent=1))
    env = base_env(tmp_path, bin_dir, MCJAX_PROVIDER="gcloud")
    for mode in ("--stop", "--status", "--check"):
        done = run([ROOT / "mcjax_setup.sh", mode, "--dry-run"], env, ROOT)
        assert done.returncode == 1 and "local.sh" not in done.stdout, done.stdout + done.stderr
        assert (f"is a host's of the gcloud cluster 'big' (its cluster.json), not a local cluster: {mode} it from "
                f"the machine that set it up") in done.stderr, done.stderr
    assert (state / "pids" / "controller.pid").exists() and calls(log) == []
    (state / "cluster.json").write_text(json.dumps({"provider": "local", "cluster_id": "mine"}, indent=1))
    local = run([ROOT / "mcjax_setup.sh", "--stop", "--dry-run"], env, ROOT)
    assert local.returncode == 0 and "local.sh stop" in local.stdout, local.stdout + local.stderr


def test_a_state_folder_holds_one_cluster(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["gcloud"])
    run([ROOT / "mcjax_setup.sh", "--steps", "check"], env, ROOT)  # records it, then fails
    assert (tmp_path / "state" / "setup.env").stat().st_mode & 0o777 == 0o600
    local = run([ROOT / "mcjax_setup.sh", "--local", "2"], env, ROOT)
    assert local.returncode == 1 and "records the gcloud cluster" in local.stderr
    (tmp_path / "state" / "setup.env").unlink()
    (tmp_path / "state" / "local.env").write_text("MCJAX_HOSTS=2\n")
    real = run([ROOT / "mcjax_setup.sh", "--steps", "check"], env, ROOT)
    assert real.returncode == 1 and "holds a local cluster" in real.stderr


def test_stop_of_a_recorded_cluster_that_fails_keeps_the_record(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])
    run([ROOT / "mcjax_setup.sh", "--steps", "check"], env, ROOT)
    log.write_text("")
    done = run([ROOT / "mcjax_setup.sh", "--stop"], base_env(tmp_path, bin_dir), ROOT)
    assert done.returncode == 1 and "setup.env kept" in done.stderr, done.stderr
    assert [c.split()[0] for c in calls(log)] == ["ssh"] * 3 and "[o'brien@gpu-1]" in log.read_text()


def test_derived_settings_follow_the_provider(tmp_path):
    """A shell set up for gcloud (defs sourced) that runs a local cluster: the gcloud defaults
    (shared-folder profile, platform numbering, jax[tpu]) do not leak into it."""
    script = ("export MCJAX_PROVIDER=gcloud; . ./mcjax_defs.sh; echo $MCJAX_NUMBERING $MCJAX_PROFILE_DIR; "
              "MCJAX_PROVIDER=local bash -c '. ./mcjax_defs.sh; "
              "echo $MCJAX_NUMBERING $MCJAX_PROFILE_DIR [$MCJAX_JAX_SPEC]'")
    for shell in ("bash", "zsh"):
        if shutil.which(shell) is None:
            continue
        env = base_env(tmp_path, tmp_path, MCJAX_NFS_DIR="/data")
        out = run([shell, "-c", script], env, ROOT).stdout.splitlines()
        assert out == ["platform /data/.mcjax/profile_mcjax",
                       f"kernel-last {tmp_path}/state/profile_mcjax []"], (shell, out)


# ----------------------------------------------------------------------------- restart, setup checks

def test_restart_that_cannot_succeed_stops_nothing(tmp_path):
    """Host 2 cannot start an engine (its venv is gone): the running engines are left alone."""
    bin_dir, log = fake_tools(tmp_path, ssh='case "$*" in *"MCJAX_HOST_INDEX=2;"*"engine check"*) '
                                          'echo "ipcluster.sh: no venv" >&2; exit 3 ;; esac; exit 0')
    env = base_env(tmp_path, bin_dir, **dict(PROVIDERS["ssh"], MCJAX_REMOTE_DIR=".mcjax-setup"))
    done = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_restart"], env, ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "host 2 (exit status 3)" in done.stderr and "nothing was stopped" in done.stderr
    made = calls(log)
    assert [m for m in made if "engine check" in m] and not [m for m in made if "stop" in m or "start" in m], made
    check = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_restart check"], env, ROOT)
    assert check.returncode == 3


def test_setup_stops_on_a_uid_mismatch(tmp_path):
    ids = ('case "$*" in *"mcjax-id"*) case "$*" in *gpu-1*) u=1001 ;; *) u=1000 ;; esac; '
           'echo "mcjax-id obrien $u:1000 host Linux_x86_64 8" ;; esac; exit 0')
    bin_dir, _ = fake_tools(tmp_path, ssh=ids)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])
    done = run([ROOT / "mcjax_setup.sh", "--steps", "check"], env, ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "host 0 has obrien 1000:1000 but host 1 has obrien 1001:1000" in done.stderr, done.stderr
    assert "  host 2 host: user obrien, uid:gid 1000:1000" in done.stdout


def test_cluster_exec_under_set_e_reports_the_failing_host(tmp_path):
    for shell in ("bash", "zsh"):
        if shutil.which(shell) is None:
            continue
        env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="local", MCJAX_HOSTS="4", PATH=os.environ["PATH"])
        script = ('set -e; . ./mcjax_defs.sh; cluster_exec 0 3 '
                  '\'echo "on $MCJAX_HOST_INDEX"; [ "$MCJAX_HOST_INDEX" != 2 ] || exit 7\'; echo unreachable')
        done = run([shell, "-c", script], env, ROOT)
        assert done.returncode == 7, (shell, done.stdout, done.stderr)
        assert "cluster_exec: failed on host 2 (exit status 7)" in done.stderr and "unreachable" not in done.stdout
        assert {f"[host {i}] on {i}" for i in range(4)} <= set(done.stdout.splitlines())
        one = run([shell, "-c", "set -e; . ./mcjax_defs.sh; cluster_exec 1 1 'exit 5'; echo unreachable"], env, ROOT)
        assert one.returncode == 5 and "host 1 failed (exit status 5)" in one.stderr, (shell, one.stderr)


def test_nfs_client_writes_fstab_only_after_the_mount_worked(tmp_path):
    bin_dir, log = fake_tools(tmp_path, mount="exit 32", mountpoint="exit 1", sudo='exec "$@"')
    (bin_dir / "mount.nfs").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "mount.nfs").chmod(0o755)
    fstab = tmp_path / "fstab"
    shared = tmp_path / "shared"
    # An earlier setup's line (without nofail): kept until the mount works, then replaced.
    earlier = f"127.0.0.1:{shared} {shared} nfs rw,hard,noatime,_netdev 0 0"
    fstab.write_text(f"UUID=abc / ext4 defaults 0 1\n{earlier}\n")
    env = base_env(tmp_path, bin_dir, MCJAX_PROVIDER="ssh", MCJAX_NFS_DIR=str(shared), MCJAX_FSTAB=str(fstab))
    done = run(["bash", ROOT / "cluster/nfs.sh", "client", "127.0.0.1"], env, ROOT)
    assert done.returncode == 1 and "nothing was added" in done.stderr, done.stdout + done.stderr
    assert fstab.read_text() == f"UUID=abc / ext4 defaults 0 1\n{earlier}\n"
    assert [c for c in calls(log) if c.startswith("mount ")]
    (bin_dir / "mount").write_text("#!/bin/sh\nexit 0\n")
    again = run(["bash", ROOT / "cluster/nfs.sh", "client", "127.0.0.1"], env, ROOT)
    assert again.returncode == 0, again.stderr
    assert fstab.read_text().splitlines() == ["UUID=abc / ext4 defaults 0 1",
                                              f"127.0.0.1:{shared} {shared} nfs rw,hard,noatime,_netdev,nofail 0 0"]
    mounted = [c for c in calls(log) if c.startswith("mount ")][-1]
    assert "[-o] [rw,hard,noatime]" in mounted, mounted


def test_apt_always_waits_for_the_dpkg_lock():
    for script in sorted((ROOT / "cluster").glob("*.sh")):
        for number, line in enumerate(script.read_text().splitlines(), 1):
            if "apt-get" in line and "mcjax_sudo" in line:
                assert "DPkg::Lock::Timeout" in line, f"{script.name}:{number}: {line}"


def test_an_engine_of_a_replaced_controller_is_stale(tmp_path):
    profile = tmp_path / "profile"
    (profile / "security").mkdir(parents=True)
    engine_json = profile / "security" / "ipcontroller-mcjax-engine.json"
    engine_json.write_text('{"key": "first"}')
    env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", MCJAX_PROFILE_DIR=str(profile), PATH=os.environ["PATH"])
    script = ('. cluster/common.sh; mkdir -p "$MCJAX_STATE/pids"; '
              'mcjax_controller_fingerprint >"$MCJAX_STATE/pids/engine-1.controller"; '
              'mcjax_engine_stale 1 && echo stale || echo fresh; '
              f'echo \'{{"key": "second"}}\' >{shlex.quote(str(engine_json))}; '
              'mcjax_engine_stale 1 && echo stale || echo fresh')
    done = run(["bash", "-c", script], env, ROOT)
    assert done.stdout.split() == ["fresh", "stale"], done.stdout + done.stderr


def test_jupyter_fails_fast_on_a_taken_port(tmp_path):
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    venv_python.chmod(0o755)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = base_env(tmp_path, tmp_path, MCJAX_PROVIDER="ssh", MCJAX_VENV=str(tmp_path / "venv"),
                       MCJAX_NFS_DIR=str(tmp_path / "nfs"), MCJAX_JUPYTER_PORT=str(port), MCJAX_HOST_INDEX="0",
                       PATH=os.environ["PATH"])
        start = time.monotonic()
        done = run(["bash", ROOT / "cluster/ipcluster.sh", "jupyter", "start"], env, ROOT)
        assert done.returncode == 1 and f"127.0.0.1:{port} on host 0 is taken" in done.stderr, done.stderr
        assert time.monotonic() - start < 10 and not (tmp_path / "state" / "pids" / "jupyter.pid").exists()
    assert "--ServerApp.port_retries=0" in (ROOT / "cluster/ipcluster.sh").read_text()


# ----------------------------------------------------------------------------- real local clusters

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(stat) and not stat.startswith("Z")


def _kill_leftovers(state: Path, marker: str) -> None:
    for pidfile in (state / "pids").glob("*.pid"):
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.exists() and marker in cmdline.read_text(errors="replace"):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow
def test_quickstart_from_a_shell_set_up_for_gcloud_stops_its_own_cluster(tmp_path):
    """MCJAX_PROVIDER=gcloud exported, mcjax_defs.sh sourced for it, a fake gcloud on PATH: the
    quickstart starts its local cluster, the kernel gets the compilation cache, its exit trap
    stops that cluster, and nothing reaches gcloud."""
    pytest.importorskip("ipyparallel")
    root = repo_copy(tmp_path)
    (root / "notebooks").mkdir()
    (root / "notebooks" / "main.ipynb").write_text("{}")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv_bin / "pip").write_text("#!/bin/sh\nexit 0\n")  # the environment is this one: nothing to install
    # nbconvert's stand-in: records what the kernel would see, writes an empty notebook.
    (venv_bin / "jupyter").write_text(
        '#!/bin/sh\nenv | grep -E "^(JAX_|MCJAX_STATE)" >"$MCJAX_STATE/kernel.env"\n'
        'cp "$MCJAX_STATE/cluster.json" "$MCJAX_STATE/seen-cluster.json"\n'
        'mkdir -p "$MCJAX_STATE/quickstart"\n'
        f'"{sys.executable}" -c "import nbformat, sys; nbformat.write(nbformat.v4.new_notebook(), sys.argv[1])" '
        '"$MCJAX_STATE/quickstart/main.ipynb"\n')
    for tool in ("python", "pip", "jupyter"):
        (venv_bin / tool).chmod(0o755)
    bin_dir, log = fake_tools(tmp_path)
    state = tmp_path / "qs-state"
    env = base_env(tmp_path, bin_dir, **PROVIDERS["gcloud"])
    env.update(HOME=str(tmp_path), MCJAX_STATE=str(state), MCJAX_CLUSTER_ID=f"qs-{os.getpid()}",
               MCJAX_START_TIMEOUT="90", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sourced = run(["bash", "-c", ". ./mcjax_defs.sh && env -0"], env, root).stdout  # what sourcing the defs exports
    env = dict(item.split("=", 1) for item in sourced.split("\0") if "=" in item)
    assert env["MCJAX_PROFILE_DIR"].startswith("/mnt/mcjax") and env["MCJAX_NUMBERING"] == "platform"
    try:
        done = run(["bash", root / "cluster/quickstart.sh", "--processes", "2"], env, root, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert calls(log) == [], "the quickstart reached gcloud"
        seen = json.loads((state / "seen-cluster.json").read_text())
        assert seen["provider"] == "local" and seen["numbering"] == "kernel-last" and seen["kernel_env"] == {}
        assert seen["profile_dir"] == str(state / "profile_mcjax") and seen["jax_cache_dir"] == str(state / "jax_cache")
        kernel = dict(line.split("=", 1) for line in (state / "kernel.env").read_text().splitlines())
        assert kernel["JAX_COMPILATION_CACHE_DIR"] == str(state / "jax_cache")
        assert "local cluster 'qs-" in done.stdout and "stopped" in done.stdout
        assert "the notebook took" in done.stdout
        assert not list((state / "pids").glob("*.pid")) and not (state / "cluster.json").exists()
    finally:
        _kill_leftovers(state, f"qs-{os.getpid()}")


@pytest.mark.slow
def test_local_platform_numbering(tmp_path):
    """--numbering platform: each engine i has Slurm's variables with SLURM_PROCID=i and the port;
    cluster.json's kernel_env has them for process 0; stop leaves nothing."""
    pytest.importorskip("ipyparallel")
    state = tmp_path / "state"
    cluster_id = f"plat-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_"))}
    env.update(MCJAX_STATE=str(state), MCJAX_PYTHON=sys.executable, MCJAX_CLUSTER_ID=cluster_id,
               MCJAX_COORDINATOR_PORT="45123", MCJAX_START_TIMEOUT="90", MCJAX_PROVIDER="ssh")
    try:
        done = run([ROOT / "mcjax_setup.sh", "--local", "3", "--numbering", "platform"], env, ROOT, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        info = json.loads((state / "cluster.json").read_text())
        assert info["numbering"] == "platform" and info["engines"] == 2 and info["provider"] == "local"
        slurm = dict(SLURM_JOB_ID=info["kernel_env"]["SLURM_JOB_ID"], SLURM_STEP_NODELIST="localhost",
                     SLURM_NTASKS="3", SLURM_STEP_NUM_NODES="3", JAX_COORDINATOR_PORT="45123")
        assert info["kernel_env"] == dict(slurm, SLURM_PROCID="0", SLURM_LOCALID="0")
        assert info["coordinator_port"] == 45123 and info["jax_cache_dir"] == str(state / "jax_cache")
        for i in (1, 2):
            pid = int((state / "pids" / f"engine-{i}.pid").read_text())
            environ = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
            assert {k: environ.get(k) for k in [*slurm, "SLURM_PROCID", "SLURM_LOCALID"]} == dict(
                slurm, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)), environ
            assert environ["JAX_COMPILATION_CACHE_DIR"] == str(state / "jax_cache")
            assert environ["JAX_PLATFORMS"] == "cpu"
        assert state.stat().st_mode & 0o777 == 0o700 and (state / "logs").stat().st_mode & 0o777 == 0o700
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in (state / "logs").iterdir())
        pids = [int(p.read_text()) for p in (state / "pids").glob("*.pid")]
        # stop follows the state folder: its recorded cluster id, whatever the environment says
        stop = run([ROOT / "mcjax_setup.sh", "--stop"], dict(env, MCJAX_CLUSTER_ID="another", MCJAX_PROVIDER="gcloud"),
                   ROOT, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert f"local cluster '{cluster_id}' stopped" in stop.stdout, stop.stdout
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)]
        assert (state / "jax_cache").is_dir()  # the cache outlives the cluster
    finally:
        _kill_leftovers(state, cluster_id)


# ----------------------------------------------------------------------------- named clusters

def test_forget_a_cluster_whose_hosts_are_gone_and_keep_others_by_name(tmp_path):
    """The hosts do not answer (the fake ssh fails): --stop keeps the record, --forget says what it
    forgets and removes it. Another cluster is refused in a folder holding a record, kept with --name."""
    bin_dir, log = fake_tools(tmp_path)
    env = base_env(tmp_path, bin_dir, **PROVIDERS["ssh"])
    run([ROOT / "mcjax_setup.sh", "--steps", "check"], env, ROOT)
    record = tmp_path / "state" / "setup.env"
    assert record.exists()
    other = base_env(tmp_path, bin_dir, **dict(PROVIDERS["ssh"], MCJAX_HOST_LIST="gpu-7 gpu-8",
                                               MCJAX_INTERNAL_IPS="10.0.0.17 10.0.0.18"))
    refused = run([ROOT / "mcjax_setup.sh", "--steps", "check"], other, ROOT)
    assert refused.returncode == 1 and "records another cluster (ssh" in refused.stderr and "--name" in refused.stderr
    named = run([ROOT / "mcjax_setup.sh", "--name", "second", "--steps", "check"], other, ROOT)
    assert named.returncode == 1 and (tmp_path / "state" / "clusters" / "second" / "setup.env").exists()
    assert "gpu-7" in (tmp_path / "state" / "clusters" / "second" / "setup.env").read_text()
    stop = run([ROOT / "mcjax_setup.sh", "--stop"], base_env(tmp_path, bin_dir), ROOT)
    assert stop.returncode == 1 and "--forget" in stop.stderr and record.exists()
    log.write_text("")
    forget = run([ROOT / "mcjax_setup.sh", "--forget"], base_env(tmp_path, bin_dir), ROOT)
    assert forget.returncode == 0, forget.stdout + forget.stderr
    assert "provider ssh" in forget.stdout and "hosts gpu-0 gpu-1 admin@gpu-2" in forget.stdout
    assert "internal IPs 10.0.0.10 10.0.0.11 10.0.0.12" in forget.stdout and "nothing is stopped" in forget.stdout
    assert not record.exists() and calls(log) == []
    again = run([ROOT / "mcjax_setup.sh", "--forget"], base_env(tmp_path, bin_dir), ROOT)
    assert again.returncode == 0 and "nothing to forget" in again.stdout


@pytest.mark.slow
def test_two_named_local_clusters_both_stop_cleanly(tmp_path):
    pytest.importorskip("ipyparallel")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCJAX_", "SLURM_"))}
    env.update(MCJAX_STATE=str(tmp_path / "state"), MCJAX_PYTHON=sys.executable, MCJAX_START_TIMEOUT="120")
    names = [f"a{os.getpid()}", f"b{os.getpid()}"]
    try:
        for name in names:
            done = run([ROOT / "mcjax_setup.sh", "--name", name, "--local", "2"], env, ROOT, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
        pids = {name: [int(p.read_text()) for p in (tmp_path / "state" / "clusters" / name / "pids").glob("*.pid")]
                for name in names}
        assert all(len(p) == 2 for p in pids.values()) and all(_alive(p) for ps in pids.values() for p in ps)
        for name in names:
            stop = run([ROOT / "mcjax_setup.sh", "--name", name, "--stop"], env, ROOT, timeout=120)
            assert stop.returncode == 0 and f"local cluster '{name}' stopped" in stop.stdout, stop.stdout + stop.stderr
            deadline = time.monotonic() + 10
            while any(_alive(p) for p in pids[name]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [p for p in pids[name] if _alive(p)]
    finally:
        for name in names:
            _kill_leftovers(tmp_path / "state" / "clusters" / name, name)
