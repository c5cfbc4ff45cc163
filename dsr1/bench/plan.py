"""Capacity plan: will a model fit a mesh of accelerators, and how much batch x context is left?

Nothing is allocated. The weights are `jax.ShapeDtypeStruct`s carrying their `NamedSharding`s, derived
from the weight declarations (`dsr1.core.params`, int8 as `Int8Weight` declarations); the cache is
abstract too. The real programs (`dsr1.programs.decode`, the step the generation loop runs, and
`dsr1.programs.prefill`) are lowered and compiled for a mesh of *fake CPU devices*, which XLA
partitions exactly as it would the real mesh. From that come:

- weight bytes per device: the sum over weights of their shard's bytes (from the shardings);
- cache bytes per token: every layer's latent `c_kv` and rope key `k_pe` (int8 latents with their
  float32 per-token scale). The decode cache is replicated (low-latency layout), so each device holds
  all of it;
- XLA's memory analysis of both programs (per device) and the time to lower and compile them;
- the largest batch x context that fits `--hbm` GiB per device: weights + cache + XLA's temporary
  buffers (modelled as `fixed + per_token x batch x context` from two decode compiles), with
  `SAFETY_MARGIN` of the memory held back.

Before any of it, every weight whose logical axis the sharding rules (or the intended layout,
`DEFAULT_RULES`) send to a mesh axis of size > 1 must be split, evenly, over it; a weight that would
silently be replicated fails the plan, naming the tensor and the axis.

Caveat: the temporaries are XLA:CPU's. CPU has no bf16 matmul, so it converts some bf16 operands to
float32 (the gathered lm_head, the cache), which a GPU or TPU does not: the "with temp" fit is a
lower bound, the "weights + cache" fit an upper bound.

`--compiler tpu` asks XLA:TPU itself instead (`dsr1.bench.tpu`): the serving step and prefill compiled
with libtpu for a TPU slice's real topology, with its memory analysis, the bytes a step reads and
writes, and every collective of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .. import programs
from ..core.cache import KVCache, check_kv_cache_dtype, pool_shares
from ..core.config import Config
from ..core.params import abstract_params, is_spec, param_specs
from ..core.quant import check_quant
from ..core.sharding import (
    DEFAULT_RULES,
    LAYOUTS,
    MESH_AXES,
    ShardingRules,
    layout_rules,
    make_mesh,
    replicated_sharding,
    rules_layout,
)
from . import tpu
from .accounting import cache_token_bytes
from .bandwidth import device_description, with_final_load
from .chips import CHIPS, SLICES
from .report import device_line

GIB = 2**30
SAFETY_MARGIN = 0.10  # of the device memory, for the runtime, fragmentation and what the estimate misses
CONTEXTS = (4096, 32768, 131072)  # the fit table's rows, with max_position_embeddings (those within it)
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes")


class PlanError(ValueError):
    """A plan that cannot be made: a bad option, or a weight that would be replicated."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A named machine: its device count, memory per device and the mesh the plan uses on it."""

    name: str
    devices: int
    hbm_gib: float
    mesh: dict[str, int]
    about: str


