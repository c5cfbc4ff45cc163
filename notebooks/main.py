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
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # dsr1 workbench
#
# DeepSeek-V3/R1 in JAX across the hosts of a cluster. The notebook kernel runs on host 0; every
# `%%everywhere` cell runs the same code on the engines (hosts 1..N-1) **and** here, so all JAX
# processes execute the same programs (`%%px --local` with a watchdog: an engine that dies during
# the cell ends it with an error naming the engine; see "Recovery" below).
#
# Start the cluster first: `./mcjax_setup.sh` on a real cluster (see `cluster/README.md`), or a
# simulated one on this machine with `./mcjax_setup.sh --local 4` (a controller, 3 engines and this
# kernel, each process with fake CPU devices). Stop it with `./mcjax_setup.sh --stop`.
#
# Parameters: set `DSR1_CHECKPOINT` to a release or converted checkpoint folder on the shared disk;
# unset, a random-weight `tiny` model runs (its text is noise).

# %%
# The platform numbers the processes (cluster.json's "numbering"): kernel-last (the kernel is the last
# process) or platform (TPU pods, Slurm: JAX numbers them itself, the kernel is process 0). On a
# simulated cluster the kernel needs the engines' fake CPU devices, set before JAX starts its backend.
import os

from dsr1.workbench import cluster as mcjax

info = mcjax.cluster_info()
if info.get("provider") == "local":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={info['local_devices']}"
    os.environ["JAX_PLATFORMS"] = "cpu"
cluster = mcjax.connect()                     # the ipyparallel client, cluster.json and the process layout
engines = mcjax.wait_for_engines(cluster, info.get("engines") or len(cluster.client.ids))
layout = mcjax.assign_process_ids(cluster)    # PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere
mcjax.activate(cluster)                       # %px / %%px on all engines, and %%everywhere
print(f"{NUM_PROCESSES} processes, {layout.numbering} numbering: the kernel is process {PROCESS_ID}; "
      + "; ".join(e.describe() for e in layout.engines))
assert NUM_PROCESSES == len(engines) + 1 and PROCESS_ID == layout.kernel_process_id
assert sorted([PROCESS_ID, *(e.process_id for e in layout.engines)]) == list(range(NUM_PROCESSES))

# %%
CHECKPOINT = os.environ.get("DSR1_CHECKPOINT")   # None: the tiny random model
cluster.client[:].push({"CHECKPOINT": CHECKPOINT}, block=True)
print("checkpoint:", CHECKPOINT or "none (random tiny model)")

# %% [markdown]
# ## Initialize `jax.distributed` in every process

# %%
# %%everywhere
# Runs on every engine (submitted without blocking) and here: initialize waits for all N processes.
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
# %%everywhere
import dsr1

mesh = dsr1.make_mesh()
if CHECKPOINT:
    model = dsr1.load(CHECKPOINT, mesh=mesh, progress=PROCESS_ID == KERNEL_PROCESS_ID)
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
# %%everywhere
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
# ## Serve many requests
# `dsr1.serving.Engine` batches requests continuously over a paged latent cache with a prefix
# cache: requests join and leave at any step, and a shared prefix is prefilled once. Every process
# builds the engine; process 0 decides each step and sends it to the others, which run the same
# programs in `engine.follow()` until process 0 calls `engine.close()`.

# %%
# %%everywhere
from dsr1.serving import Engine

