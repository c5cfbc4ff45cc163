"""The CPU backend as the model core sees it: a `dsr1.core.backend.Backend` over the layouts it holds.

The core asks the weights which backend holds them (`dsr1.core.backend.backend_of`); weights in this
backend's layouts (`layouts.Laid`, and a router read in its stack, `layouts.StackSlice`) name `CPU`,
set here where it is defined, since its operations are built on those layouts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ..core.backend import Backend
from . import experts, ffi, layouts, products


class CpuBackend(Backend):
    """dsr1's C++ kernels (`ffi`) on the layouts of `layouts`, for a mesh of CPU devices."""

    name: ClassVar[str] = "cpu"
    routers_in_stack: ClassVar[bool] = True

    def to_float32(self, w: Any) -> jax.Array:
        return products.to_float32(w)

    def einsum(self, spec: str, x: jax.Array, w: Any, **kwargs) -> jax.Array:
        if isinstance(w, layouts.StackSlice):  # a layer's router, in its stack
            return _router_logits(x, w, **kwargs)
        return products.einsum(spec, x, w, **kwargs)

    def ragged_dot(self, x: jax.Array, w: Any, group_sizes: jax.Array, experts: jax.Array) -> jax.Array:
        return products.ragged_dot(x, w, group_sizes, experts)

    def expert_matmul(self, x: jax.Array, stack: Any, layer: jax.Array, expert: jax.Array) -> jax.Array:
        return products.expert_matmul(x, stack, layer, expert)

    def partition_spec(self, w: Any, spec: Any, swapped: Any, scale: Any) -> Any:
        return layouts.partition_spec(w, spec, swapped, scale)

    def in_place_copies(self, stack: Any) -> tuple[Any, Any]:
        return layouts.in_place_copies(stack)

    def with_layer_copies(self, p: Any, copies: Any, layer: jax.Array) -> Any:
        return p if copies is None else layouts.with_layer_copies(p, copies, layer)

    def router_in_stack(self, stack: Any, layer: jax.Array) -> Any:
        return layouts.StackSlice(stack, layer)

    def takes_pairs(self, gate: Any, up: Any, down: Any, tokens: int) -> bool:
        return experts.takes_pairs(gate, up, down, tokens)

    def expert_pairs(self, x, weights, matrix, gate, up, down) -> jax.Array:
        return experts.pairs(x, weights, matrix, gate, up, down)

    def takes_blocks(self, gate: Any, up: Any, down: Any, block: int) -> bool:
        return experts.takes_blocks(gate, up, down, block)

    def expert_blocks(self, xb, index, used, token, weight, gate, up, down, out) -> jax.Array:
        return experts.blocks(xb, index, used, token, weight, gate, up, down, out)

    def attends(self, cache: Any, queries: int, one_device: bool) -> bool:
        """One query per row against a cache (contiguous or paged) of bf16 bits, or of int8 latents
        beside bf16 bits of `k_pe`, whole on one device (XLA would gather a sharded operand of a
        custom call)."""
        bits = cache.c_kv.dtype == jnp.uint16 and cache.c_scale is None
        int8 = cache.c_kv.dtype == jnp.int8 and cache.c_scale is not None and cache.k_pe.dtype == jnp.uint16
        return one_device and queries == 1 and (bits or int8) and ffi.available()

    def decode_attention(self, *args, **kwargs) -> jax.Array:
        """`ffi.mla_decode_context`, its arguments."""
        return ffi.mla_decode_context(*args, **kwargs)


def _router_logits(x: jax.Array, router: layouts.StackSlice, **kwargs) -> jax.Array:
    """float32 `x [N, D] @ router` for a router in its stack: by the kernel where it takes it
    (`experts.router_logits`), else sliced out of the stack."""
    logits = experts.router_logits(x.astype(jnp.float32), router)
    if logits is not None:
        return logits
    return jnp.matmul(x.astype(jnp.float32), router.stack[router.index], **kwargs)


CPU = CpuBackend()
layouts.Laid.backend = CPU
layouts.StackSlice.backend = CPU