TARGETS = {t.name: t for t in (
    Target("8xH100", 8, 80, {"expert": 1, "tensor": 8}, "one node of 8 NVIDIA H100 (80 GB HBM3 each), tensor "
           "parallel over NVLink"),
    Target("8xH200", 8, 141, {"expert": 1, "tensor": 8}, "one node of 8 NVIDIA H200 (141 GB HBM3e each), tensor "
           "parallel over NVLink"),
    Target("v5e-4", 4, CHIPS["v5e"].hbm_gib, {"expert": 2, "tensor": 2}, "TPU v5e-4: 4 chips of 16 GB HBM2e"),
    Target("v5e-8", 8, CHIPS["v5e"].hbm_gib, {"expert": 1, "tensor": 8}, "TPU v5e-8: 8 chips of 16 GB HBM2e"),
    Target("v5e-64", 64, CHIPS["v5e"].hbm_gib, {"expert": 8, "tensor": 8}, "TPU v5e-64: 64 chips of 16 GB HBM2e"),
    Target("v5p-64", 32, CHIPS["v5p"].hbm_gib, {"expert": 4, "tensor": 8}, "TPU v5p-64: 64 TensorCores = 32 chips "
           "(JAX devices, megacore) of 95 GB HBM2e"),
    Target("v6e-8", 8, CHIPS["v6e"].hbm_gib, {"expert": 1, "tensor": 8}, "TPU v6e-8: 8 chips of 32 GB HBM"),
    Target("v6e-64", 64, CHIPS["v6e"].hbm_gib, {"expert": 8, "tensor": 8}, "TPU v6e-64: 64 chips of 32 GB HBM"),
)}


# ---- options -------------------------------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
    """`expert=8,tensor=8` -> {"expert": 8, "tensor": 8}: both axes of `make_mesh`, each named once."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in MESH_AXES or name in sizes or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected {'=N,'.join(MESH_AXES)}=N "
                                             f"(positive sizes, each axis once), e.g. expert=8,tensor=8")
        sizes[name] = int(value)
    if set(sizes) != set(MESH_AXES):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: give both axes, e.g. expert=8,tensor=8")
    return sizes


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The `plan` command's options."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="deepseek-r1", help="a named config: deepseek-r1, deepseek-v3.1 "
                     "(R1's shapes), tiny or bench (default: deepseek-r1)")
    src.add_argument("--config", metavar="PATH", help="a HF config.json (or a folder holding one)")
    p.add_argument("--target", choices=sorted(TARGETS), help="a named machine; sets the device count, --hbm and "
                   "--mesh (each overridable): " + "; ".join(f"{t.name}: {t.devices} devices x {t.hbm_gib:g} GiB, "
                                                           f"mesh {_mesh_text(t.mesh)}" for t in TARGETS.values()))
    p.add_argument("--mesh", type=parse_mesh, metavar="expert=E,tensor=T",
                   help="mesh sizes, as make_mesh(expert=E, tensor=T) (the --expert/--tensor of the other commands); "
                        "the plan fakes E*T CPU devices (default: the target's, else expert=8,tensor=8)")
    p.add_argument("--hbm", type=float, metavar="GIB", help="memory per device in GiB (default: the target's; "
                   "without it no fit is computed)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the weights that are not int8 (default: bfloat16)")
    p.add_argument("--quant", choices=["int8"], help="int8 matmul weights with per-output-channel scales")
    p.add_argument("--kv-cache-dtype", choices=["int8"], help="int8 latent cache with per-token scales")
    p.add_argument("--batch", type=int, default=8, help="batch of the compiled decode step (default: 8)")
    p.add_argument("--context", type=int, help="cache positions of the compiled decode step; a second compile at "
                   "twice as many separates XLA's fixed from its per-token temporaries (default: 4096, at most half "
                   "of max_position_embeddings)")
    p.add_argument("--prefill-len", type=int, help="prompt tokens of the compiled prefill, batch 1 (default: 4096, "
                   "at most max_position_embeddings)")
    p.add_argument("--compiler", choices=["cpu", "tpu"], default="cpu",
                   help="cpu: compile for fake CPU devices (default); tpu: compile with XLA:TPU (libtpu, the "
                        "tpu-plan extra) for the --target slice's real topology, no TPU needed: its memory "
                        "analysis, bytes per step and collectives")
    p.add_argument("--layout", choices=LAYOUTS, default="tp",
                   help="tp: every device holds every row's cache (default); dp: attention data parallelism, the "
                        "rows and their cache split over the expert axis, all-to-all expert dispatch (docs/layouts.md)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")


def _mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What to plan: the model, its precision, the mesh sizes and the device memory."""

    cfg: Config
    name: str
    mesh: dict[str, int]
    hbm_gib: float | None
    dtype: str = "bfloat16"
    quant: str | None = None
    kv_cache_dtype: str | None = None
    batch: int = 8
    context: int = 4096
    prefill_len: int = 4096
    target: str | None = None
    compiler: str = "cpu"
    layout: str = "tp"

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())


