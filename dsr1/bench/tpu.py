"""`python -m dsr1.bench plan --compiler tpu`: the compiler's own answer to "does it fit, and what moves".

libtpu compiles for a TPU topology on a host without a TPU: `jax.experimental.topologies` describes
the slice's devices, the mesh is made of them, and the real programs are lowered with abstract,
sharded arguments and compiled by XLA:TPU (the runtime stays on CPU; nothing runs). Compiled are the
serving engine's step (`dsr1.programs.step.serve_step`: one decode token per row against a page pool, the
program the server runs), at the asked batch x context and at twice the context, and
`dsr1.programs.prefill` of one prompt. From each:

- XLA:TPU's memory analysis per device, or its refusal when the program exceeds the chip's HBM (the
  message's figures are kept);
- XLA:TPU's cost analysis ("bytes accessed", which counts each loop body once) and, walking the
  compiled HLO with every loop's trip count (`dsr1.bench.hlo`), the bytes the step reads and writes
  per call and the step time that implies at the chip's HBM bandwidth;
- every collective of the step with its bytes per device and how often it runs, and every copy of a
  device's whole stack of routed experts.

The largest batch x context comes from the two serving-step compiles: the bytes one device needs,
fixed + per cached token, fitted through both and held to the chip's HBM.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from .. import programs
from ..core.cache import empty_paged_cache, pool_shares, pool_specs
from ..core.config import Config
from ..core.model import default_block_pages
from ..core.sharding import DEFAULT_RULES, ShardingRules, make_mesh, replicated_sharding
from ..generation.sampling import Sampling, batch_sampling
from ..programs import step as serving
from . import hlo
from .chips import Slice

GIB = 2**30
PAGE_SIZE = 16  # the serving engine's default page size
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# XLA:TPU refuses a program over the chip's HBM in one of two wordings: "... (16.80G) exceeds available
# HBM (15.75G)" and "Used 16.42G of 15.75G hbm".
_REFUSAL = re.compile(r"\(?(\d+(?:\.\d+)?)([KMGT]?)\)?\s+exceeds available HBM \((\d+(?:\.\d+)?)([KMGT]?)\)"
                      r"|Used (\d+(?:\.\d+)?)([KMGT]?) of (\d+(?:\.\d+)?)([KMGT]?) hbm")


class TpuPlanError(ValueError):
    """A TPU plan that cannot be made here (libtpu missing, an unknown slice)."""


def check_libtpu() -> None:
    """Fail clearly when libtpu is not installed: it is the compiler."""
    if importlib.util.find_spec("libtpu") is None:
        raise TpuPlanError(f"--compiler tpu compiles with libtpu, which is not installed: pip install "
                           f"'dsr1[tpu-plan]' (or pip install 'jax[tpu]=={jax.__version__}', the libtpu matching "
                           f"this jax)")


def topology_mesh(slice_: Slice, sizes: dict[str, int]) -> Mesh:
    """A mesh of the slice's TPU devices (described, not opened) with the given axis sizes. dsr1 picks
    its per-platform paths from the mesh's devices, so this CPU host compiles what a TPU would run."""
    check_libtpu()
    from jax.experimental import topologies

    # libtpu locks /tmp/libtpu_lockfile so that one process owns a host's TPU; nothing is opened here,
    # so plans may compile side by side.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(platform="tpu", topology_name=slice_.topology,
                                           chip_config_name="default", chips_per_host_bounds=slice_.chips_per_host,
                                           num_slices=1).devices
    if math.prod(sizes.values()) != len(devices):
        raise TpuPlanError(f"the mesh {sizes} needs {math.prod(sizes.values())} devices; {slice_.name} "
                           f"({slice_.topology}) has {len(devices)}")
    return make_mesh(devices=devices, **sizes)


# ---- the programs' abstract arguments ------------------------------------------------------------

