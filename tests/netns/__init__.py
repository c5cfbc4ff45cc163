"""One machine made to look like several real hosts, for the cluster scripts' end-to-end tests.

Each host is a network, UTS and mount namespace held open by a sleeping process
(``unshare --net --uts --mount``) and entered with ``nsenter``: its own address on a veth into a
bridge (the bridge lives in a namespace of its own, so nothing is added to this machine's
network), its own hostname, its own HOME (a folder bind-mounted on the same path in every host,
or one folder for all of them: a shared home), its own /etc/hosts and ssh host keys, and a
firewall (nftables) that lets the other hosts reach only the documented port range
(``MCJAX_PORTS``) and the collectives' ephemeral ports, which the harness narrows per host.
The "client" (the user's machine, where ``mcjax_setup.sh`` runs) is one more such namespace.

``ssh``, ``gcloud``, ``srun``, ``scontrol`` and the TPU metadata ``curl`` are fakes on PATH
(``tests/netns/fake_tools.py``) that map a host name, address, TPU worker or Slurm node onto its
namespace and run the command there as a login would; the fake ssh checks host 0's key the way
sshd would (``authorized_keys``, its ``from=``, the known hosts file). Logins are root's, or those
of a user without sudo (``Harness(user=...)``); the fakes switch namespaces as root, so such a
user's own host-to-host ssh (``cluster_restart`` on host 0) is not simulated.

Every namespace dies with its holder process, and with it the veths, the bridge, the mounts and
the firewall: ``Harness.close`` kills the holders and every process left inside them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent / "fake_tools.py"
FAKES = ("ssh", "gcloud", "srun", "scontrol", "curl")
EPHEMERAL = (40000, 40999)  # each host's ip_local_port_range: the collectives' (Gloo's) ports
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
USER_ID = 1065  # the uid and gid of a harness user other than root


def available() -> str:
    """Why this machine cannot run the harness ("" when it can): root, unshare, nsenter, ip, nft."""
    if os.geteuid() != 0:
        return "the namespace harness needs root (unshare --net, veths, mounts)"
    for tool in ("unshare", "nsenter", "ip", "nft", "ss", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (tests/install_browser.sh installs nftables)"
    return ""


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace "host": its name, address, holder process and (outside) home folder."""

    name: str
    address: str
    pid: int
    home: Path


def _ns_id(pid: int | str, kind: str = "net") -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _hold() -> subprocess.Popen:
    """A sleeping process in new network, UTS and mount namespaces (mounts private to it)."""
    proc = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--propagation", "private",
                             "sleep", "infinity"], stdin=subprocess.DEVNULL)
    mine = _ns_id("self")
    deadline = time.monotonic() + 10
    while _ns_id(proc.pid) == mine:  # unshare has not switched yet: nsenter would enter ours
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"unshare did not start a namespace (exit status {proc.poll()})")
        time.sleep(0.01)
    return proc


