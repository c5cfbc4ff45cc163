"""The cluster's smoke check: run on host 0 at the end of ``./mcjax_setup.sh`` and by
``./mcjax_setup.sh --check``, before anyone opens Jupyter.

Through the ipyparallel controller it asks every engine, and this process (host 0, where the
notebook kernel runs), to

1. import ``dsr1`` and say which file and version it got (the installed package, never the source
   folder of the shared file system as an empty namespace package);
2. report its Python and the installed ``jax`` and ``jaxlib`` distributions, compared against one
   lock (the requirements lock the hosts' venvs were installed from; without one, host 0's own
   environment);
3. start a fresh Python of its environment that joins ``jax.distributed`` across all processes
   (numbered as the notebook numbers them), computes one ``psum`` over every device, checks the
   value and shuts JAX down again: the engines themselves never start JAX, so the notebook can
   still initialize them.

It prints a report per host and exits non-zero on any mismatch::

    python -P -m dsr1.workbench.smoke [--state DIR] [--lock FILE] [--timeout S]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import ports
from .process import address_towards

LOCKED = ("jax", "jaxlib")


# ----------------------------------------------------------------------------- one process

def host_report(controller_ip: str = "127.0.0.1") -> dict[str, Any]:
    """What this process runs: host, Python, the installed jax and jaxlib distributions, where
    ``dsr1`` comes from, whether JAX already started its devices here, and the address on which
    this host reaches the controller."""
    report: dict[str, Any] = {
        "hostname": socket.gethostname(), "host_index": os.environ.get("MCJAX_HOST_INDEX"), "pid": os.getpid(),
        "executable": sys.executable, "python": sys.version.split()[0], "cwd": os.getcwd(),
        "address": address_towards(controller_ip),
    }
    for name in LOCKED:
        try:
            report[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            report[name] = "not installed"
    try:
        dsr1 = importlib.import_module("dsr1")
        report["dsr1"] = getattr(dsr1, "__version__", None)
        report["dsr1_file"] = getattr(dsr1, "__file__", None) or f"namespace package {list(dsr1.__path__)}"
        report["dsr1_api"] = callable(getattr(dsr1, "make_mesh", None))
    except Exception as e:  # noqa: BLE001 - reported per host
        report.update(dsr1=None, dsr1_file=f"import failed: {type(e).__name__}: {e}", dsr1_api=False)
    report["jax_started"] = _jax_started()
    return report


def _jax_started() -> bool:
    """Whether JAX has started its backends in this process (a notebook uses it)."""
    if "jax" not in sys.modules:
        return False
    from .jax_internals import backends_are_initialized

    return backends_are_initialized()


def free_port(address: str) -> int:
    """A port of the cluster's range (``$MCJAX_PORTS``) free on ``address`` now (for the check's
    coordinator)."""
    return ports.free_port(address)


def probe_host_0(host_0: str, host_0_ports: list[int], address: str) -> tuple[list[str], list[int]]:
    """(On an engine) Whether this host reaches ``host_0`` on each of ``host_0_ports``, and the
    ports of the range it now listens on at ``address`` (its address towards host 0) for host 0 to
    reach: the problems, the ports."""
    problems = [f"cannot reach host 0 at {why}" for port in host_0_ports if (why := ports.reaches(host_0, port))]
    return problems, [ports.open_probe(address, highest=h) for h in (False, True)]


def _reachability(client: Any, engines: dict[int, dict[str, Any]], controller_ip: str,
                  timeout: float) -> tuple[list[str], list[str]]:
    """The range's lowest and highest free ports, from every engine's host to host 0 and back: the
    report's lines and the failures."""
    low, high = ports.port_range()
    mine = [ports.open_probe(controller_ip, highest=h) for h in (False, True)]
    pending = {e: client[e].apply_async(probe_host_0, controller_ip, mine, r["address"])
               for e, r in engines.items() if r.get("address") not in (None, "?")}
    failures = []
    for e, ar in pending.items():
        try:
            found, theirs = ar.get(timeout=timeout)
        except Exception as error:  # noqa: BLE001 - reported per host
            found, theirs = [f"the port probe failed: {type(error).__name__}: {error}"], []
        found += [f"host 0 cannot reach it at {why}" for port in theirs
                  if (why := ports.reaches(engines[e]["address"], port))]
        failures += [f"{_label(engines[e], e)}: {f}" for f in found]
    verdict = "ok" if not failures else "BLOCKED"
    lines = [f"ports {low}-{high} (MCJAX_PORTS), the lowest and highest free, every host to host 0 and back: "
             f"{verdict}"] + [f"    {f}" for f in failures]
    return lines, failures