def _replicated(tree: Any, mesh: Mesh) -> Any:
    rep = replicated_sharding(mesh)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)


def serving_args(cfg: Config, mesh: Mesh, batch: int, context: int, dtype: Any, kv_cache_dtype: str | None,
                 page_size: int = PAGE_SIZE, rules: ShardingRules = DEFAULT_RULES) -> tuple[Any, ...]:
    """`serve_step`'s arguments after the weights, abstract: a page pool holding `context` positions for
    each of `batch` slots (+ a scratch page per share of the pool), the slots' state, one decode row per
    slot, the page table. The pool placed as `rules` place it (`keep_pool_layout`: whole on every
    device, or its pages split over the data-parallel ranks), the rest replicated."""
    pages = -(-context // page_size)
    num_pages = batch * pages + pool_shares(mesh, rules)
    cache = jax.eval_shape(lambda: empty_paged_cache(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_lora_rank,
                                                     cfg.qk_rope_head_dim, jnp.dtype(dtype), kv_cache_dtype,
                                                     platform="tpu"))
    sampling = batch_sampling([Sampling()] * batch)
    state = jax.eval_shape(functools.partial(serving.slot_state, mesh=mesh, vocab_size=cfg.vocab_size), sampling)
    rows = jax.ShapeDtypeStruct((batch, len(serving.StepRows._COLUMNS) + 1), jnp.int32)
    table = jax.ShapeDtypeStruct((batch, pages), jnp.int32)
    specs = pool_specs(cache, mesh, rules)
    cache = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
                         cache, specs)
    return (cache, *_replicated((state, rows, table), mesh))


