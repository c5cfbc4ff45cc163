"""dsr1's optional CPU backend, behind the few calls the model core makes.

What it accelerates (docs/cpu-backend.md): decode's products of a few rows, a step's routed experts
and its absorbed MLA attention, with dsr1's own C++ kernels (`ffi`, compiled at first use), on
weights held in layouts made for them (`layouts`: bf16 bits, transposed copies), in 2 MiB pages
(`huge_pages`), copied on the host in threads (`host_copy`).

The choice is made from a mesh's devices: `enabled(mesh)` is True for a mesh of CPU devices where the
kernels are built (an x86-64 CPU with AVX2 and a C++ compiler) and `DSR1_CPU_KERNELS` is not `0`.
Only then does `view` put the weights in the backend's layouts; the model's products (`dsr1.core.
products`) hand a weight in a layout to `einsum` / `ragged_dot` here, and everything else to XLA.
GPU and TPU meshes never reach the compiler, and a disabled backend holds every weight as its dtype
says.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import Mesh

from . import ffi, huge_pages
from .experts import blocks as expert_blocks
from .experts import pairs as expert_pairs
from .experts import router_logits, takes_blocks, takes_pairs
from .layouts import (
    Bf16Bits,
    Int8Rows,
    StackSlice,
    holds_transposed_bits,
    in_place_copies,
    laid_out,
    partition_spec,
    with_layer_copies,
)
from .layouts import is_laid as holds
from .products import einsum, expert_matmul, ragged_dot, to_float32

__all__ = ["Bf16Bits", "Int8Rows", "StackSlice", "attends", "decode_attention", "einsum",
           "enabled", "expert_blocks", "expert_matmul", "expert_pairs", "held", "holds", "holds_transposed_bits",
           "in_place_copies", "partition_spec", "ragged_dot", "router_logits", "takes_blocks", "takes_pairs",
           "to_float32", "view", "with_layer_copies"]


def enabled(mesh: Mesh | Any) -> bool:
    """Whether the backend runs for `mesh` (or a collection of devices): all its devices are CPUs,
    `DSR1_CPU_KERNELS` is not `0`, and the kernels are built (built here at the first call for a CPU
    mesh, never for another platform's)."""
    devices = list(mesh.devices.flat) if isinstance(mesh, Mesh) else list(mesh)
    if not devices or any(d.platform != "cpu" for d in devices) or os.environ.get("DSR1_CPU_KERNELS", "1") == "0":
        return False
    return ffi.library() is not None


def view(params: Any, specs: Any, mesh: Mesh) -> Any:
    """`params` in the backend's layouts (`layouts.laid_out`, per weight against its declaration in
    `specs`, the float declaration tree) where `enabled(mesh)`; else `params` unchanged. Idempotent."""
    if not enabled(mesh):
        return params
    from ..core.params import is_spec
    return jax.tree_util.tree_map_with_path(laid_out, specs, params, is_leaf=is_spec)


def held(params: Any, mesh: Mesh) -> Any:
    """Loaded weights as the backend holds them where `enabled(mesh)`: large ones in memory backed by
    2 MiB pages (`huge_pages.on_huge_pages`); else `params` unchanged."""
    return huge_pages.on_huge_pages(params) if enabled(mesh) else params


def attends(c_kv: jax.Array, c_scale: jax.Array | None, k_pe: jax.Array, queries: int, one_device: bool) -> bool:
    """Whether the kernel computes a decode step's attention (`decode_attention`): one query per row
    against a cache (contiguous or paged) of bf16 bits, or of int8 latents beside bf16 bits of `k_pe`,
    whole on one device (XLA would gather a sharded operand of a custom call)."""
    bits = c_kv.dtype == jax.numpy.uint16 and c_scale is None
    int8 = c_kv.dtype == jax.numpy.int8 and c_scale is not None and k_pe.dtype == jax.numpy.uint16
    return one_device and queries == 1 and (bits or int8) and ffi.available()


def decode_attention(*args, **kwargs) -> jax.Array:
    """A decode step's absorbed attention by the kernel (`ffi.mla_decode_context`, its arguments)."""
    return ffi.mla_decode_context(*args, **kwargs)
