"""The device a benchmark runs on: its measured copy and read bandwidths (the rooflines that
decode's achieved bandwidth is reported against) and a description for the report."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .timing import best_of

COPY_BYTES = 2**29  # 512 MiB: far beyond any cache, so the copy runs at memory speed


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Measured memory bandwidth in GB/s: the best of `repeats` runs of a jitted `x + 1` over
    `nbytes` of float32 (in place: the input is donated), counting bytes read plus bytes written.
    `x + 1` cannot be elided, unlike a copy of an unchanged buffer."""
    bump = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = jax.block_until_ready(bump(jnp.zeros(nbytes // 4, jnp.float32)))  # compile, touch every page
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(bump(x))
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def read_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Measured read bandwidth in GB/s: the best of `repeats` runs of a jitted max over `nbytes` of
    bfloat16, counting the bytes read. A decode step reads its weights and cache and writes next to
    nothing, so this, not the copy's read-plus-write rate, is the floor of its step time: on a
    shared CPU the two move apart."""
    largest = jax.jit(jnp.max)
    x = jax.block_until_ready(jnp.ones(nbytes // 2, jnp.bfloat16))
    seconds, _ = best_of(lambda: largest(x), repeats)
    return nbytes / seconds / 1e9


def device_description() -> dict[str, Any]:
    """The device the benchmark runs on, for the report."""
    dev = jax.devices()[0]
    desc = {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "jax": jax.__version__}
    if dev.platform == "cpu":
        # Other processes share a CPU: the load average tells how much of it the benchmark had.
        desc.update(cpu=_cpu_model(), cores=os.cpu_count(), load_avg_start=os.getloadavg()[0])
    return desc


def with_final_load(dev: dict[str, Any]) -> dict[str, Any]:
    """The device description with the load average at the end of the run (CPU only)."""
    return {**dev, "load_avg_end": os.getloadavg()[0]} if "cpu" in dev else dev


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
