"""dsr1's optional CPU backend, which the model core reaches only through the weights it holds.

What it accelerates (docs/cpu-backend.md): decode's products of a few rows, a step's routed experts
and its absorbed MLA attention, with dsr1's own C++ kernels (`ffi`, compiled at first use), on
weights held in layouts made for them (`layouts`: bf16 bits, transposed copies), in 2 MiB pages
(`huge_pages`), copied on the host in threads (`host_copy`).

The choice is made from a mesh's devices: `enabled(mesh)` is True for a mesh of CPU devices where the
kernels are built (an x86-64 CPU with AVX2 and a C++ compiler) and `DSR1_CPU_KERNELS` is not `0`.
Only then does `prepare` put the weights in the backend's layouts, before any program runs
(`dsr1.api` calls it at load); those weights name the backend (`backend.CPU`, a
`dsr1.core.backend.Backend`), and the core hands it their products and the few operations it takes
over. GPU and TPU meshes never reach the compiler, and a disabled backend holds every weight as its
dtype says.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import Mesh

from ..core.config import Config
from ..core.params import float_specs, is_spec, split_placement, with_placement_arrays
from ..host import huge_pages
from . import ffi
from .backend import CPU, CpuBackend
from .layouts import Bf16Bits, Int8Rows, is_laid, laid_out

__all__ = ["CPU", "Bf16Bits", "CpuBackend", "Int8Rows", "enabled", "held", "is_laid", "prepare", "view"]


def enabled(mesh: Mesh | Any) -> bool:
    """Whether the backend runs for `mesh` (or a collection of devices): all its devices are CPUs,
    `DSR1_CPU_KERNELS` is not `0`, and the kernels are built (built here at the first call for a CPU
    mesh, never for another platform's)."""
    devices = list(mesh.devices.flat) if isinstance(mesh, Mesh) else list(mesh)
    if not devices or any(d.platform != "cpu" for d in devices) or os.environ.get("DSR1_CPU_KERNELS", "1") == "0":
        return False
    return ffi.library() is not None


def view(params: Any, cfg: Config, mesh: Mesh) -> Any:
    """`params` (a model's weights, `cfg`'s) in the backend's layouts (`layouts.laid_out`, per weight
    against its declaration) where `enabled(mesh)`; else `params` unchanged. Idempotent."""
    if not enabled(mesh):
        return params
    placement, logical = split_placement(params)
    specs = float_specs(cfg, mtp="mtp" in params)
    return with_placement_arrays(jax.tree_util.tree_map_with_path(laid_out, specs, logical, is_leaf=is_spec),
                                 placement)


def held(params: Any, mesh: Mesh) -> Any:
    """Loaded weights as the backend holds them where `enabled(mesh)`: large ones in memory backed by
    2 MiB pages (`huge_pages.on_huge_pages`); else `params` unchanged."""
    return huge_pages.on_huge_pages(params) if enabled(mesh) else params


def prepare(params: Any, cfg: Config, mesh: Mesh) -> Any:
    """A model's weights as programs on `mesh` compute them: in the backend's layouts and pages (`view`,
    `held`) where `enabled(mesh)`; else unchanged."""
    return held(view(params, cfg, mesh), mesh)