def page_loop_trips(context: int, page_size: int = PAGE_SIZE) -> int:
    """Steps of extend's page loop for rows holding `context` positions (its bound is dynamic)."""
    pages = -(-context // page_size)
    return -(-pages // default_block_pages(page_size, pages))


def expert_stack_dims(weights: Any) -> list[tuple[int, ...]]:
    """Shapes of one device's routed experts: each stack's shard, all layers and one layer."""
    if "moe_layers" not in weights:
        return []
    dims = []
    for name in ("gate", "up", "down"):
        for leaf in jax.tree.leaves(weights["moe_layers"]["moe"][name]):
            shard = tuple(leaf.sharding.shard_shape(leaf.shape))
            if len(shard) == 4:  # [layers, experts, in, out]; not the int8 scales
                dims += [shard, shard[1:]]
    return dims


# ---- compiling -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TpuCompiled:
    """One program compiled by XLA:TPU, or refused by it for want of HBM."""

    program: str
    shape: str
    lower_s: float
    compile_s: float
    memory: dict[str, int]  # XLA's memory analysis per device (empty if refused)
    peak_bytes: int  # per device: arguments + outputs - aliased + temporaries (or the refusal's figure)
    refused: str | None  # XLA:TPU's message when the program does not fit
    hbm_available_bytes: int | None  # what XLA:TPU said the chip has, when it refused
    xla_bytes_accessed: float | None  # XLA's cost analysis (each loop body once)
    bytes_accessed_per_step: int | None  # the compiled HLO walked with loop trip counts
    collectives: list[dict[str, Any]]
    expert_copies: list[dict[str, Any]]


def _size(value: str, unit: str) -> int:
    return int(float(value) * _UNITS[unit])


def _peak(memory: dict[str, int]) -> int:
    return (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"]
            + memory["temp_size_in_bytes"])


def compile_tpu(program: str, shape: str, jitted: Any, args: tuple, kwargs: dict[str, Any],
                expert_dims: list[tuple[int, ...]], dynamic_trips: int) -> TpuCompiled:
    """Lower and compile for the TPU mesh; read memory, cost, collectives and expert copies."""
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    lowered_at = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA:TPU refuses a program over the chip's HBM with RESOURCE_EXHAUSTED
        m = _REFUSAL.search(str(e))
        if m is None:
            raise
        need, need_unit, hbm, hbm_unit = m.group(1, 2, 3, 4) if m.group(1) else m.group(5, 6, 7, 8)
        done = time.perf_counter()
        return TpuCompiled(program, shape, lowered_at - start, done - lowered_at, {}, _size(need, need_unit),
                           str(e).strip().splitlines()[0], _size(hbm, hbm_unit), None, None, [], [])
    done = time.perf_counter()
    stats = compiled.memory_analysis()
    memory = {f: int(getattr(stats, f)) for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                  "alias_size_in_bytes", "temp_size_in_bytes",
                                                  "generated_code_size_in_bytes")}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    module = hlo.parse_module(compiled.as_text())
    runs = hlo.executions(module, dynamic_trips)
    collectives = [dict(op=c.op, bytes=c.bytes, runs=c.runs, name=c.name, source=c.source)
                   for c in hlo.collectives(module, runs)]
    copies = [dataclasses.asdict(c) for c in hlo.copies_of(module, runs, expert_dims)]
    return TpuCompiled(program, shape, lowered_at - start, done - lowered_at, memory, _peak(memory), None, None,
                       float(cost.get("bytes accessed", 0.0)) if cost else None,
                       hlo.bytes_accessed(module, runs), collectives, copies)


def compile_serve_step(weights: Any, cfg: Config, mesh: Mesh, rules: ShardingRules, batch: int, context: int,
                       dtype: Any, kv_cache_dtype: str | None) -> TpuCompiled:
    """The serving engine's step (`dsr1.programs.step.serve_step`): one decode token for each of `batch`
    slots holding `context` positions."""
    args = serving_args(cfg, mesh, batch, context, dtype, kv_cache_dtype, rules=rules)
    return compile_tpu("serve_step", f"batch {batch}, cache {context}", serving.serve_step, (weights, *args),
                       dict(cfg=cfg, mesh=mesh, rules=rules), expert_stack_dims(weights), page_loop_trips(context))


def compile_prefill_tpu(weights: Any, cfg: Config, mesh: Mesh, rules: ShardingRules, prompt: int,
                        kv_cache_dtype: str | None) -> TpuCompiled:
    """`dsr1.programs.prefill` of one `prompt`-token row."""
    rep = replicated_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((1, prompt), jnp.int32, sharding=rep)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep)
    return compile_tpu("prefill", f"batch 1, prompt {prompt}", programs.prefill, (weights, tokens, lengths),
                       dict(cfg=cfg, mesh=mesh, rules=rules, max_len=prompt, kv_cache_dtype=kv_cache_dtype),
                       expert_stack_dims(weights), 1)


# ---- the fit -------------------------------------------------------------------------------------

