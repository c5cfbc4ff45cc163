"""A 16-host TPU pod under the gcloud provider, without one: the hosts come from worker 0's
`worker-network-endpoints` metadata in both of its forms (name:id:ip entries, and host names alone
that worker 0 resolves), and the setup's --dry-run transcript of each is a golden file in
tests/data/dry_run/. Then how `gcloud ... ssh` is driven for real: at most MCJAX_GCLOUD_PARALLEL
calls at once, a call that failed on gcloud's "database is locked" made again, any other failure
final.

The fake gcloud runs the `--command=` it gets with `sh -c`, with fake `curl` (the metadata server)
and `getent` (worker 0's DNS) first on PATH, so the remote commands run as written.

MCJAX_UPDATE_GOLDEN=1 pytest tests/test_dry_run_pod.py rewrites the golden files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .test_dry_run import GOLDEN, ROOT, base_env, calls, fake_tools, repo_copy, run

WORKERS = 16
IPS = [f"10.130.0.{i + 2}" for i in range(WORKERS)]
NAMES = [f"t1v-n-4f1a3c2e-w-{i}" for i in range(WORKERS)]
FORMS = {
    # name:id:ip, as most TPU images write it
    "gcloud-pod-16": ",".join(f"unknown:unknown:{ip}" for ip in IPS),
    # host names alone: worker 0 resolves them (each also has a second network's address, listed second)
    "gcloud-pod-16-hostnames": ",".join(NAMES),
}
POD = dict(MCJAX_PROVIDER="gcloud", MCJAX_CLUSTER="my-v5e-64", MCJAX_ZONE="us-west4-a", MCJAX_PROJECT="my-project")

# The remote side: curl prints the worker list, getent ahostsv4 NAME the addresses of worker
# NAME-w-i on both networks (the primary one first, as the VPC's DNS answers).
REMOTE_BIN = {
    "curl": 'case "$*" in *worker-network-endpoints*) printf "%s" "$ENDPOINTS" ;; *) exit 22 ;; esac',
    "getent": 'i=${2##*-w-}; case "$2" in t1v-n-4f1a3c2e-w-*) ;; *) exit 2 ;; esac; '
              'printf "10.130.0.%s STREAM %s\\n10.130.0.%s DGRAM\\n10.131.0.%s STREAM\\n" '
              '$((i + 2)) "$2" $((i + 2)) $((i + 2))',
}
GCLOUD_RUNS_COMMAND = ('for a; do case "$a" in --command=*) cmd=${a#--command=} ;; esac; done; '
                       '[ -n "${cmd:-}" ] || exit 1; PATH="$REMOTE_BIN:$PATH" exec sh -c "$cmd"')


def remote_bin(tmp_path: Path) -> Path:
    folder = tmp_path / "remote-bin"
    folder.mkdir()
    for tool, body in REMOTE_BIN.items():
        (folder / tool).write_text(f"#!/bin/sh\n{body}\n")
        (folder / tool).chmod(0o755)
    return folder


def pod_env(tmp_path: Path, endpoints: str, **extra: str) -> tuple[dict[str, str], Path]:
    bin_dir, log = fake_tools(tmp_path, gcloud=GCLOUD_RUNS_COMMAND)
    env = base_env(tmp_path, bin_dir, **POD, ENDPOINTS=endpoints, REMOTE_BIN=str(remote_bin(tmp_path)), **extra)
    return env, log


@pytest.mark.parametrize("form", sorted(FORMS))
def test_pod_dry_run_transcripts(form, tmp_path):
    """The worker list is read once from worker 0 (host names: resolved there, in one more call);
    every host is addressed by its primary address; the transcript is the golden one."""
    repo = repo_copy(tmp_path)
    env, log = pod_env(tmp_path, FORMS[form])
    setup = run([repo / "mcjax_setup.sh", "--dry-run"], env, repo)
    assert setup.returncode == 0 and setup.stderr == "", setup.stdout + setup.stderr
    lookups = calls(log)
    assert len(lookups) == (2 if form.endswith("hostnames") else 1), lookups
    assert all(c.startswith("gcloud [compute] [tpus] [tpu-vm] [ssh] [my-v5e-64]") and "[--worker=0]" in c
               for c in lookups)
    assert not [c for c in lookups if "describe" in c], "networkEndpoints counts every network: never asked"
    assert f"==> check: provider gcloud, {WORKERS} hosts" in setup.stdout
    assert [f"  host {i}: internal IP {ip}" for i, ip in enumerate(IPS)] == re.findall(
        r"^  host \d+: internal IP .*$", setup.stdout, flags=re.M)
    workers = [int(w) for w in re.findall(r"--worker=(\d+)", setup.stdout)]
    assert set(workers) == set(range(WORKERS))
    assert f"nfs.sh server {' '.join(IPS)}" in setup.stdout

    text = ("### worker 0's answers to the lookups (gcloud calls)\n" + "\n".join(lookups) +
            f"\n\n### ./mcjax_setup.sh --dry-run\n{setup.stdout.strip()}\n")
    text = text.replace(str(repo), "<repo>").replace(str(tmp_path / "state"), "<state>")
    golden = GOLDEN / f"{form}.txt"
    if os.environ.get("MCJAX_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no {golden}: run with MCJAX_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"the {form} transcript changed (MCJAX_UPDATE_GOLDEN=1 to accept):\n{text}"


def test_both_endpoint_forms_give_the_same_setup():
    setups = [(GOLDEN / f"{form}.txt").read_text().split("### ./mcjax_setup.sh --dry-run\n", 1)[1] for form in FORMS]
    assert setups[0] == setups[1]


def test_an_unresolvable_worker_name_is_an_error_naming_it(tmp_path):
    endpoints = ",".join(NAMES[:3] + ["tpu-elsewhere-w-3"])
    env, log = pod_env(tmp_path, endpoints)
    done = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_internal_ips"], env, ROOT)
    assert done.returncode == 1 and done.stdout == ""
    assert "'tpu-elsewhere-w-3'" in done.stderr and "MCJAX_INTERNAL_IPS" in done.stderr, done.stderr


def test_no_worker_list_is_an_error_not_a_count_of_network_endpoints(tmp_path):
    env, log = pod_env(tmp_path, "")
    done = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_host_count"], env, ROOT)
    assert done.returncode != 0 and "worker-network-endpoints" in done.stderr, done.stderr
    assert not [c for c in calls(log) if "describe" in c]


# ----------------------------------------------------------------------------- gcloud for real

SLOW_GCLOUD = """
d="$TRACK"; mkdir -p "$d/running"; : >"$d/running/$$"
ls "$d/running" | wc -l >>"$d/concurrency"
w=""; for a; do case "$a" in --worker=*) w=${a#--worker=} ;; esac; done
sleep 0.3
rm -f "$d/running/$$"
if [ "$w" = 3 ] && [ ! -e "$d/locked-once" ]; then
  : >"$d/locked-once"
  echo "ERROR: (gcloud.compute.tpus.tpu-vm.ssh) database is locked" >&2; exit 1
fi
if [ "$w" = 5 ]; then echo "Permission denied (publickey)." >&2; exit 255; fi
echo "worker $w ok"
"""


@pytest.mark.slow
def test_gcloud_calls_are_capped_and_a_locked_database_is_retried(tmp_path):
    bin_dir, log = fake_tools(tmp_path, gcloud=SLOW_GCLOUD)
    track = tmp_path / "track"
    env = base_env(tmp_path, bin_dir, **POD, MCJAX_HOSTS=str(WORKERS), MCJAX_INTERNAL_IPS=" ".join(IPS),
                   TRACK=str(track), MCJAX_GCLOUD_PARALLEL="8")
    done = run(["bash", "-c", ". ./mcjax_defs.sh && cluster_exec 0 15 true"], env, ROOT, timeout=120)
    # worker 3: locked once, then made again and fine; worker 5: a real failure, not retried
    assert done.returncode == 255 and "failed on host 5 (exit status 255)" in done.stderr, done.stdout + done.stderr
    assert "[host 3] worker 3 ok" in done.stdout and "[host 3] gcloud's database was locked" in done.stdout
    assert "[host 5] Permission denied (publickey)." in done.stdout
    workers = [re.search(r"\[--worker=(\d+)\]", c).group(1) for c in calls(log)]
    assert sorted(workers, key=int) == sorted([str(i) for i in range(WORKERS)] + ["3"], key=int)
    seen = [int(n) for n in (track / "concurrency").read_text().split()]
    assert max(seen) <= 8, seen
