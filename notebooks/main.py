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
# # dsr1 workbench
#
# DeepSeek-V3/R1 in JAX across the hosts of a cluster. The notebook kernel runs on host 0; every
# `%%px --local` cell runs the same code on the engines (hosts 1..N-1) **and** here, so all JAX
# processes execute the same programs.
#
# Start the cluster first: `./mcjax_setup.sh` on a real cluster (see `cluster/README.md`), or a
# simulated one on this machine with `./mcjax_setup.sh --local 4` (a controller, 3 engines and this
# kernel, each process with fake CPU devices). Stop it with `./mcjax_setup.sh --stop`.
#
# Parameters: set `DSR1_CHECKPOINT` to a release or converted checkpoint folder on the shared disk;
# unset, a random-weight `tiny` model runs (its text is noise).

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
CHECKPOINT = os.environ.get("DSR1_CHECKPOINT")   # None: the tiny random model
cluster.client[:].push({"CHECKPOINT": CHECKPOINT}, block=True)
print("checkpoint:", CHECKPOINT or "none (random tiny model)")

# %% [markdown]
# ## Initialize `jax.distributed` in every process

# %%
# %%px --local
# Runs on every engine (submitted without blocking) and then here: initialize waits for all N.
import jax

from dsr1.workbench import cluster as mcjax

mcjax.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR)
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
      f"{jax.device_count()} in all")

# %% [markdown]
# ## Mesh and model
# One mesh over every device of every process; weights are created (or read) directly into their shards.

# %%
# %%px --local
import dsr1

mesh = dsr1.make_mesh()
if CHECKPOINT:
    model = dsr1.load(CHECKPOINT, mesh=mesh, progress=PROCESS_ID == NUM_PROCESSES - 1)
else:
    model = dsr1.init_random(dsr1.Config.preset("tiny"), mesh=mesh)
tokenizer = dsr1.load_tokenizer(CHECKPOINT)
gate = model.params["moe_layers"]["moe"]["gate"]
print(f"mesh {dict(mesh.shape)}; this process holds {len(gate.addressable_shards)} expert shards of shape "
      f"{gate.addressable_shards[0].data.shape}")
assert gate.shape[1] == model.cfg.n_routed_experts
assert gate.addressable_shards[0].data.shape[1] == model.cfg.n_routed_experts // mesh.shape["expert"]

# %% [markdown]
# ### The cluster computes the single-process logits
# The same float32 random model on the whole mesh, and on this kernel's own devices alone.

# %%
# %%px --local
import numpy as np

from dsr1.core.sharding import to_host

check_cfg = dsr1.Config.preset("tiny")
check_tokens = np.random.default_rng(0).integers(0, check_cfg.vocab_size, (2, 12))
everywhere = dsr1.init_random(check_cfg, seed=1, mesh=mesh, dtype="float32")
cluster_logits = to_host(everywhere.forward(check_tokens, [12, 7]))

# %%
alone = dsr1.init_random(check_cfg, seed=1, mesh=dsr1.make_mesh(devices=jax.local_devices()), dtype="float32")
single_logits = np.asarray(alone.forward(check_tokens, [12, 7]))
err = float(np.abs(cluster_logits - single_logits).max() / np.abs(single_logits).max())
print(f"{jax.process_count()} processes vs one process: max|dlogit|/max|logit| = {err:.1e}")
assert err < 1e-5

# %% [markdown]
# ## Generate
# The widget runs each generation on every engine too (the model is split across processes). It is
# driven from code here so the handler runs under nbval; in Jupyter, type and click.

# %%
from IPython.display import display

from dsr1.workbench.widgets import GenerationWidget

widget = GenerationWidget(model, tokenizer, engines=cluster.client[:], max_new_tokens=48)
display(widget)
widget.prompt.value = "Explain multi-head latent attention in one paragraph."
widget.button.click()
completion = widget.result.completions[0]
print(widget.output.value)
print(widget.status.value)
assert widget.output.value == completion.text and completion.tokens
assert 0 < len(completion.tokens) <= 48

# %% [markdown]
# ## Profile decode
# Step latency, throughput by batch size, device time by block from a `jax.profiler` trace, and
# achieved bandwidth against this machine's measured copy bandwidth. Every process runs it (the
# model is sharded); the kernel plots.

# %%
# %%px --local
from dsr1.workbench import profiling

profile = profiling.profile_decode(model, batch=4, batches=(1, 2, 4, 8), context=64, steps=8,
                                   copy_bytes=64 * 2**20)

# %%
print(profile.summary())
figure = profiling.plot_profile(profile)
assert set(profile.tokens_per_second) == {1, 2, 4, 8} and min(profile.tokens_per_second.values()) > 0
assert profile.block_ms["attention"] > 0 and profile.block_ms["routed experts"] > 0
assert 0 < profile.achieved_gbs

# %% [markdown]
# ## Troubleshooting
#
# - **A cell hangs or was interrupted**: `mcjax.abort_stale(cluster)` aborts what is still queued on
#   the engines (`interrupt=True` also sends SIGINT).
# - **An engine died** (the next `%%px` raises a ClusterError naming it): run `cluster_restart` from
#   `mcjax_defs.sh` on host 0 (or `mcjax.reset_engines(cluster)` below), then re-run the cells from
#   "Initialize".
# - **Engines hold memory from an earlier run**: `mcjax.reset_engines(cluster)`.
# - **`initialize` timed out**: `mcjax.clear_hung_initialize(cluster)`, then initialize again.

# %%
report = mcjax.health_check(cluster)   # same Python, dsr1 and jax everywhere; devices per process
print(report)
assert report.ok
print("stale tasks aborted:", mcjax.abort_stale(cluster))

# %%
# Restarting the engines frees their memory; they then need assign_process_ids and initialize again.
RESET_ENGINES = False
if RESET_ENGINES:
    mcjax.reset_engines(cluster)
