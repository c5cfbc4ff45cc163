#!/usr/bin/env python3
"""Fake ssh, gcloud, srun, scontrol and TPU-metadata curl for the namespace harness (tests/netns).

Installed as symlinks named after the tool in ``<harness>/bin``; the harness's ``hosts.json`` (one
folder up) maps host names, addresses, TPU workers and Slurm nodes onto namespaces. A command
reaches its host as a login would: ``nsenter`` into its namespaces, a clean environment (HOME,
USER, PATH), the home folder as working directory. The fake ssh checks host-to-host logins
(``-i KEY``) as sshd would: the key must be in the target's ``authorized_keys`` (with its
``from=`` matching the caller's address) and, under ``StrictHostKeyChecking=yes``, the target's host
key must be in the known hosts file given. Stdlib only: it runs with any python3.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[0]).absolute().parent.parent
SSH_VALUE_FLAGS = set("BbcDEeFIiJLlmOopQRSWw")
SRUN_SHORT = {"-w": "nodelist", "-N": "nodes", "-n": "ntasks", "-c": "cpus-per-task", "-J": "job-name"}


def fail(tool: str, message: str, status: int) -> None:
    print(f"{tool}: {message}", file=sys.stderr)
    sys.exit(status)


def harness_map() -> dict:
    return json.loads((ROOT / "hosts.json").read_text())


def here(data: dict) -> dict:
    """The harness host this process runs in (the client outside any host too)."""
    net = os.readlink("/proc/self/ns/net")
    return next((h for h in data["hosts"] + [data["client"]] if h["net"] == net), data["client"])


def login(data: dict, host: dict, argv: list[str], env: dict[str, str], cwd: str | None = None) -> None:
    """Replace this process by ``argv`` on ``host`` as the harness's user, with exactly ``env``."""
    if os.geteuid() != 0:
        fail(Path(sys.argv[0]).name, "the harness's tools switch namespaces as root; this process is not", 255)
    user = [] if data["uid"] == 0 else ["setpriv", f"--reuid={data['uid']}", f"--regid={data['uid']}", "--clear-groups"]
    line = ["nsenter", "-t", str(host["pid"]), "-n", "-u", "-m", "--", *user,
            "env", "-i", "-C", cwd or data["home"], *[f"{k}={v}" for k, v in env.items()], *argv]
    os.execvp("nsenter", line)


def login_env(data: dict) -> dict[str, str]:
    return {"HOME": data["home"], "USER": data["user"], "LOGNAME": data["user"], "SHELL": "/bin/bash",
            "PATH": data["path"], "LANG": "C.UTF-8"}


def find_host(data: dict, address: str) -> dict | None:
    return next((h for h in data["hosts"] if address in (h["address"], h["name"])), None)


def parse_ssh(args: list[str]) -> tuple[dict[str, str], list[str], str, list[str]]:
    """ssh's command line: its -o options (and -i as IdentityFile), flags, destination, command."""
    opts: dict[str, str] = {}
    flags: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i][1:2]
        value = args[i][2:] or (args[i + 1] if flag in SSH_VALUE_FLAGS and i + 1 < len(args) else "")
        if flag in SSH_VALUE_FLAGS and not args[i][2:]:
            i += 1
        if flag == "o":
            key, _, val = value.partition("=")
            opts[key.strip()] = val.strip()
        elif flag == "i":
            opts["IdentityFile"] = value
        else:
            flags.append(flag)
        i += 1
    if i >= len(args):
        fail("ssh", "no destination", 255)
    return opts, flags, args[i], args[i + 1:]


def expand(path: str) -> Path:
    return Path(os.path.expanduser(path))


def key_accepted(data: dict, target: dict, key_file: str, caller: dict) -> str:
    """Why sshd on ``target`` would refuse the key in ``key_file`` from ``caller`` ("": accepted)."""
    try:
        pub = " ".join(Path(str(expand(key_file)) + ".pub").read_text().split()[:2])
    except OSError:
        return f"no key {key_file}"
    authorized = ROOT / "homes" / target["home"] / ".ssh" / "authorized_keys"
    lines = authorized.read_text().splitlines() if authorized.exists() else []
    for line in lines:
        if pub not in line:
            continue
        match = re.match(r'from="([^"]*)"', line)
        if match is None or any(fnmatch.fnmatch(caller["address"], p) for p in match.group(1).split(",")):
            return ""
        return f"key accepted only from {match.group(1)}, not {caller['address']}"
    return f"key not in {target['name']}'s authorized_keys"


