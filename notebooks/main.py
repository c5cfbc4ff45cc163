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
# processes execute the same programs (`%%px --local` with a watchdog: an engine that dies or raises
# during the cell ends it with an error naming the engine and showing its traceback; see "Recovery"
# below).
#
# Start the cluster first: `./mcjax_setup.sh` on a real cluster (see `cluster/README.md`), or a
# simulated one on this machine with `./mcjax_setup.sh --local 4` (a controller, 3 engines and this
# kernel, each process with fake CPU devices). Stop it with `./mcjax_setup.sh --stop`. On one host
# (a TPU VM, a GPU box) `./mcjax_setup.sh --single` runs the same notebook with no engines
# (`MCJAX_SINGLE=1`: every cell runs in this kernel alone). "Restart kernel and run all" works as it
# is: the first cell restarts engines that cannot join the new kernel.
#
# Parameters: set `DSR1_CHECKPOINT` to a release or converted checkpoint folder on the shared disk;
# unset, the embedded demo model runs (`dsr1.demo_checkpoint()`: a small DeepSeek-V3 with an MTP
# module, trained on Shakespeare by `python -m dsr1.train`, shipped inside the package).

# %%
# Connects to the cluster (cluster.json): restarts engines that cannot join this kernel (after "Restart
# kernel"), numbers the processes (PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere: kernel-last, the
# kernel last; platform on TPU pods and Slurm, JAX numbers them and the kernel is process 0) and defines
# the `%%everywhere` magic. With MCJAX_SINGLE=1 (one host) this kernel is the only process.
import os

import dsr1.workbench as mcjax

cluster = mcjax.connect()
layout = cluster.layout
print(cluster.summary())
assert NUM_PROCESSES == len(layout.engines) + 1 and PROCESS_ID == layout.kernel_process_id
assert sorted([PROCESS_ID, *(e.process_id for e in layout.engines)]) == list(range(NUM_PROCESSES))

# %% [markdown]
# ## Initialize `jax.distributed` in every process

# %%
import jax

mcjax.initialize_everywhere(cluster)   # on every engine (submitted first) and here; waits for all N processes
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
      f"{jax.device_count()} in all")

# %% [markdown]
# ## Mesh and model
# One mesh over every device of every process; weights are created (or read) directly into their shards,
# in every process (`mesh`, `model` and `tokenizer` are defined everywhere for the `%%everywhere` cells).
# The weights' form comes from the capacity plan for these devices: full precision where it fits, else
# int8 (R1 on a v5e-64 or 8xH200); pass `quant=` / `kv_cache_dtype=` to choose it yourself.

# %%
CHECKPOINT = os.environ.get("DSR1_CHECKPOINT")   # None: the embedded demo model, shipped on every host
model, tokenizer = mcjax.load_everywhere(cluster, CHECKPOINT, mtp=True)   # quant="auto", kv_cache_dtype="auto"
print(WEIGHTS_FORM.describe())
gate = model.params["moe_layers"]["moe"]["gate"]
print(f"checkpoint: {CHECKPOINT or 'none: the embedded demo model'}; mesh {dict(mesh.shape)}; this process holds "
      f"{len(gate.addressable_shards)} expert shards of shape {gate.addressable_shards[0].data.shape}")
assert gate.shape[1] == model.cfg.n_routed_experts
assert gate.addressable_shards[0].data.shape[1] == model.cfg.n_routed_experts // mesh.shape["expert"]

# %% [markdown]
# ### The cluster computes the single-process logits
# The same float32 random model on the whole mesh, and on this kernel's own devices alone.

# %%
# %%everywhere
import dataclasses

import numpy as np

import dsr1
from dsr1.core.sharding import to_host

check_cfg = dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=4096)   # token ids only: a small vocabulary
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
# The widget runs each generation on every engine too (the model is split across processes), under the
# same watchdog as `%%everywhere`. It is driven from code here so the handler runs under nbval; in Jupyter,
# type and click.

# %%
from IPython.display import display

from dsr1.workbench.widgets import GenerationWidget

widget = GenerationWidget(model, tokenizer, cluster=cluster, max_new_tokens=48)
display(widget)
widget.prompt.value = "Good morrow, my lord. What news from the court?"   # the demo model speaks Shakespeare
widget.button.click()
completion = widget.result.completions[0]
print(widget.output.value)
print(widget.status.value)
assert widget.output.value == completion.text and completion.tokens
assert 0 < len(completion.tokens) <= 48

# %% [markdown]
# ## MTP speculative decoding
# The model's multi-token-prediction module drafts k tokens per step (k > 1 applies it recursively)
# and the model verifies them in one multi-token step against its cache: greedy output is the same
# token for token, and every accepted draft is a token that cost no decode step of its own.
# `python -m dsr1.bench quality` measures the same on one process (docs/benchmarks.md).

# %%
# %%everywhere
spec_prompts = ["Now is the winter of our discontent"]
greedy = dsr1.Sampling(temperature=0.0, seed=0)   # every process passes the same arrays (a seed, not a random one)
spec_runs = {k: dsr1.generate(model, spec_prompts, tokenizer=tokenizer, sampling=greedy, max_new_tokens=48,
                              draft_tokens=k)
             for k in ((0, 1, 2) if "mtp" in model.params else (0,))}

# %%
import matplotlib.pyplot as plt

base = spec_runs[0]
for k, run in spec_runs.items():
    assert run.completions[0].tokens == base.completions[0].tokens, k   # drafts never change greedy output
    accepted = f"{run.draft_acceptance:.0%} of drafts accepted" if k else "no drafts"
    print(f"k={k}: {run.decode_tokens_per_second:6.1f} tok/s, {accepted}")
print(base.completions[0].text)
drafted = [k for k in spec_runs if k]
if drafted:
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([str(k) for k in drafted], [spec_runs[k].draft_acceptance for k in drafted], color="tab:blue")
    ax.set(xlabel="draft tokens k", ylabel="share of drafts accepted", ylim=(0, 1),
           title=f"MTP drafts on {jax.process_count()} processes")
    ax2 = ax.twinx()
    ax2.plot([str(k) for k in drafted], [spec_runs[k].decode_tokens_per_second / base.decode_tokens_per_second
                                          for k in drafted], "o-", color="tab:red")
    ax2.set_ylabel("decode speed vs k=0", color="tab:red")
    plt.show()

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
    shared = ("Two households, both alike in dignity, in fair Verona, where we lay our scene, from ancient "
              "grudge break to new mutiny, where civil blood makes civil hands unclean.\n\n")
    questions = ["ROMEO.", "JULIET.", "MERCUTIO.", "NURSE.", "FRIAR LAURENCE.", "TYBALT."]
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
assert 0 < sum(profile.block_ms.values()) and 0 < profile.traced_step_ms

# %% [markdown]
# ## Recovery and troubleshooting
#
# **An engine died** (killed, out of memory, a crash): the `%%everywhere` cell running at the time
# ends within seconds with a ClusterError naming the engine (process, host, pid); so does the next
# one. **A process raised** (a file missing on one host, out of device memory): the cell ends within
# seconds with a ClusterError naming the process and showing its traceback; the processes that were
# waiting for it in a collective are named too, and stay stuck (the next cell refuses to run on
# them). The other processes cannot go on with `jax.distributed` without it. To recover, without
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
# JAX ends every process with it, this kernel included: restart the kernel and run the notebook from
# the top (the first cell restarts the engines). (Under platform numbering the kernel is process 0
# and runs the coordinator.) Running the first cell again also recovers: `mcjax.connect()` restarts
# the engines when they are missing, stuck or cannot join this kernel.
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