engine = Engine(model, max_seqs=4, page_size=16, num_pages=64, prefill_chunk=32, tokenizer=tokenizer)
if engine.is_leader:
    engine.warm_up()
    shared = "You are a helpful assistant who answers in one short sentence. " * 3
    questions = ["What is a latent cache?", "Why route tokens to experts?", "What does YaRN scale?",
                 "Name a prime number.", "What is a mesh axis?", "Why page a cache?"]
    served = [engine.submit(shared + q, sampling=dsr1.Sampling(temperature=0.0), max_new_tokens=12)
              for q in questions]
    engine.run()
    engine.close()
    stats = engine.stats()
    for request in served:
        print(f"{request.finish_reason:>6} {len(request.tokens):2d} tokens, {request.cached_tokens:3d} cached: "
              f"{request.text!r}")
    print(f"{stats.steps} steps, {stats.generated_tokens} tokens, {stats.prefix_hit_tokens} prompt tokens from the "
          f"prefix cache; host {stats.host_ms_per_step:.1f} ms vs device {stats.device_ms_per_step:.1f} ms per step")
    assert all(r.done for r in served) and stats.prefix_hit_tokens > 0
    engine.check()  # no page leaked
else:
    engine.follow()

# %% [markdown]
# ## Profile decode
# Step latency, throughput by batch size, device time by block from a `jax.profiler` trace, and
# achieved bandwidth against this machine's measured copy bandwidth. Every process runs it (the
# model is sharded); the kernel plots.

# %%
# %%everywhere
from dsr1.workbench import profiling

profile = profiling.profile_decode(model, batch=4, batches=(1, 2, 4, 8), context=64, steps=8,
                                   copy_bytes=64 * 2**20)

# %%
print(profile.summary())   # device time by block is per device (this kernel's devices' mean), next to the step time
figure = profiling.plot_profile(profile)
assert set(profile.tokens_per_second) == {1, 2, 4, 8} and min(profile.tokens_per_second.values()) > 0
assert profile.block_ms["attention"] > 0 and profile.block_ms["routed experts"] > 0
assert 0 < profile.achieved_gbs
assert sum(profile.block_ms.values()) < 2 * np.median(profile.step_ms)  # per device: no sum over devices

# %% [markdown]
# ## Recovery and troubleshooting
#
# **An engine died** (killed, out of memory, a crash): the `%%everywhere` cell running at the time
# ends within seconds with a ClusterError naming the engine (process, host, pid); so does the next
# one. The other processes cannot go on with `jax.distributed` without it. To recover, without
# restarting this kernel or touching the controller:
#
# 1. Run `mcjax.reset_engines(cluster)` (set `RESET_ENGINES = True` in the last cell, or type it in
#    a new cell). It asks the scripts whether a restart can succeed (`cluster_restart check`; if not,
#    nothing is stopped and the error says which host is the problem), resets this kernel's JAX
#    state (it leaves `jax.distributed` and drops its devices and compiled programs), restarts every
#    engine (`cluster_restart engines` on host 0), re-reads `cluster.json` and numbers the processes
#    again with a new coordinator port.
# 2. Re-run the cells from "Initialize" down: `initialize`, the mesh and model, the generation.
#
# If the engine that died was **process 0** under kernel-last numbering, it ran the coordinator and
# JAX ends every process with it, this kernel included: restart the kernel, then
# `mcjax.reset_engines(mcjax.connect())` and run the notebook from the top. (Under platform numbering
# the kernel is process 0 and runs the coordinator.)
#
# Other problems:
# - **A cell hangs or was interrupted**: `mcjax.abort_stale(cluster)` aborts what is still queued on
#   the engines (`interrupt=True` also sends SIGINT).
# - **Engines hold memory from an earlier run**: `mcjax.reset_engines(cluster)`, then re-run from "Initialize".
# - **`initialize` timed out**: `mcjax.clear_hung_initialize(cluster)`, then
#   `mcjax.assign_process_ids(cluster, port=<a new port>)` and initialize again.

# %%
report = mcjax.health_check(cluster)   # same Python, dsr1 and jax everywhere; devices per process
print(report)
assert report.ok
print("stale tasks aborted:", mcjax.abort_stale(cluster))

# %%
# Recovery (see above): restarts the engines, resets this kernel's JAX state, numbers the processes
# again; then re-run the cells from "Initialize".
RESET_ENGINES = False
if RESET_ENGINES:
    mcjax.reset_engines(cluster)
