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
# Hosts, devices and versions of every process, and an all-reduce across all of them, timed. Start
# the cluster first (`./mcjax_setup.sh`, or `./mcjax_setup.sh --local 4`).

# %%
# Host 0's kernel is the last JAX process. On a simulated cluster it needs the same fake CPU devices
# as the engines, set before JAX starts its backend.
import os

from dsr1.workbench import cluster as mcjax

info = mcjax.cluster_info()
if info.get("provider") == "local":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={info['local_devices']}"
    os.environ["JAX_PLATFORMS"] = "cpu"
cluster = mcjax.connect()                     # the ipyparallel client, cluster.json and the process layout
engines = mcjax.wait_for_engines(cluster, info.get("engines") or len(cluster.client.ids))
layout = mcjax.assign_process_ids(cluster)    # PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere
cluster.client.activate()                     # %px / %%px on all engines
print(layout.describe(engines[0]), "...", f"{NUM_PROCESSES} processes, the kernel is process {PROCESS_ID}")
assert NUM_PROCESSES == len(engines) + 1 and PROCESS_ID == NUM_PROCESSES - 1

# %%
# %%px --local
# Runs on every engine (submitted without blocking) and then here: initialize waits for all N.
import jax

from dsr1.workbench import cluster as mcjax

mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR)
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
      f"{jax.device_count()} in all")

# %%
report = mcjax.health_check(cluster)
print(report)
assert report.ok and len(report.processes) == NUM_PROCESSES

# %% [markdown]
# ## All-reduce across every process
# Each process contributes its process index on each of its devices; `psum` over the whole mesh
# must see all of them.

# %%
# %%px --local
import time

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