def nsenter(pid: int, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` (as root, this environment) in the namespaces of ``pid``."""
    out = subprocess.run(["nsenter", "-t", str(pid), "-n", "-u", "-m", "--", *cmd],
                         capture_output=True, text=True, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in namespace {pid}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def port_range(repo: Path) -> tuple[int, int] | None:
    """The documented range of every listener between hosts (mcjax_defs.sh's MCJAX_PORTS), if any."""
    out = subprocess.run(["bash", "-c", '. ./mcjax_defs.sh && printf %s "${MCJAX_PORTS:-}"'], cwd=repo,
                         capture_output=True, text=True, env={"HOME": "/nonexistent", "PATH": LOGIN_PATH})
    first, _, last = out.stdout.strip().partition("-")
    if not (first.isdigit() and last.isdigit()):
        return None
    return int(first), int(last)


def ruleset(ports: tuple[int, int] | None) -> str:
    """The hosts' nftables input rules: loopback, replies, ping, the range and the ephemeral ports."""
    allowed = f"{EPHEMERAL[0]}-{EPHEMERAL[1]}"
    if ports is not None:
        allowed = f"{ports[0]}-{ports[1]}, {allowed}"
    return "\n".join([
        "table inet mcjax_harness {",
        "  chain input {",
        "    type filter hook input priority 0; policy drop;",
        "    iif lo accept",
        "    ct state established,related accept",
        "    ip protocol icmp accept",
        f"    tcp dport {{ {allowed} }} accept",
        "  }",
        "}",
        "",
    ])


def shared_venv(folder: Path, source: Path) -> Path:
    """A venv at ``folder`` for every host: this interpreter's base Python, this environment's
    packages (one ``.pth`` line, so its own editable dsr1 is not loaded) and dsr1 from ``source``
    first. Setup's venv step, which downloads uv and CPython, is left out where this is used."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(folder)], check=True)
    purelib = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    site = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "mcjax_harness.pth").write_text(f"{source}\n{purelib}\n")
    for script in Path(sys.prefix, "bin").glob("jupyter*"):  # `python -m jupyter lab` runs jupyter-lab
        (folder / "bin" / script.name).symlink_to(script)
    return folder


class Harness:
    """``len(names)`` namespace hosts on one bridge plus the "client"; a context manager.

    ``hostnames`` (default: ``names``) may repeat (cloned hosts); ``shared_home`` gives every
    host, the client included, one home folder (NFS homes, Slurm); ``ports``: the range the
    firewall lets in (None: none but the ephemeral ports); ``user``: who logins on the hosts are
    (another than root: a user of its own, without sudo, who owns the homes)."""

    def __init__(self, names: list[str], hostnames: list[str] | None = None, shared_home: bool = False,
                 ports: tuple[int, int] | None = None, subnet: str = "10.65.0", user: str = "root"):
        self.names, self.hostnames, self.user = names, hostnames or names, user
        self.uid = 0 if user == "root" else USER_ID
        self.shared_home, self.ports, self.subnet = shared_home, ports, subnet
        self.root = Path(tempfile.mkdtemp(prefix="dsr1-netns-"))
        self.root.chmod(0o755)
        self.procs: list[subprocess.Popen] = []
        self.namespaces: list[str] = []
        self.hosts: list[Host] = []
        self.client: Host | None = None

    def __enter__(self) -> Harness:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def home(self) -> Path:
        """HOME on every host (each host's own folder is mounted there)."""
        return self.root / "home"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def start(self) -> None:
        """The bridge, the hosts, the client, the fake tools and their map (hosts.json)."""
        (self.root / "homes").mkdir()
        self.home.mkdir()
        self.bin.mkdir()
        for tool in FAKES:
            (self.bin / tool).symlink_to(TOOLS)
        switch = self._holder()
        nsenter(switch.pid, "sh", "-c", "ip link add br0 type bridge && ip link set br0 up && ip link set lo up")
        self.switch = switch.pid
        addresses = [f"{self.subnet}.{10 + i}" for i in range(len(self.names))]
        self.etc_hosts = self._etc_hosts(addresses + [f"{self.subnet}.2"])
        for i, (name, address) in enumerate(zip(self.names, addresses, strict=True)):
            self.hosts.append(self._host(name, self.hostnames[i], address, f"p{i}"))
        self.client = self._host("client", "client", f"{self.subnet}.2", "pc", firewall=False)
        self.write_map()

    def _holder(self) -> subprocess.Popen:
        proc = _hold()
        self.procs.append(proc)
        self.namespaces.append(_ns_id(proc.pid))
        return proc

    def _etc_hosts(self, addresses: list[str]) -> list[str]:
        """/etc/hosts lines every host has: each host's name and (unless cloned) its hostname."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        names = [[n] for n in self.names] + [["client"]]
        if len(set(self.hostnames)) == len(self.hostnames):  # cloned hostnames resolve to nothing
            names = [sorted({n, hn}) for n, hn in zip(self.names, self.hostnames, strict=True)] + [["client"]]
        return lines + [f"{a} {' '.join(n)}" for a, n in zip(addresses, names, strict=True)]

    def _host(self, name: str, hostname: str, address: str, port: str, firewall: bool = True) -> Host:
        """One namespace host: hostname, veth + address on the bridge, firewall, home, /etc files."""
        pid = self._holder().pid
        home = self.root / "homes" / ("shared" if self.shared_home else name)
        home.mkdir(exist_ok=True)
        etc_hosts = self.root / f"etc_hosts_{name}"  # its own hostname resolves to its address, as in a VPC
        etc_hosts.write_text("\n".join(self.etc_hosts + [f"{address} {hostname}"]) + "\n")
        ssh_dir = self.root / "etc_ssh" / name
        shutil.copytree("/etc/ssh", ssh_dir)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{hostname}",
                        "-f", str(ssh_dir / "ssh_host_ed25519_key")], check=True)
        nsenter(pid, "hostname", hostname)
        nsenter(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", str(pid))
        nsenter(self.switch, "ip", "link", "set", port, "master", "br0", "up")
        setup = [f"ip addr add {address}/24 dev eth0", "ip link set eth0 up", "ip link set lo up",
                 f"echo '{EPHEMERAL[0]} {EPHEMERAL[1]}' > /proc/sys/net/ipv4/ip_local_port_range",
                 f"mount --bind {home} {self.home}", f"mount --bind {etc_hosts} /etc/hosts",
                 f"mount --bind {ssh_dir} /etc/ssh"]
        nsenter(pid, "sh", "-ec", " && ".join(setup + self._user_mounts(name, home)))
        if firewall:
            nsenter(pid, "nft", "-f", "-", input=ruleset(self.ports))
        return Host(name, address, pid, home)

    def _user_mounts(self, name: str, home: Path) -> list[str]:
        """For a user other than root: its /etc/passwd and /etc/group lines, its home, and a /root
        it may pass through to this interpreter (/root is 0700 here; only its .pyenv is kept)."""
        if self.uid == 0:
            return []
        etc = self.root / "etc_users" / name
        etc.mkdir(parents=True, exist_ok=True)
        line = {"passwd": f"{self.user}:x:{self.uid}:{self.uid}::{self.home}:/bin/bash",
                "group": f"{self.user}:x:{self.uid}:"}
        for f in ("passwd", "group"):
            (etc / f).write_text(Path("/etc", f).read_text() + line[f] + "\n")
        os.chown(home, self.uid, self.uid)
        stash = self.root / "stash"
        stash.mkdir(exist_ok=True)
        return [f"mount --bind {etc / 'passwd'} /etc/passwd", f"mount --bind {etc / 'group'} /etc/group",
                f"mount --bind /root/.pyenv {stash}", "mount -t tmpfs -o mode=755 tmpfs /root",
                "mkdir /root/.pyenv", f"mount --move {stash} /root/.pyenv"]

    def write_map(self, **extra) -> None:
        """hosts.json, what the fake tools read: hosts, client, HOME, PATH and ``extra`` (tpus, ...)."""
        def entry(h: Host) -> dict:
            return {"name": h.name, "address": h.address, "pid": h.pid, "net": _ns_id(h.pid), "home": h.home.name}
        old = json.loads((self.root / "hosts.json").read_text()) if (self.root / "hosts.json").exists() else {}
        data = {**old, "hosts": [entry(h) for h in self.hosts], "client": entry(self.client),
                "home": str(self.home), "path": f"{self.bin}:{LOGIN_PATH}", "user": self.user, "uid": self.uid,
                **extra}
        (self.root / "hosts.json").write_text(json.dumps(data, indent=1))

    def login_env(self, **extra: str) -> dict[str, str]:
        """The environment of a login on a host: HOME, USER, PATH (the fakes first), no proxies."""
        return {"HOME": str(self.home), "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash",
                "PATH": f"{self.bin}:{LOGIN_PATH}", "LANG": "C.UTF-8", **extra}

    def login_line(self, host: Host, command: str, **env: str) -> list[str]:
        """The command line of ``bash -c command`` on ``host`` as root logged in there (its HOME, the
        login environment + ``env``)."""
        assignments = [f"{k}={v}" for k, v in self.login_env(**env).items()]
        return ["nsenter", "-t", str(host.pid), "-n", "-u", "-m", "--",
                "env", "-i", "-C", str(self.home), *assignments, "bash", "-c", command]

    def run(self, host: Host, command: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
        """Run :meth:`login_line`; its exit status and output."""
        return subprocess.run(self.login_line(host, command, **env), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def listeners(self, host: Host) -> list[str]:
        """The local addresses of ``host``'s listening TCP sockets (``ss -ltn``), e.g. 10.65.0.10:8476."""
        out = nsenter(host.pid, "ss", "-ltnH").stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def members(self) -> list[int]:
        """Every process inside one of the harness's namespaces (holders included)."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if _ns_id(entry) in self.namespaces:
                        found.append(int(entry))
                except OSError:
                    pass  # gone meanwhile, or a kernel thread
        return found

    def close(self) -> None:
        """Kill every process in the namespaces (so they, their links and mounts go), remove the folder."""
        for _ in range(50):
            left = self.members()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in self.procs:
            proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