def spec_from_options(args: argparse.Namespace) -> PlanSpec:
    """The plan the options ask for; a target fills in what the options leave out."""
    target = TARGETS[args.target] if args.target else None
    mesh = args.mesh or (target.mesh if target else {"expert": 8, "tensor": 8})
    hbm = args.hbm if args.hbm is not None else (target.hbm_gib if target else None)
    cfg, name = (Config.from_hf(args.config), args.config) if args.config else (Config.preset(args.preset), args.preset)
    longest = cfg.max_position_embeddings
    context = min(4096, longest // 2) if args.context is None else args.context
    prefill_len = min(4096, longest) if args.prefill_len is None else args.prefill_len
    for flag, value in (("--batch", args.batch), ("--context", context), ("--prefill-len", prefill_len)):
        if value < 1:
            raise PlanError(f"{flag}={value} must be positive")
    if 2 * context > longest or prefill_len > longest:
        raise PlanError(f"--context={context} (compiled at it and twice it) and --prefill-len={prefill_len} must "
                        f"fit max_position_embeddings={longest} of {name}")
    compiler = getattr(args, "compiler", "cpu")
    if compiler == "tpu" and (target is None or target.name not in SLICES):
        raise PlanError(f"--compiler tpu needs a TPU --target: one of {', '.join(SLICES)}")
    return PlanSpec(cfg, name, mesh, hbm, args.dtype, check_quant(args.quant),
                    check_kv_cache_dtype(args.kv_cache_dtype), args.batch, context, prefill_len, args.target,
                    compiler, getattr(args, "layout", "tp"))


def fake_cpu_mesh(sizes: dict[str, int]) -> Mesh:
    """A mesh of that many fake CPU devices. JAX's `jax_num_cpu_devices` option (public, read when
    the backend starts; it overrides XLA_FLAGS' --xla_force_host_platform_device_count) must be set
    before any JAX operation: importing dsr1 runs none, so the command sets it first thing, in
    process, with no re-exec. A process whose backend has started keeps its devices (enough CPU
    devices are used as they are)."""
    n = math.prod(sizes.values())
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # the backend has started: use its devices if there are enough
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise PlanError(f"the mesh {_mesh_text(sizes)} needs {n} CPU devices but JAX started with {len(devices)}; "
                        f"run the plan in a fresh process (python -m dsr1.bench plan)")
    return make_mesh(devices=devices[:n], **sizes)


# ---- the replication check -----------------------------------------------------------------------

def split_problems(specs: Any, mesh: Mesh, rules: ShardingRules, intended: ShardingRules = DEFAULT_RULES) -> list[str]:
    """Every weight dimension that should be split but would not be: one whose logical axis `rules`
    or `intended` map to a mesh axis of size > 1, and that `rules` leave whole (mapped to no axis or
    to an axis of size 1) or that does not divide evenly over its axis. Empty: all is split."""
    problems = []

    def check(path, spec) -> None:
        name = jax.tree_util.keystr(path)
        for dim, (size, logical) in enumerate(zip(spec.shape, spec.axes)):
            wanted = [m for m in (rules.mesh_axis(logical), intended.mesh_axis(logical))
                      if m is not None and mesh.shape[m] > 1]
            if not wanted:
                continue
            axis = rules.mesh_axis(logical)
            if axis is None or mesh.shape[axis] == 1:
                problems.append(f"{name} {spec.shape}: dimension {dim} ({logical!r}) should be split over mesh axis "
                                f"{wanted[0]!r} (size {mesh.shape[wanted[0]]}) but the rules map {logical!r} to "
                                f"{axis!r}: it is replicated")
            elif size % mesh.shape[axis]:
                problems.append(f"{name} {spec.shape}: dimension {dim} ({logical!r}) of size {size} does not split "
                                f"over mesh axis {axis!r} of size {mesh.shape[axis]}")

    jax.tree_util.tree_map_with_path(check, specs, is_leaf=is_spec)
    return problems


def check_split(specs: Any, mesh: Mesh, rules: ShardingRules, intended: ShardingRules = DEFAULT_RULES) -> None:
    """Raise a `PlanError` listing every weight that should be split over the mesh but would not be."""
    problems = split_problems(specs, mesh, rules, intended)
    if problems:
        raise PlanError(f"{len(problems)} weight dimension(s) would not be split over the mesh "
                        f"{dict(mesh.shape)}:\n  " + "\n  ".join(problems))


# ---- abstract weights and cache, and their bytes -------------------------------------------------

def abstract_weights(cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: Any, quant: str | None) -> Any:
    """The weights as sharded `ShapeDtypeStruct`s (no memory), checked to be split over the mesh."""
    specs = param_specs(cfg, quant)
    check_split(specs, mesh, rules)
    return abstract_params(specs, mesh, rules, dtype)


def abstract_cache(cfg: Config, mesh: Mesh, batch: int, max_len: int, dtype: Any,
                   kv_cache_dtype: str | None, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
    """A decode cache of `max_len` positions per row as `ShapeDtypeStruct`s, laid out like the real one:
    its rows split as `rules` split rows (`keep_cache_rows`), whole on every device by default."""
    def sds(shape: tuple[int, ...], dt: Any) -> jax.ShapeDtypeStruct:
        axes = ("layers", "batch") if len(shape) > 1 else ("batch",)
        axes += (None,) * (len(shape) - len(axes))
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=rules.sharding(mesh, axes))

    rows = (cfg.num_hidden_layers, batch, max_len)
    int8 = kv_cache_dtype == "int8"
    return KVCache(sds((*rows, cfg.kv_lora_rank), jnp.int8 if int8 else dtype),
                   sds((*rows, cfg.qk_rope_head_dim), dtype), sds(rows, jnp.float32) if int8 else None,
                   sds((batch,), jnp.int32))


def row_split(mesh: Mesh, rules: ShardingRules) -> int:
    """Into how many shares the rows (and their decode cache) are split: the data-parallel ranks, or 1
    (the serving step's page pool may also split each row's positions: `cache.pool_axes`)."""
    return rules.devices(mesh, "batch")


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded `ShapeDtypeStruct`s: each leaf's shard."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def total_bytes(tree: Any) -> int:
    """Bytes of a pytree of `ShapeDtypeStruct`s, unsharded."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def weight_breakdown(weights: Any) -> dict[str, int]:
    """Per-device bytes by part: the routed experts, the rest of each layer stack, the globals."""
    parts: dict[str, int] = {}
    for key, sub in weights.items():
        if key == "moe_layers":
            routed = {k: sub["moe"][k] for k in ("gate", "up", "down")}
            parts["moe_layers (routed experts)"] = device_bytes(routed)
            parts["moe_layers (attention, shared experts, router)"] = device_bytes(sub) - device_bytes(routed)
        else:
            parts[key] = device_bytes(sub)
    return parts


def cache_bytes_per_token(cfg: Config, dtype: Any, kv_cache_dtype: str | None) -> int:
    """Bytes of one cached position, all layers: `c_kv` (int8 + a float32 scale, or `dtype`) and `k_pe`."""
    return cfg.num_hidden_layers * cache_token_bytes(cfg, dtype, kv_cache_dtype)


# ---- compiling the real programs -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program lowered and compiled for the mesh: seconds taken and XLA's memory analysis (per device)."""

    program: str
    shape: str
    lower_s: float
    compile_s: float
    compile_cpu_s: float  # this process's CPU seconds while compiling: less sensitive to a shared machine
    memory: dict[str, int]


def _compile(program: str, shape: str, jitted: Any, *args: Any, **kwargs: Any) -> Compiled:
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    lowered_at, cpu_at = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    done, cpu_done = time.perf_counter(), time.process_time()
    stats = compiled.memory_analysis()
    memory = {f: int(getattr(stats, f)) for f in MEMORY_FIELDS} if stats is not None else {}
    return Compiled(program, shape, lowered_at - start, done - lowered_at, cpu_done - cpu_at, memory)


def compile_decode(weights: Any, cfg: Config, mesh: Mesh, rules: ShardingRules, batch: int, context: int,
                   dtype: Any, kv_cache_dtype: str | None) -> Compiled:
    """`dsr1.programs.decode` (one step, cache donated) for `batch` rows and a cache of `context` positions."""
    cache = abstract_cache(cfg, mesh, batch, context, dtype, kv_cache_dtype, rules)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=replicated_sharding(mesh))
    return _compile("decode", f"batch {batch}, cache {context}", programs.decode, weights, cache, tokens, cfg=cfg,
                    mesh=mesh, rules=rules)