def collective(process_id: int, num_processes: int, coordinator: str | None, env: dict[str, str],
               timeout: float) -> dict[str, Any]:
    """Run the collective check in a fresh Python of this environment (this process's JAX stays
    untouched): ``{"ok", "value", "expected", "process_index", "output"}``."""
    command = [sys.executable, "-P", "-m", "dsr1.workbench.smoke", "--worker",
               json.dumps([process_id, num_processes, coordinator, timeout])]
    try:
        done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=timeout + 30)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"ok": False, "output": f"no result within {timeout + 30:.0f}s\n{out[-1500:]}"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("mcjax-smoke "):
            return dict(json.loads(line[len("mcjax-smoke "):]), output="")
    return {"ok": False, "output": f"exit status {done.returncode}\n{(done.stdout + done.stderr)[-1500:]}"}


def _worker(process_id: int, num_processes: int, coordinator: str | None, timeout: float) -> None:
    """The fresh Python of :func:`collective`: join jax.distributed, one psum over every device of
    every process, leave. Prints ``mcjax-smoke {json}``."""
    from .process import initialize

    initialize(process_id, num_processes, coordinator, timeout=timeout)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("all",))
    mine = np.full((jax.local_device_count(),), jax.process_index() + 1, np.int32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")), mine)
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "all"), mesh=mesh, in_specs=P("all"), out_specs=P()))(x)
    value = int(np.asarray(total.addressable_data(0))[0])
    expected = sum(d.process_index + 1 for d in jax.devices())
    result = {"ok": value == expected, "value": value, "expected": expected, "process_index": jax.process_index(),
              "process_count": jax.process_count(), "devices": jax.device_count(), "platform": jax.default_backend()}
    # The result before leaving: the process hosting the coordinator may exit while another is still
    # in its shutdown call, which then aborts that process; the check was already decided.
    print("mcjax-smoke " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------- the lock

def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str | os.PathLike) -> dict[str, str]:
    """The pinned versions of a requirements lock (``name==version`` lines, as ``uv pip compile``
    writes them; hashes and markers ignored), by normalized name; ``python``: the
    ``--python-version`` it was compiled for, when its header says."""
    pins: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        header = re.search(r"--python-version[ =](\d+\.\d+)", line) if line.startswith("#") else None
        if header:
            pins["python"] = header.group(1)
        found = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", line)
        if found:
            pins[_normal(found.group(1))] = found.group(2)
    if not any(name in pins for name in LOCKED):
        raise ValueError(f"{path}: no pinned {' or '.join(LOCKED)} (name==version lines): "
                         "not a lock of the hosts' venv")
    return pins


def problems(reports: dict[str, dict[str, Any]], lock: dict[str, str] | None) -> dict[str, list[str]]:
    """Per process label, what is wrong: dsr1 not importable (or not the installed package), and
    Python / jax / jaxlib against the lock (without one: against the first report, host 0's)."""
    reference = lock or {}
    first = next(iter(reports.values()))
    out: dict[str, list[str]] = {}
    for label, r in reports.items():
        found = []
        if not r.get("dsr1") or not r.get("dsr1_api"):
            found.append(f"dsr1 is not the installed package ({r.get('dsr1_file')}; working directory {r.get('cwd')})")
        if r["python"] == "?":  # nothing else is known of it
            out[label] = found
            continue
        want_python = reference.get("python") or first["python"]
        if not (r["python"] == want_python or r["python"].startswith(want_python + ".")):
            found.append(f"Python {r['python']}, the lock's is {want_python}")
        elif r["python"] != first["python"]:
            found.append(f"Python {r['python']}, host 0's is {first['python']}")
        for name in LOCKED:
            want = reference.get(name, first[name])
            if r[name] != want:
                found.append(f"{name} {r[name]}, {'the lock pins' if name in reference else 'host 0 has'} {want}")
        out[label] = found
    return out


