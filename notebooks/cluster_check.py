# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Cluster check
#
# Hosts, devices and versions of every process, clock skew between hosts, the shared folder (mounted?
# free space?), and an all-reduce across all of them, timed. Start the cluster first
# (`./mcjax_setup.sh`, or `./mcjax_setup.sh --local 4`).

# %%
# Connects to the cluster (cluster.json): restarts engines that cannot join this kernel (after "Restart
# kernel"), numbers the processes (PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere: kernel-last, the
# kernel last; platform on TPU pods and Slurm, JAX numbers them and the kernel is process 0) and defines
# the `%%everywhere` magic. With MCJAX_SINGLE=1 (one host) this kernel is the only process.
import dsr1.workbench as mcjax

cluster = mcjax.connect()
layout = cluster.layout
print(cluster.summary())
assert NUM_PROCESSES == len(layout.engines) + 1 and PROCESS_ID == layout.kernel_process_id

# %%
import jax

mcjax.initialize_everywhere(cluster)   # on every engine (submitted first) and here; waits for all N processes
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
      f"{jax.device_count()} in all")

# %%
# Same Python, jax, jaxlib and dsr1 everywhere? (a mismatch is listed under "problems" and fails the cell)
report = mcjax.health_check(cluster, raise_on_problem=False)
print(report)
versions = {key: sorted({str(p[key]) for p in report.processes}) for key in ("python", "jax", "jaxlib", "dsr1")}
print("versions:", ", ".join(f"{k} {' / '.join(v)}" for k, v in versions.items()))
assert report.ok and len(report.processes) == NUM_PROCESSES
assert all(len(v) == 1 for v in versions.values()), f"version mismatch: {versions}"

# %% [markdown]
# ## Clocks and the shared folder
# Clock skew of each engine's host against host 0 (logs and profiles are compared across hosts), and
# how every process sees the shared folders: the mount (on a real cluster hosts 1..N-1 see `nfs`, and
# a bucket `fuse.gcsfuse`) and the free space.

# %%
skews = mcjax.clock_skew(cluster)
for who, (skew, uncertainty) in skews.items():
    print(f"{who}: clock {skew * 1e3:+.1f} ms (+/- {uncertainty * 1e3:.1f} ms) against host 0")
assert len(skews) == len(layout.engines)
worst = max(abs(s) - u for s, u in skews.values())
print(f"largest skew beyond the measurement's uncertainty: {max(worst, 0) * 1e3:.1f} ms")
if cluster.info.get("provider") == "local":
    assert worst < 0.5  # one machine, one clock

storage = mcjax.storage_everywhere(cluster)
for who, entries in storage.items():
    for e in entries:
        free = f"{e['free_bytes'] / 2**30:.1f} GiB free" if e["exists"] else "MISSING"
        print(f"{who}: {e['path']} on {e['mount']} ({e['fstype']} from {e['source']}), {free}")
assert all(e["exists"] and e["free_bytes"] > 0 for entries in storage.values() for e in entries)
LOCAL_FILESYSTEMS = ("ext4", "xfs", "btrfs", "overlay", "tmpfs")  # not shared between hosts
if cluster.info.get("provider") not in ("local", "single", None):  # engines' hosts must see host 0's folders
    unshared = [f"{who}: {e['path']} ({e['fstype']})" for who, entries in storage.items() if who != "kernel"
                for e in entries if e["fstype"] in LOCAL_FILESYSTEMS]
    print("not on a shared mount:", "; ".join(unshared) or "none")

# %% [markdown]
# ## All-reduce across every process
# Each process contributes its process index on each of its devices; `psum` over the whole mesh
# must see all of them.

# %%
# %%everywhere
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

devices = np.array(jax.devices())
world = Mesh(devices, ("all",))
local = [jnp.full((1,), float(jax.process_index()), jnp.float32, device=d) for d in jax.local_devices()]
values = jax.make_array_from_single_device_arrays((len(devices),), NamedSharding(world, P("all")), local)
total = jax.jit(lambda x: jnp.sum(x), out_shardings=NamedSharding(world, P()))
jax.block_until_ready(total(values))  # compile
start = time.perf_counter()
result = float(jax.block_until_ready(total(values)).addressable_data(0))
allreduce_ms = (time.perf_counter() - start) * 1e3
expected = sum(p * jax.local_device_count() for p in range(jax.process_count()))

# %%
print(f"all-reduce over {jax.device_count()} devices in {jax.process_count()} processes: "
      f"{result} (expected {expected}) in {allreduce_ms:.2f} ms")
assert result == expected
