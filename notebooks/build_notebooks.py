"""Writes main.ipynb and cluster_check.ipynb (without outputs) from the cells below.

The notebooks are the product's face, so their cells live here as plain text that reviews well;
run `python notebooks/build_notebooks.py` after editing and commit the .ipynb files it writes.
Every code cell asserts what it shows: `pytest --nbval-lax notebooks/` executes them against a
(simulated) cluster.
"""

from pathlib import Path

import nbformat

HERE = Path(__file__).parent

SETUP = '''\
# Host 0's kernel is the last JAX process. On a simulated cluster it needs the same fake CPU devices
# as the engines, set before JAX starts its backend.
import os
from dsr1.workbench import cluster

info = cluster.cluster_info()
if info.get("provider") == "local":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={info['local_devices']}"
    os.environ["JAX_PLATFORMS"] = "cpu"
client = cluster.connect()
engines = cluster.wait_for_engines(client, info.get("engines") or len(client.ids))
layout = cluster.assign_process_ids(client)   # PROCESS_ID, NUM_PROCESSES, COORDINATOR everywhere
client.activate()                             # %px / %%px on all engines
print(layout.describe(engines[0]), "...", f"{NUM_PROCESSES} processes, the kernel is process {PROCESS_ID}")
assert NUM_PROCESSES == len(engines) + 1 and PROCESS_ID == NUM_PROCESSES - 1'''

INITIALIZE = '''\
%%px --local
# Runs on every engine (submitted without blocking) and then here: initialize waits for all N.
from dsr1.workbench import cluster
cluster.initialize(PROCESS_ID, NUM_PROCESSES, COORDINATOR)
import jax
assert jax.process_count() == NUM_PROCESSES and jax.process_index() == PROCESS_ID
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
      f"{jax.device_count()} in all")'''

main_cells = [
    ("md", """\
# dsr1 workbench

DeepSeek-V3/R1 in JAX across the hosts of a cluster. The notebook kernel runs on host 0; every
`%%px --local` cell runs the same code on the engines (hosts 1..N-1) **and** here, so all JAX
processes execute the same programs.

Start the cluster first: `./mcjax_setup.sh` on a real cluster (see `cluster/README.md`), or a
simulated one on this machine with `./mcjax_setup.sh --local 4` (a controller, 3 engines and this
kernel, each process with fake CPU devices). Stop it with `./mcjax_setup.sh --stop`.

Parameters: set `DSR1_CHECKPOINT` to a release or converted checkpoint folder on the shared disk;
unset, a random-weight `tiny` model runs (its text is noise)."""),
    ("code", SETUP),
    ("code", '''\
CHECKPOINT = os.environ.get("DSR1_CHECKPOINT")   # None: the tiny random model
client[:].push({"CHECKPOINT": CHECKPOINT}, block=True)
print("checkpoint:", CHECKPOINT or "none (random tiny model)")'''),
    ("md", "## Initialize `jax.distributed` in every process"),
    ("code", INITIALIZE),
    ("md", "## Mesh and model\nOne mesh over every device of every process; weights are created (or read) directly into their shards."),
    ("code", '''\
%%px --local
import dsr1
from dsr1.generation.tokenizer import load_tokenizer
mesh = dsr1.make_mesh()
if CHECKPOINT:
    model = dsr1.load(CHECKPOINT, mesh=mesh, progress=PROCESS_ID == NUM_PROCESSES - 1)
else:
    model = dsr1.init_random(dsr1.Config.preset("tiny"), mesh=mesh)
tokenizer = load_tokenizer(CHECKPOINT)
gate = model.params["moe_layers"]["moe"]["gate"]
print(f"mesh {dict(mesh.shape)}; this process holds {len(gate.addressable_shards)} expert shards of shape "
      f"{gate.addressable_shards[0].data.shape}")
assert gate.shape[1] == model.cfg.n_routed_experts
assert gate.addressable_shards[0].data.shape[1] == model.cfg.n_routed_experts // mesh.shape["expert"]'''),
    ("md", "### The cluster computes the single-process logits\nThe same float32 random model on the whole mesh, and on this kernel's own devices alone."),
    ("code", '''\
%%px --local
import numpy as np
from dsr1.core.sharding import to_host
check_cfg = dsr1.Config.preset("tiny")
check_tokens = np.random.default_rng(0).integers(0, check_cfg.vocab_size, (2, 12))
everywhere = dsr1.init_random(check_cfg, seed=1, mesh=mesh, dtype="float32")
cluster_logits = to_host(everywhere.forward(check_tokens, [12, 7]))'''),
    ("code", '''\
alone = dsr1.init_random(check_cfg, seed=1, mesh=dsr1.make_mesh(devices=jax.local_devices()), dtype="float32")
single_logits = np.asarray(alone.forward(check_tokens, [12, 7]))
err = float(np.abs(cluster_logits - single_logits).max() / np.abs(single_logits).max())
print(f"{jax.process_count()} processes vs one process: max|dlogit|/max|logit| = {err:.1e}")
assert err < 1e-5'''),
    ("md", "## Generate\nThe widget runs each generation on every engine too (the model is split across processes). It is driven from code here so the handler runs under nbval; in Jupyter, type and click."),
    ("code", '''\
from dsr1.workbench.widgets import GenerationWidget
widget = GenerationWidget(model, tokenizer, engines=client[:], max_new_tokens=48)
display(widget)
widget.prompt.value = "Explain multi-head latent attention in one paragraph."
widget.button.click()
completion = widget.result.completions[0]
print(widget.output.value)
print(widget.status.value)
assert widget.output.value == completion.text and completion.tokens
assert 0 < len(completion.tokens) <= 48'''),
    ("md", "## Profile decode\nStep latency, throughput by batch size, device time by block from a `jax.profiler` trace, and achieved bandwidth against this machine's measured copy bandwidth. Every process runs it (the model is sharded); the kernel plots."),
    ("code", '''\
%%px --local
from dsr1.workbench import profiling
profile = profiling.profile_decode(model, batch=4, batches=(1, 2, 4, 8), context=64, steps=8,
                                   copy_bytes=64 * 2**20)'''),
    ("code", '''\
print(profile.summary())
figure = profiling.plot_profile(profile)
assert set(profile.tokens_per_second) == {1, 2, 4, 8} and min(profile.tokens_per_second.values()) > 0
assert profile.block_ms["attention"] > 0 and profile.block_ms["routed experts"] > 0
assert 0 < profile.achieved_gbs'''),
    ("md", """\
## Troubleshooting

- **A cell hangs or was interrupted**: `cluster.abort_stale(client)` aborts what is still queued on
  the engines (`interrupt=True` also sends SIGINT).
- **An engine died** (the next `%%px` raises a ClusterError naming it): run `cluster_restart` from
  `mcjax_defs.sh` on host 0 (or `cluster.reset_engines(client)` below), then re-run the cells from
  "Initialize".
- **Engines hold memory from an earlier run**: `cluster.reset_engines(client)`.
- **`initialize` timed out**: `cluster.clear_hung_initialize(client)`, then initialize again."""),
    ("code", '''\
report = cluster.health_check(client)   # same Python, dsr1 and jax everywhere; devices per process
print(report)
assert report.ok
print("stale tasks aborted:", cluster.abort_stale(client))'''),
    ("code", '''\
# Restarting the engines frees their memory; they then need assign_process_ids and initialize again.
RESET_ENGINES = False
if RESET_ENGINES:
    cluster.reset_engines(client)'''),
]