# ----------------------------------------------------------------------------- the cluster

@dataclasses.dataclass
class SmokeReport:
    """The check's result: ``lines`` to print, ``failures`` (empty when the cluster is healthy)."""
    lines: list[str]
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        verdict = ["smoke check: ok"] if self.ok else ["smoke check: FAILED"] + [f"  - {f}" for f in self.failures]
        return "\n".join(self.lines + verdict)


def _label(r: dict[str, Any], engine_id: int | None) -> str:
    who = "this process" if engine_id is None else f"engine {engine_id}"
    return f"host {r.get('host_index') or (0 if engine_id is None else '?')} ({r['hostname']}, {who}, pid {r['pid']})"


def _engine_reports(client: Any, ids: list[int], controller_ip: str, timeout: float) -> dict[int, dict[str, Any]]:
    """host_report on each engine; an engine that cannot even import this module says where it runs."""
    reports = {}
    pending = {e: client[e].apply_async(host_report, controller_ip) for e in ids}
    for e, ar in pending.items():
        try:
            reports[e] = ar.get(timeout=timeout)
        except Exception as error:  # noqa: BLE001 - reported per host
            try:
                cwd = client[e].apply_async(os.getcwd).get(timeout=timeout)
            except Exception:  # noqa: BLE001
                cwd = "?"
            reports[e] = {"hostname": "?", "host_index": None, "pid": "?", "python": "?", "cwd": cwd,
                          "dsr1": None, "dsr1_api": False, "jax_started": False, "address": "?",
                          "dsr1_file": f"cannot run dsr1.workbench.smoke: {type(error).__name__}: {error}",
                          **{name: "?" for name in LOCKED}}
    return reports


def _numbering(info: dict[str, Any], engines: dict[int, dict[str, Any]], here: dict[str, Any],
               client: Any) -> tuple[dict[int, tuple[int, str | None, dict[str, str]]], tuple]:
    """Each engine's (process id, coordinator, environment) and this process's, as the notebook
    numbers them (cluster.json's ``numbering``), with a coordinator port free now."""
    order = sorted(engines, key=lambda e: (engines[e]["host_index"] is None, int(engines[e]["host_index"] or 0), e))
    n = len(order) + 1
    if info.get("numbering") == "platform":
        port = free_port(info.get("controller_ip") or "127.0.0.1")
        env = {"JAX_COORDINATOR_PORT": str(port)}
        kernel_env = {k: str(v) for k, v in (info.get("kernel_env") or {}).items()}
        mine = (0, None, {**kernel_env, **env, "JAX_COORDINATOR_BIND_ADDRESS": f"{info.get('controller_ip')}:{port}"})
        return {e: (rank + 1, None, env) for rank, e in enumerate(order)}, mine
    first = engines[order[0]]
    port = client[order[0]].apply_async(free_port, first["address"]).get(timeout=30)
    coordinator = f"{first['address']}:{port}"
    return {e: (rank, coordinator, {}) for rank, e in enumerate(order)}, (n - 1, coordinator, {})


def check(state: str | os.PathLike, lock_path: str | os.PathLike | None = None, *,
          timeout: float = 180.0) -> SmokeReport:
    """The smoke check of the cluster that ``state``'s cluster.json describes (see the module)."""
    import ipyparallel as ipp

    info = json.loads((Path(state) / "cluster.json").read_text())
    lock = read_lock(lock_path) if lock_path else None
    connection = Path(info["profile_dir"]) / "security" / f"ipcontroller-{info['cluster_id']}-client.json"
    client = ipp.Client(str(connection), timeout=timeout)
    try:
        return _check(client, info, lock, lock_path, timeout)
    finally:
        client.close()