def host_key_known(target: dict, known_file: str) -> bool:
    """Whether ``known_file`` holds ``target``'s host key under its address."""
    key = " ".join((ROOT / "etc_ssh" / target["name"] / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    path = expand(known_file)
    lines = path.read_text().splitlines() if path.exists() else []
    return any(line.split()[:1] == [target["address"]] and key in line for line in lines)


def ssh(args: list[str]) -> None:
    data = harness_map()
    opts, flags, dest, command = parse_ssh(args)
    target = find_host(data, dest.rpartition("@")[2])
    if target is None:
        fail("ssh", f"Could not resolve hostname {dest.rpartition('@')[2]}: Name or service not known", 255)
    if "N" in flags or not command:
        fail("ssh", "the harness's ssh runs commands only (no shells, no forwarding)", 255)
    user = dest.rpartition("@")[0] or os.environ.get("USER", "root")
    if user != data["user"]:
        fail("ssh", f"{dest}: Permission denied (publickey) [the hosts' user is {data['user']}, not {user}]", 255)
    caller = here(data)
    if "IdentityFile" in opts:
        why = key_accepted(data, target, opts["IdentityFile"], caller)
        if why:
            fail("ssh", f"{dest}: Permission denied (publickey) [{why}]", 255)
        if opts.get("StrictHostKeyChecking") == "yes" and not host_key_known(
                target, opts.get("UserKnownHostsFile", "~/.ssh/known_hosts")):
            fail("ssh", f"Host key verification failed ({dest} not in {opts.get('UserKnownHostsFile')})", 255)
    login(data, target, ["bash", "-c", " ".join(command)], login_env(data))


def gcloud(args: list[str]) -> None:
    """``gcloud compute tpus tpu-vm ssh NAME --worker=I --command=CMD`` onto the TPU's worker I."""
    if args[:4] != ["compute", "tpus", "tpu-vm", "ssh"] or len(args) < 5:
        fail("gcloud", f"the harness's gcloud knows only 'compute tpus tpu-vm ssh', not {' '.join(args[:4])}", 2)
    data = harness_map()
    name, opts = args[4], dict(a[2:].partition("=")[::2] for a in args[5:] if a.startswith("--"))
    workers = data.get("tpus", {}).get(name)
    if workers is None:
        fail("gcloud", f"ERROR: (gcloud.compute.tpus.tpu-vm.ssh) NOT_FOUND: TPU '{name}' does not exist", 1)
    worker = opts.get("worker", "0")
    if not worker.isdigit() or int(worker) >= len(workers):
        fail("gcloud", f"ERROR: worker {worker} of TPU '{name}' does not exist ({len(workers)} workers)", 1)
    if "command" not in opts:
        fail("gcloud", "the harness's gcloud runs commands only (--command)", 2)
    login(data, find_host(data, workers[int(worker)]), ["bash", "-c", opts["command"]], login_env(data))


def curl(args: list[str]) -> None:
    """The TPU metadata's worker list, answered from the harness map; anything else: the real curl."""
    if not any(a.endswith("/attributes/worker-network-endpoints") for a in args):
        os.execv("/usr/bin/curl", ["curl", *args])
    data = harness_map()
    me = here(data)["name"]
    for workers in data.get("tpus", {}).values():
        if me in workers:
            hosts = [find_host(data, w) for w in workers]
            print(",".join(f"unknown:unknown:{h['address']}" for h in hosts))
            return
    fail("curl", "(22) The requested URL returned error: 404", 22)


def expand_nodes(spec: str) -> list[str]:
    """Slurm's node list syntax, as far as the harness uses it: a,b,node[0-2,5]."""
    out = []
    for prefix, body, plain in re.findall(r"([^,\[]+)\[([^\]]*)\]|([^,\[\]]+)", spec):
        if plain:
            out.append(plain)
            continue
        for part in body.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            out += [f"{prefix}{i:0{width}d}" for i in range(int(first), int(last or first) + 1)]
    return out


def scontrol(args: list[str]) -> None:
    if args[:2] != ["show", "hostnames"] or len(args) != 3:
        fail("scontrol", f"the harness's scontrol knows only 'show hostnames LIST', not {' '.join(args)}", 1)
    print("\n".join(expand_nodes(args[2])))


def parse_srun(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's options (--name=value, --flag, -w NODE) and the command after them."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in SRUN_SHORT:
            opts[SRUN_SHORT[args[i]]] = args[i + 1]
            i += 2
            continue
        key, _, value = args[i].lstrip("-").partition("=")
        opts[key] = value
        i += 1
    return opts, args[i:]


def srun_env(data: dict, opts: dict[str, str], node: str) -> dict[str, str]:
    """A step's environment: --export's variables (all without it), SLURM_* and the step's own."""
    export = opts.get("export", "ALL")
    names = os.environ if export.split(",")[0] == "ALL" else export.split(",")
    env = {k: os.environ[k] for k in names if k in os.environ and export != "NONE"}
    env.update({k: v for k, v in os.environ.items() if k.startswith("SLURM_")})
    job = data["slurm"]
    env.update({"SLURM_JOB_ID": job["job"], "SLURM_JOB_NODELIST": job["nodelist"], "SLURM_STEP_NODELIST": node,
                "SLURMD_NODENAME": node, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
                "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0"})
    return env


def srun(args: list[str]) -> None:
    """One task on one node of the harness's allocation (``--jobid``, ``--nodelist``), in the caller's folder."""
    data = harness_map()
    opts, command = parse_srun(args)
    job = data.get("slurm")
    if job is None or opts.get("jobid", os.environ.get("SLURM_JOB_ID")) != job["job"]:
        fail("srun", f"error: Unable to confirm allocation for job {opts.get('jobid')}: Invalid job id specified", 1)
    nodes = expand_nodes(opts.get("nodelist", job["nodelist"]))
    if len(nodes) != 1 or nodes[0] not in expand_nodes(job["nodelist"]) or not command:
        fail("srun", f"error: the harness's srun runs one command on one node of {job['nodelist']}, not {nodes}", 1)
    login(data, find_host(data, nodes[0]), command, srun_env(data, opts, nodes[0]), cwd=os.getcwd())


def main() -> None:
    tool = Path(sys.argv[0]).name
    tools = {"ssh": ssh, "gcloud": gcloud, "curl": curl, "scontrol": scontrol, "srun": srun}
    if tool not in tools:
        fail("fake_tools.py", f"run as one of {', '.join(tools)} (a symlink of that name), not {tool}", 2)
    tools[tool](sys.argv[1:])


if __name__ == "__main__":
    main()