def fit(small: TpuCompiled, large: TpuCompiled, small_tokens: int, large_tokens: int, budget: float,
        contexts: list[int], cache_token_bytes: int) -> dict[str, Any]:
    """The bytes a device needs, fixed + per cached token, through the two serving-step compiles (XLA's
    peak, or the figure of its refusal; per token at least the page pool's `cache_token_bytes`, which
    small pools' padding can hide); the most cached tokens within `budget` and the batch per context."""
    per_token = max(cache_token_bytes, (large.peak_bytes - small.peak_bytes) / (large_tokens - small_tokens))
    fixed = small.peak_bytes - per_token * small_tokens
    tokens = 0 if fixed > budget else int((budget - fixed) // per_token)
    return {"fixed_bytes": fixed, "bytes_per_cached_token": per_token, "max_cached_tokens": tokens,
            "max_batch": {str(c): tokens // c for c in contexts}}


# ---- the report ----------------------------------------------------------------------------------

def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def tpu_report(plan: dict[str, Any], top: int = 12) -> str:
    """The TPU plan as Markdown: the compiled programs' memory, the fit, bytes per step, collectives."""
    chip = plan["chip"]
    mesh = ",".join(f"{k}={v}" for k, v in plan["mesh"].items())
    lines = [f"plan (XLA:TPU): {plan['model']} ({plan['layout']}) weights {plan['dtype']}"
             f"{' + int8' if plan['quant'] else ''}, KV cache {plan['kv_cache_dtype'] or plan['dtype']}; "
             f"{plan['target']} ({plan['topology']}, "
             f"{plan['devices']} devices of {chip['hbm_gib']:g} GiB at {chip['hbm_bytes_per_s'] / 1e9:,.0f} GB/s), "
             f"mesh {mesh}", "",
             f"- weights: {_gib(plan['weight_bytes_total'])} GiB in all, **{_gib(plan['weight_bytes_per_device'])} "
             f"GiB per device**; cache {plan['cache_bytes_per_token']:,} bytes per token, "
             f"{plan['cache_bytes_per_token_per_device']:,} of them per device (layout {plan['layout']})",
             "", "| program | shape | lower s | compile s | arguments GiB | outputs GiB | aliased GiB | temp GiB | "
             "peak GiB | XLA:TPU |", "|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for c in plan["compiled"]:
        m = c["memory"]
        cells = [_gib(m.get(f)) for f in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                                            "temp_size_in_bytes")]
        lines.append(f"| {c['program']} | {c['shape']} | {c['lower_s']:.1f} | {c['compile_s']:.1f} | "
                     + " | ".join(cells) + f" | {_gib(c['peak_bytes'])} | {c['refused'] or 'compiled'} |")
    lines += ["", f"budget: {_gib(plan['budget_bytes'])} GiB per device. The serving step at batch {plan['batch']} x "
                  f"{plan['context']:,} positions: " + ("**fits**" if plan["fits"] else "**does not fit**")
              + f" ({_gib(plan['peak_bytes'])} GiB); prefill: " + ("fits" if plan["prefill_fits"] else
                                                                   "**does not fit**"),
              f"- per device: {_gib(plan['fixed_bytes'])} GiB fixed + {plan['bytes_per_cached_token']:,.0f} bytes "
              f"per cached token: **{plan['max_cached_tokens']:,} cached tokens** fit; max batch "
              + ", ".join(f"{int(c):,}: {b:,}" for c, b in plan["max_batch"].items())]
    if plan["compiled"][0]["refused"]:
        lines.append("- the serving step was refused, so there is no compiled HLO to read: a smaller --batch or "
                     "--context shows its bytes per step and collectives")
    if plan["bytes_accessed_per_step"] is not None:
        lines += [f"- bytes accessed per serving step (HLO walked with loop trip counts): "
                  f"**{_gib(plan['bytes_accessed_per_step'])} GiB per device** -> {plan['step_time_s'] * 1e3:.2f} ms "
                  f"at {chip['hbm_bytes_per_s'] / 1e9:,.0f} GB/s (XLA's cost analysis, loop bodies once: "
                  f"{_gib(plan['xla_bytes_accessed'])} GiB)"]
    if plan["collectives"]:
        moved = sum(c["bytes"] * c["runs"] for c in plan["collectives"])
        lines += [f"- collectives per serving step: {sum(c['runs'] for c in plan['collectives']):,} runs, "
                  f"{_mb(moved)} MB per device; the largest:", "",
                  "| op | MB per run | runs | from |", "|---|--:|--:|---|"]
        lines += [f"| {c['op']} | {_mb(c['bytes'])} | {c['runs']} | {c['source'][-90:]} |"
                  for c in plan["collectives"][:top]]
    if plan["expert_copies"]:
        lines += ["", "**copies of a whole local expert stack** (per serving step):", "",
                  "| copy | shape | MB | runs |", "|---|---|--:|--:|"]
        lines += [f"| {c['name']} | {c['shape']} | {_mb(c['bytes'])} | {c['runs']} |" for c in plan["expert_copies"]]
    return "\n".join(lines)
