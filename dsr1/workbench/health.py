"""Whether the processes match: same Python environment, versions and devices everywhere
(:func:`health_check`), and the hosts' clock skew (:func:`clock_skew`).
"""

from __future__ import annotations

import dataclasses
import time

from .connection import Cluster
from .engines import engine_targets, probe_everywhere, wait_result
from .process import ClusterError, clock


@dataclasses.dataclass
class HealthReport:
    """What every process runs on; ``problems`` lists the mismatches (empty when healthy)."""
    processes: list[dict]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        cols = ("role", "PROCESS_ID", "hostname", "pid", "python", "jax", "jaxlib", "dsr1", "platform", "local_devices",
                "executable")
        rows = [[str(p.get(c, "")) for c in cols] for p in self.processes]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        lines += ["problems:"] + [f"  - {p}" for p in self.problems] if self.problems else ["healthy"]
        return "\n".join(lines)


def find_problems(processes: list[dict]) -> list[str]:
    """The mismatches between processes (each a probe result with a ``role``)."""
    problems = []
    for key, what in (("environment", "Python environment (sys.prefix, real sys.executable)"),
                      ("python", "Python version"), ("dsr1", "dsr1 version"), ("jax", "jax version"),
                      ("jaxlib", "jaxlib version")):
        values: dict[str, list[str]] = {}
        for p in processes:
            values.setdefault(str(p.get(key)), []).append(p["role"])
        if len(values) > 1:
            problems.append(f"different {what}: " + "; ".join(f"{v} on {', '.join(r)}" for v, r in values.items()))
        problems += [f"{p['role']}: {key} {p[key]}" for p in processes if str(p.get(key, "")).startswith("missing")
                     and len(values) == 1]
    initialized = [p for p in processes if p.get("distributed")]
    if initialized and len(initialized) < len(processes):
        problems.append("jax.distributed is initialized in " + ", ".join(p["role"] for p in initialized)
                        + " but not in " + ", ".join(p["role"] for p in processes if not p.get("distributed")))
    n = len(processes)
    for p in processes:
        if "process_count" in p and p["process_count"] != n:
            problems.append(f"{p['role']}: jax.process_count() is {p['process_count']}, the cluster has {n} processes")
        if "process_index" in p and p.get("PROCESS_ID") is not None and p["process_index"] != p["PROCESS_ID"]:
            problems.append(f"{p['role']}: jax.process_index() is {p['process_index']} "
                            f"but PROCESS_ID is {p['PROCESS_ID']}")
    devices = {p["local_devices"] for p in processes if "local_devices" in p}
    if len(devices) > 1:
        problems.append("different device counts per process: "
                        + ", ".join(f"{p['role']}: {p['local_devices']}" for p in processes if "local_devices" in p))
    if not any(p.get("provider") == "local" for p in processes):
        # One host by its host key (boot id, network namespace), not its name: cloned hosts share one.
        hosts: dict[str, list[dict]] = {}
        for p in processes:
            hosts.setdefault(p.get("host_key") or p["hostname"], []).append(p)
        problems += [f"{', '.join(q['role'] for q in same)} run on the same host {same[0]['hostname']}: one engine "
                     f"per host expected" for same in hosts.values() if len(same) > 1]
    return problems


def health_check(cluster: Cluster, *, timeout: float = 60.0, namespace: dict | None = None,
                 raise_on_problem: bool = True) -> HealthReport:
    """Compare the engines and this kernel: same Python environment (``sys.prefix`` and the
    real ``sys.executable``, so ``venv/bin/python`` and ``venv/bin/python3`` agree), Python, dsr1,
    jax and jaxlib versions, one engine per host (except on a local cluster) and, once ``jax.distributed`` is
    initialized, process count and index and devices per process. Run it after initialize
    (before, devices are not read: reading them would start JAX's backend).

    Raises ClusterError with the report when something differs (``raise_on_problem=False``:
    returns it, see ``report.problems``).
    """
    ids = engine_targets(cluster, None)
    infos, mine = probe_everywhere(cluster, ids, devices=True, timeout=timeout, namespace=namespace)
    processes = [dict(info, role=f"engine {eid}") for eid, info in zip(ids, infos)] + [dict(mine, role="kernel")]
    report = HealthReport(processes=processes, problems=find_problems(processes))
    if report.problems and raise_on_problem:
        raise ClusterError(f"cluster health check failed:\n{report}")
    return report


def clock_skew(cluster: Cluster, *, timeout: float = 30.0) -> dict[str, tuple[float, float]]:
    """Each engine's wall clock minus this host's, in seconds, with its uncertainty (half the
    round trip): ``{"engine 3 (process 1, host h, pid p)": (skew, uncertainty)}``. One engine at a
    time, so each round trip is short."""
    skews = {}
    for eid in engine_targets(cluster, None):
        sent = time.time()
        theirs = wait_result(cluster, cluster.client[eid].apply_async(clock), [eid], timeout)
        received = time.time()
        skews[cluster.describe(eid)] = (theirs - (sent + received) / 2, (received - sent) / 2)
    return skews