def _check(client: Any, info: dict[str, Any], lock: dict[str, str] | None, lock_path: Any,
           timeout: float) -> SmokeReport:
    n_engines = int(info["engines"])
    failures: list[str] = []
    try:
        client.wait_for_engines(n_engines, timeout=timeout, interactive=False)
    except TimeoutError:
        failures.append(f"only {len(client.ids)} of {n_engines} engines are registered with the controller")
    ids = sorted(client.ids)
    controller_ip = info.get("controller_ip") or "127.0.0.1"
    engines = _engine_reports(client, ids, controller_ip, timeout)
    here = host_report(controller_ip)
    by_host = sorted(engines, key=lambda e: (engines[e]["host_index"] is None, int(engines[e]["host_index"] or 0), e))
    reports = {_label(here, None): here} | {_label(engines[e], e): engines[e] for e in by_host}
    reference = f"the lock {lock_path}" if lock else "host 0's environment (no lock given)"
    lines = [f"smoke check: {len(ids)} engines + this process on host 0 ({info.get('numbering')} numbering); "
             f"versions against {reference}"]
    for label, found in problems(reports, lock).items():
        r = reports[label]
        lines.append(f"{label}: Python {r['python']}, jax {r['jax']}, jaxlib {r['jaxlib']}, dsr1 {r['dsr1']} "
                     f"from {r['dsr1_file']}: {'ok' if not found else 'MISMATCH'}")
        lines += [f"    {p}" for p in found]
        failures += [f"{label}: {p}" for p in found]
    reach, blocked = _reachability(client, {e: engines[e] for e in by_host}, controller_ip, timeout)
    lines += reach
    failures += blocked
    busy = [label for label, r in reports.items() if r.get("jax_started")]
    if failures:
        lines.append("collective: not run (fix the hosts above first)")
    elif busy:
        lines.append(f"collective: not run: JAX already runs in {', '.join(busy)} (a notebook uses the cluster; "
                     "its health_check covers it, or stop it and run --check again)")
    else:
        lines += _collective(client, info, engines, here, timeout, failures)
    return SmokeReport(lines, failures)


def _collective(client: Any, info: dict[str, Any], engines: dict[int, dict[str, Any]], here: dict[str, Any],
                timeout: float, failures: list[str]) -> list[str]:
    """jax.distributed across every process, one psum; a line per process."""
    plan, mine = _numbering(info, engines, here, client)
    n = len(plan) + 1
    start = time.monotonic()
    pending = {e: client[e].apply_async(collective, pid, n, coordinator, env, timeout)
               for e, (pid, coordinator, env) in plan.items()}
    results = {None: collective(mine[0], n, mine[1], mine[2], timeout)}
    for e, ar in pending.items():
        try:
            results[e] = ar.get(timeout=timeout + 60)
        except Exception as error:  # noqa: BLE001 - reported per host
            results[e] = {"ok": False, "output": f"{type(error).__name__}: {error}"}
    lines = [f"collective: jax.distributed across {n} processes, one psum over every device "
             f"({time.monotonic() - start:.1f}s)"]
    for e, r in sorted(results.items(), key=lambda item: mine[0] if item[0] is None else plan[item[0]][0]):
        label = _label(here if e is None else engines[e], e)
        pid = mine[0] if e is None else plan[e][0]
        if r.get("ok"):
            lines.append(f"  {label}: process {pid}: psum = {r['value']} (expected {r['expected']}, "
                         f"{r['devices']} {r['platform']} devices): ok")
        else:
            got = f"psum = {r['value']}, expected {r['expected']}" if "value" in r else r.get("output", "").strip()
            lines.append(f"  {label}: process {pid}: FAILED: {got}")
            failures.append(f"{label}: the collective check failed (process {pid})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsr1.workbench.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", default=os.environ.get("MCJAX_STATE") or str(Path.home() / ".mcjax"),
                        help="the state folder holding cluster.json (default: $MCJAX_STATE, ~/.mcjax)")
    parser.add_argument("--lock", default=None,
                        help="the requirements lock the hosts were installed from (default: none, host 0's "
                             "environment is the reference)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for each step")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*json.loads(args.worker))
        return 0
    if not (Path(args.state) / "cluster.json").exists():
        print(f"smoke: no cluster.json in {args.state}: no cluster runs from this state folder", file=sys.stderr)
        return 1
    try:
        report = check(args.state, args.lock, timeout=args.timeout)
    except (OSError, ValueError, TimeoutError) as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 1
    print(report, flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    # The functions the engines receive must name this module, not __main__ (ipyparallel sends a
    # module's function by reference): run main() of the imported module.
    sys.exit(importlib.import_module("dsr1.workbench.smoke").main())