def compile_prefill(weights: Any, cfg: Config, mesh: Mesh, rules: ShardingRules, prompt: int,
                    kv_cache_dtype: str | None) -> Compiled:
    """`dsr1.programs.prefill` of one `prompt`-token row into a cache of as many positions."""
    rep = replicated_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((1, prompt), jnp.int32, sharding=rep)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep)
    return _compile("prefill", f"batch 1, prompt {prompt}", programs.prefill, weights, tokens, lengths, cfg=cfg,
                    mesh=mesh, rules=rules, max_len=prompt, kv_cache_dtype=kv_cache_dtype)


# ---- the fit -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Bytes one device needs to decode `batch` rows with `context` cache positions:
    weights + (cache per token + temp per token) x batch x context + fixed temp."""

    weight_bytes: int
    cache_token_bytes: int
    temp_fixed: float
    temp_per_token: float

    @classmethod
    def from_compiles(cls, weight_bytes: int, cache_token_bytes: int, small: Compiled, large: Compiled,
                      small_tokens: int, large_tokens: int) -> MemoryModel:
        """XLA's decode temporaries at two cache sizes, split into a fixed and a per-token part."""
        t_small, t_large = small.memory.get("temp_size_in_bytes", 0), large.memory.get("temp_size_in_bytes", 0)
        per_token = max(0.0, (t_large - t_small) / (large_tokens - small_tokens))
        return cls(weight_bytes, cache_token_bytes, max(0.0, t_small - per_token * small_tokens), per_token)

    def needed(self, batch: int, context: int, with_temp: bool = True) -> float:
        tokens = batch * context
        cache = self.cache_token_bytes * tokens
        return self.weight_bytes + cache + (self.temp_fixed + self.temp_per_token * tokens if with_temp else 0)

    def max_tokens(self, budget: float, with_temp: bool = True) -> int:
        """The most cached positions (batch x context) within `budget` bytes (0: not even the weights)."""
        free = budget - self.weight_bytes - (self.temp_fixed if with_temp else 0)
        per_token = self.cache_token_bytes + (self.temp_per_token if with_temp else 0)
        return max(0, int(free // per_token))


def fit_rows(model: MemoryModel, budget: float, contexts: list[int]) -> list[dict[str, Any]]:
    """For each context, the largest batch that fits `budget` with XLA's temporaries and without them."""
    rows = []
    for context in contexts:
        batch = model.max_tokens(budget) // context
        rows.append({"context": context, "max_batch": batch,
                     "gib_at_max_batch": model.needed(batch, context) / GIB if batch else None,
                     "max_batch_weights_cache_only": model.max_tokens(budget, with_temp=False) // context})
    return rows


def fit_contexts(cfg: Config) -> list[int]:
    return sorted({c for c in CONTEXTS if c < cfg.max_position_embeddings} | {cfg.max_position_embeddings})


# ---- the plan ------------------------------------------------------------------------------------

def make_plan(spec: PlanSpec, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
              log: Any = lambda msg: None) -> dict[str, Any]:
    """Build the abstract weights, compile decode (twice) and prefill, and fit the device memory.
    Raises `PlanError` when a weight would not be split over the mesh."""
    cfg, dtype = spec.cfg, jnp.dtype(spec.dtype)
    weights = abstract_weights(cfg, mesh, rules, dtype, spec.quant)
    weight_bytes = device_bytes(weights)
    token_bytes = cache_bytes_per_token(cfg, dtype, spec.kv_cache_dtype)
    device_token_bytes = -(-token_bytes // row_split(mesh, rules))  # what one device holds of a cached token
    steps = [("decode", spec.context), ("decode", 2 * spec.context), ("prefill", spec.prefill_len)]
    compiled = []
    for i, (program, size) in enumerate(steps):
        log(f"[{i + 1}/{len(steps)}] lowering and compiling {program} ({size} positions) for {spec.devices} "
            f"devices ...")
        if program == "decode":
            compiled.append(compile_decode(weights, cfg, mesh, rules, spec.batch, size, dtype, spec.kv_cache_dtype))
        else:
            compiled.append(compile_prefill(weights, cfg, mesh, rules, size, spec.kv_cache_dtype))
        log(f"    {compiled[-1].lower_s:.1f} s to lower, {compiled[-1].compile_s:.1f} s to compile "
            f"({compiled[-1].compile_cpu_s:.1f} CPU s)")
    model = MemoryModel.from_compiles(weight_bytes, device_token_bytes, compiled[0], compiled[1],
                                      spec.batch * spec.context, spec.batch * 2 * spec.context)
    plan: dict[str, Any] = {
        "model": spec.name, "devices": spec.devices, "mesh": spec.mesh, "target": spec.target, "hbm_gib": spec.hbm_gib,
        "dtype": spec.dtype, "quant": spec.quant, "kv_cache_dtype": spec.kv_cache_dtype,
        "weight_bytes_total": total_bytes(weights), "weight_bytes_per_device": weight_bytes,
        "weight_breakdown": weight_breakdown(weights), "cache_bytes_per_token": token_bytes,
        "layout": rules_layout(rules), "cache_bytes_per_token_per_device": device_token_bytes,
        "temp_fixed_bytes": model.temp_fixed, "temp_bytes_per_token": model.temp_per_token,
        "compiled": [dataclasses.asdict(c) for c in compiled], "safety_margin": SAFETY_MARGIN,
    }
    if spec.hbm_gib is not None:
        budget = spec.hbm_gib * GIB * (1 - SAFETY_MARGIN)
        prefill = compiled[2].memory
        prefill_peak = weight_bytes + sum(prefill.get(f, 0) for f in ("output_size_in_bytes", "temp_size_in_bytes"))
        plan.update(budget_bytes=budget, weights_fit=weight_bytes <= budget,
                    max_tokens=model.max_tokens(budget), max_tokens_weights_cache_only=model.max_tokens(budget, False),
                    fit=fit_rows(model, budget, fit_contexts(cfg)), prefill_peak_bytes=prefill_peak,
                    prefill_fits=prefill_peak <= budget)
    return plan


def make_tpu_plan(spec: PlanSpec, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                  log: Any = lambda msg: None) -> dict[str, Any]:
    """Compile the serving step (at the asked batch x context and at twice the context) and prefill with
    XLA:TPU for the target slice's devices (`mesh`, from `tpu.topology_mesh`), and fit the chip's HBM."""
    cfg, dtype = spec.cfg, jnp.dtype(spec.dtype)
    chip = SLICES[spec.target].chip
    weights = abstract_weights(cfg, mesh, rules, dtype, spec.quant)
    steps = [("serve_step", spec.context), ("serve_step", 2 * spec.context), ("prefill", spec.prefill_len)]
    compiled = []
    for i, (program, size) in enumerate(steps):
        log(f"[{i + 1}/{len(steps)}] lowering and compiling {program} ({size} positions) with XLA:TPU for "
            f"{spec.target} ({spec.devices} devices) ...")
        if program == "serve_step":
            compiled.append(tpu.compile_serve_step(weights, cfg, mesh, rules, spec.batch, size, dtype,
                                                   spec.kv_cache_dtype))
        else:
            compiled.append(tpu.compile_prefill_tpu(weights, cfg, mesh, rules, size, spec.kv_cache_dtype))
        c = compiled[-1]
        log(f"    {c.lower_s:.1f} s to lower, {c.compile_s:.1f} s to compile"
            + (f"; refused: {c.refused}" if c.refused else ""))
    step = compiled[0]
    available = next((c.hbm_available_bytes for c in compiled if c.hbm_available_bytes), None)
    budget = available or (spec.hbm_gib if spec.hbm_gib is not None else chip.hbm_gib) * GIB
    tokens = spec.batch * spec.context
    token_bytes = cache_bytes_per_token(cfg, dtype, spec.kv_cache_dtype)
    device_token_bytes = -(-token_bytes // pool_shares(mesh, rules))  # the page pool is split so
    fitted = tpu.fit(compiled[0], compiled[1], tokens, 2 * tokens, budget, fit_contexts(cfg), device_token_bytes)
    per_step = step.bytes_accessed_per_step
    return {
        "model": spec.name, "compiler": "tpu", "devices": spec.devices, "mesh": spec.mesh, "target": spec.target,
        "chip": dataclasses.asdict(chip), "topology": SLICES[spec.target].topology, "hbm_gib": spec.hbm_gib,
        "dtype": spec.dtype, "quant": spec.quant, "kv_cache_dtype": spec.kv_cache_dtype,
        "batch": spec.batch, "context": spec.context,
        "weight_bytes_total": total_bytes(weights), "weight_bytes_per_device": device_bytes(weights),
        "weight_breakdown": weight_breakdown(weights),
        "cache_bytes_per_token": token_bytes, "layout": rules_layout(rules),
        "cache_bytes_per_token_per_device": device_token_bytes,
        "compiled": [dataclasses.asdict(c) for c in compiled], "budget_bytes": budget,
        "fits": step.refused is None and step.peak_bytes <= budget, "peak_bytes": step.peak_bytes,
        "prefill_fits": compiled[2].refused is None and compiled[2].peak_bytes <= budget, **fitted,
        "bytes_accessed_per_step": per_step, "xla_bytes_accessed": step.xla_bytes_accessed,
        "step_time_s": None if per_step is None else per_step / chip.hbm_bytes_per_s,
        "collectives": step.collectives, "expert_copies": step.expert_copies,
    }


# ---- the report ----------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def plan_report(plan: dict[str, Any]) -> str:
    """The plan as Markdown: sizes, the compiled programs, and the fit."""
    lines = [f"plan: {plan['model']} ({plan['layout']}) weights {plan['dtype']}{' + int8' if plan['quant'] else ''}, "
             f"KV cache {plan['kv_cache_dtype'] or plan['dtype']}; {plan['devices']} devices, "
             f"mesh {_mesh_text(plan['mesh'])}"
             + (f" ({plan['target']}: {TARGETS[plan['target']].about})" if plan["target"] else ""), "",
             f"- weights: {_gib(plan['weight_bytes_total'])} GiB in all, **{_gib(plan['weight_bytes_per_device'])} "
             f"GiB per device**"]
    lines += [f"  - {part}: {_gib(n)} GiB" for part, n in plan["weight_breakdown"].items()]
    lines += [f"- cache: **{plan['cache_bytes_per_token']:,} bytes per token** (all layers; "
              + (f"layout dp: rows split over the expert axis, {plan['cache_bytes_per_token_per_device']:,} per device)"
                 if plan["layout"] == "dp" else "layout tp: every row on every device, so per device too)"),
              f"- XLA temporaries of a decode step (XLA:CPU): {_gib(plan['temp_fixed_bytes'])} GiB fixed + "
              f"{plan['temp_bytes_per_token']:,.0f} bytes per cached token", "",
              "| program | shape | lower s | compile s (CPU s) | arguments GiB | outputs GiB | aliased GiB | temp GiB "
              "|",
              "|---|---|--:|--:|--:|--:|--:|--:|"]
    for c in plan["compiled"]:
        m = c["memory"]
        lines.append(f"| {c['program']} | {c['shape']} | {c['lower_s']:.1f} | {c['compile_s']:.1f} "
                     f"({c['compile_cpu_s']:.1f}) | "
                     + " | ".join(_gib(m.get(f, 0)) for f in MEMORY_FIELDS[:4]) + " |")
    if plan["hbm_gib"] is None:
        return "\n".join(lines + ["", "no --hbm or --target: no fit computed"])
    lines += ["", f"device memory {plan['hbm_gib']:g} GiB, {plan['safety_margin']:.0%} held back: "
                  f"budget {_gib(plan['budget_bytes'])} GiB per device", ""]
    if not plan["weights_fit"]:
        advice = "more devices" if plan["quant"] else "int8 weights (--quant int8) or more devices"
        return "\n".join(lines + [f"**DOES NOT FIT: the weights alone need {_gib(plan['weight_bytes_per_device'])} "
                                  f"GiB per device, over the {_gib(plan['budget_bytes'])} GiB budget.** Use "
                                  f"{advice}."])
    lines += [f"largest batch x context: **{plan['max_tokens']:,} cached tokens** with XLA's temporaries, "
              f"{plan['max_tokens_weights_cache_only']:,} with weights + cache only", "",
              "| context | max batch | GiB per device at it | max batch (weights + cache only) |",
              "|--:|--:|--:|--:|"]
    for row in plan["fit"]:
        at = "-" if row["gib_at_max_batch"] is None else f"{row['gib_at_max_batch']:.2f}"
        lines.append(f"| {row['context']:,} | {row['max_batch']:,} | {at} | {row['max_batch_weights_cache_only']:,} |")
    lines += ["", f"prefill of one {plan['compiled'][2]['shape'].split()[-1]}-token prompt: "
                  f"{_gib(plan['prefill_peak_bytes'])} GiB per device (weights + outputs + temp): "
                  + ("fits" if plan["prefill_fits"] else "**does not fit**")]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The `plan` command: fake the mesh's devices (or describe the TPU slice's), compile, fit, print the
    report."""
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        spec = spec_from_options(args)
        if spec.compiler == "tpu":
            try:
                jax.config.update("jax_platforms", "cpu")  # the runtime: no TPU is opened, only compiled for
            except RuntimeError:
                pass  # the backend has started (on CPU, unless a TPU is here: compiling for it works too)
            mesh = tpu.topology_mesh(SLICES[spec.target], spec.mesh)
            dev = device_description()
            plan = make_tpu_plan(spec, mesh, layout_rules(spec.layout), log=log)
        else:
            mesh = fake_cpu_mesh(spec.mesh)  # first: before anything starts JAX's backend
            dev = device_description()
            plan = make_plan(spec, mesh, layout_rules(spec.layout), log=log)
    except (PlanError, tpu.TpuPlanError) as e:
        raise SystemExit(f"plan: {e}") from None
    dev = with_final_load(dev)
    print(device_line(dev))
    print(tpu.tpu_report(plan) if spec.compiler == "tpu" else plan_report(plan))
    return {"command": "plan", "device": dev, **plan}