check_cells = [
    ("md", """\
# Cluster check

Hosts, devices and versions of every process, and an all-reduce across all of them, timed. Start
the cluster first (`./mcjax_setup.sh`, or `./mcjax_setup.sh --local 4`)."""),
    ("code", SETUP),
    ("code", INITIALIZE),
    ("code", '''\
report = cluster.health_check(client)
print(report)
assert report.ok and len(report.processes) == NUM_PROCESSES'''),
    ("md", "## All-reduce across every process\nEach process contributes its process index on each of its devices; `psum` over the whole mesh must see all of them."),
    ("code", '''\
%%px --local
import time
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = np.array(jax.devices())
world = Mesh(devices, ("all",))
local = [jnp.full((1,), float(jax.process_index()), jnp.float32, device=d) for d in jax.local_devices()]
values = jax.make_array_from_single_device_arrays((len(devices),), NamedSharding(world, P("all")), local)
total = jax.jit(lambda x: jnp.sum(x), out_shardings=NamedSharding(world, P()))
jax.block_until_ready(total(values))  # compile
start = time.perf_counter()
result = float(jax.block_until_ready(total(values)).addressable_data(0))
allreduce_ms = (time.perf_counter() - start) * 1e3
expected = sum(p * jax.local_device_count() for p in range(jax.process_count()))'''),
    ("code", '''\
print(f"all-reduce over {jax.device_count()} devices in {jax.process_count()} processes: "
      f"{result} (expected {expected}) in {allreduce_ms:.2f} ms")
assert result == expected'''),
]


def build(cells, path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    nbformat.write(nb, path)


if __name__ == "__main__":
    build(main_cells, HERE / "main.ipynb")
    build(check_cells, HERE / "cluster_check.ipynb")
    print("wrote", HERE / "main.ipynb", HERE / "cluster_check.ipynb")
