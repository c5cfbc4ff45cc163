"""Decode profiles for the workbench: step latency over time, throughput by batch size, device time
by model block (from a `jax.profiler` trace), and achieved bandwidth against the measured peak.

Device time is attributed to blocks through the `jax.named_scope`s of the model (`mla_decode`,
`routed_experts`, `shared_experts`, `router`, `lm_head`, ...): a trace event names an HLO op,
and the compiled HLO's metadata names the scope that op came from.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from .. import programs
from ..api import Model
from ..bench.accounting import mean_step_bytes
from ..bench.bandwidth import copy_bandwidth
from ..bench.timing import random_cache, time_decode
from ..core.sharding import put_replicated

BLOCKS = (  # (label, scope marker in an op's name path); the first match wins
    ("routed experts", "routed_experts"),
    ("shared experts", "shared_experts"),
    ("router", "router"),
    ("attention", "mla_"),
    ("dense MLP", "/mlp"),
    ("lm head", "lm_head"),
)
OTHER = "other"


@dataclasses.dataclass(frozen=True)
class DecodeProfile:
    batch: int
    context: int
    step_ms: np.ndarray  # latency of each decode step at `batch`, in order
    tokens_per_second: dict[int, float]  # aggregate decode throughput by batch size
    block_ms: dict[str, float]  # device time per step by model block, per device (the mean over this process's)
    traced_step_ms: float  # wall time per step while the trace ran (the profiler slows steps down)
    bytes_per_step: int  # what a step at `batch` really reads (see dsr1.bench)
    achieved_gbs: float
    peak_gbs: float  # measured copy bandwidth (bytes read + written)

    def summary(self) -> str:
        blocks = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(self.block_ms.items(), key=lambda kv: -kv[1]))
        rates = ", ".join(f"batch {b}: {r:,.1f}" for b, r in self.tokens_per_second.items())
        return (f"decode at batch {self.batch}, context {self.context}: median step {np.median(self.step_ms):.2f} ms\n"
                f"tok/s by batch: {rates}\n"
                f"device time per step by block, per device: {blocks} "
                f"({sum(self.block_ms.values()):.2f} ms of the traced step's {self.traced_step_ms:.2f} ms)\n"
                f"bandwidth: {self.bytes_per_step / 1e6:.1f} MB/step -> {self.achieved_gbs:.1f} GB/s achieved, "
                f"{self.achieved_gbs / self.peak_gbs:.0%} of the measured {self.peak_gbs:.1f} GB/s copy bandwidth")


def step_latencies(model: Model, batch: int, context: int, steps: int) -> np.ndarray:
    """Wall time of each of `steps` decode steps (ms), one host-synchronized step at a time."""
    cache = random_cache(model, batch, context, context + steps + 2)
    tokens = np.ones(batch, np.int32)
    _, cache = model.decode(cache, tokens)  # compile
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        logits, cache = model.decode(cache, tokens)
        jax.block_until_ready(logits)
        out.append((time.perf_counter() - start) * 1e3)
    return np.array(out)


def throughput(model: Model, batches: tuple[int, ...], context: int, steps: int) -> tuple[dict[int, float], dict]:
    """Aggregate decode tok/s for each batch size (a jitted loop of `steps` steps), and the runs."""
    rates, runs = {}, {}
    for b in batches:
        run = time_decode(model, lambda i, b=b: random_cache(model, b, context, context + steps + 1, seed=i),
                          np.ones(b, np.int32), steps)
        rates[b], runs[b] = b * steps / run.seconds, run
    return rates, runs


def _scope_of_ops(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the block its `op_name` metadata places it in."""
    blocks = {}
    for m in re.finditer(r"%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"", hlo_text):
        name, path = m.groups()
        blocks[name] = next((label for label, marker in BLOCKS if marker in path), OTHER)
    return blocks


def time_by_block(model: Model, batch: int, context: int, steps: int,
                  logdir: str | Path | None = None) -> tuple[dict[str, float], float]:
    """Device time per decode step by model block, per device, from a `jax.profiler` trace of `steps`
    steps (`per_device_block_ms`), and the wall time per step while the trace ran (ms). The trace is
    kept in `logdir` when one is given (for TensorBoard or Perfetto); otherwise it is removed."""
    cache = random_cache(model, batch, context, context + steps + 2)
    tokens = put_replicated(np.ones(batch, np.int32), model.mesh)
    hlo = programs.decode.lower(model.params, cache, tokens, **model.program_kwargs).compile().as_text()
    blocks = _scope_of_ops(hlo)
    _, cache = model.decode(cache, tokens)  # compile the jitted path too
    if logdir is None:
        with tempfile.TemporaryDirectory(prefix="dsr1-trace-") as tmp:
            events, wall_ms = _trace_decode(model, cache, tokens, steps, Path(tmp))
    else:
        events, wall_ms = _trace_decode(model, cache, tokens, steps, Path(logdir))
    return per_device_block_ms(events, blocks, steps, _local_devices(model)), wall_ms


def _trace_decode(model: Model, cache, tokens, steps: int, logdir: Path) -> tuple[list[dict], float]:
    """The trace events of `steps` decode steps, written to and read back from `logdir`, and the wall
    time per step while the trace ran (ms)."""
    with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
        start = time.perf_counter()
        for _ in range(steps):
            logits, cache = model.decode(cache, tokens)
            jax.block_until_ready(logits)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    trace = max(logdir.glob("**/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    with gzip.open(trace, "rt") as f:
        events = json.load(f)
    return (events["traceEvents"] if isinstance(events, dict) else events), wall_ms


def per_device_block_ms(events: list[dict], blocks: dict[str, str], steps: int, devices: int) -> dict[str, float]:
    """Milliseconds per step by block (`blocks`: HLO op name -> block) of the trace `events` of
    `steps` steps: the ops' time on every device of this process (the trace holds them all), divided
    by their number, so that it compares with a step's wall time."""
    totals: dict[str, float] = {}
    for e in events:
        op = (e.get("args") or {}).get("hlo_op")
        if e.get("ph") == "X" and op:
            label = blocks.get(op, blocks.get(op.removeprefix("wrapped_"), OTHER))
            totals[label] = totals.get(label, 0.0) + e.get("dur", 0.0) / 1e3 / steps
    return {label: ms / devices for label, ms in totals.items()}


def _local_devices(model: Model) -> int:
    """How many of the model's mesh devices this process drives (those its trace records)."""
    return sum(1 for d in model.mesh.devices.flat if d.process_index == jax.process_index())


def profile_decode(model: Model, *, batch: int = 4, batches: tuple[int, ...] = (1, 2, 4, 8), context: int = 64,
                   steps: int = 16, copy_bytes: int = 256 * 2**20, logdir: str | Path | None = None) -> DecodeProfile:
    """Everything the workbench plots, for the model as placed on its mesh."""
    rates, runs = throughput(model, tuple(sorted(set(batches) | {batch})), context, steps)
    run = runs[batch]
    nbytes = mean_step_bytes(model.params, model.cfg, model.kv_cache_dtype, context, run.tokens, run.expert_ids)
    block_ms, traced_step_ms = time_by_block(model, batch, context, steps, logdir)
    return DecodeProfile(
        batch=batch, context=context, step_ms=step_latencies(model, batch, context, steps),
        tokens_per_second={b: rates[b] for b in batches}, block_ms=block_ms, traced_step_ms=traced_step_ms,
        bytes_per_step=nbytes.total, achieved_gbs=nbytes.total * steps / run.seconds / 1e9,
        peak_gbs=copy_bandwidth(copy_bytes))


def plot_profile(profile: DecodeProfile):
    """A 2 x 2 matplotlib figure: step latency, tok/s by batch, time by block, bandwidth vs peak."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(profile.step_ms, marker=".")
    ax[0, 0].set(title=f"decode step latency (batch {profile.batch})", xlabel="step", ylabel="ms")
    batches = list(profile.tokens_per_second)
    ax[0, 1].bar([str(b) for b in batches], [profile.tokens_per_second[b] for b in batches])
    ax[0, 1].set(title="decode throughput", xlabel="batch size", ylabel="tokens / s")
    blocks = sorted(profile.block_ms.items(), key=lambda kv: kv[1])
    ax[1, 0].barh([k for k, _ in blocks], [v for _, v in blocks])
    ax[1, 0].set(title="device time per step by block, per device (trace)", xlabel="ms")
    ax[1, 1].bar(["achieved", "measured peak"], [profile.achieved_gbs, profile.peak_gbs], color=["C0", "C7"])
    ax[1, 1].set(title=f"bandwidth ({profile.bytes_per_step / 1e6:.1f} MB/step)", ylabel="GB/s")
    fig.tight_layout()
    return fig
