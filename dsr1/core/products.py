"""The products every weight goes through: `einsum`, `matmul`, `ragged_dot`, `grouped_dot` and `to_float32`.

XLA's implementation for plain and `Int8Weight` weights (on any platform). A weight held in a
backend's layout (`dsr1.core.backend.HeldWeight`: the CPU backend's, made only for a mesh of CPU
devices where it runs) is computed by that backend: the one place the model hands a product over.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .backend import is_held
from .grouped_matmul import grouped_matmul
from .quant import Int8Weight, subscripts


def to_float32(w: Any) -> jax.Array:
    """A weight's values (or int8 values) as float32."""
    if is_held(w):
        return w.backend.to_float32(w)
    return w.astype(jnp.float32)


def einsum(spec: str, x: jax.Array, w: Any, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a plain or `Int8Weight` weight (the second operand), or one held in
    a backend's layout (computed by that backend)."""
    if is_held(w):
        return w.backend.einsum(spec, x, w, **kwargs)
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x.astype(w.dtype), w, **kwargs)
    x_sub, w_sub, out_sub = subscripts(spec)
    if "..." in w_sub or len(w_sub) != w.q.ndim:
        raise ValueError(f"einsum {spec!r}: the weight needs one subscript per axis")
    scale_sub = "".join(c for i, c in enumerate(w_sub) if i not in w.input_axes)
    dtype = kwargs.get("preferred_element_type") or x.dtype
    q = w.q.astype(x.dtype)
    if all(c in x_sub for c in scale_sub) and not all(c in out_sub for c in scale_sub):
        # An output channel of the weight is contracted here (absorbed decode): scale the input instead.
        x = jnp.einsum(f"{x_sub},{scale_sub}->{x_sub}", x, w.scale.astype(x.dtype))
        return jnp.einsum(spec, x, q, **kwargs).astype(dtype)
    # Keep the scale's axes that the product contracts (experts summed over), scale, then sum them.
    wide = out_sub + "".join(c for c in scale_sub if c not in out_sub)
    y = jnp.einsum(f"{x_sub},{w_sub}->{wide}", x, q, **kwargs)
    y = jnp.einsum(f"{wide},{scale_sub}->{wide}", y, w.scale.astype(y.dtype))
    return y.sum(axis=tuple(range(len(out_sub), len(wide)))).astype(dtype)


def matmul(x: jax.Array, w: Any) -> jax.Array:
    """`x @ w` for a plain or `Int8Weight` `[in, out]` weight."""
    return einsum("...i,io->...o", x, w)


def ragged_dot(x: jax.Array, w: Any, group_sizes: jax.Array, experts: jax.Array) -> jax.Array:
    """Grouped matmul of rows sorted by expert against `[E, in, out]` expert weights (float32 out).

    int8 experts enter `ragged_dot` as int8 (mixed bf16 x int8), then each row is scaled by its
    expert's output-channel scales: no dequantized copy of the expert stack is ever built.
    """
    if is_held(w):
        return w.backend.ragged_dot(x, w, group_sizes, experts)
    if not isinstance(w, Int8Weight):
        return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(x, w.q, group_sizes, preferred_element_type=jnp.float32)
    return y * w.scale[jnp.minimum(experts, w.q.shape[0] - 1)]


def grouped_dot(x: jax.Array, stack: Any, group_sizes: jax.Array, experts: jax.Array, layer: jax.Array, *,
                groups_hit: float | None = None, interpret: bool = False) -> jax.Array:
    """`ragged_dot(x, stack[layer], ...)` by the TPU grouped-matmul kernel (`grouped_matmul`), which reads
    layer `layer` of the stacked `[L, E, in, out]` experts in place, and only the experts that got rows
    (float32 out). int8 experts enter as int8, each row then scaled by its expert's output-channel
    scales, as in `ragged_dot`. `groups_hit`: the experts that get rows on average (the kernel's cost
    estimate); `interpret`: Pallas' interpreter (any backend)."""
    if not isinstance(stack, Int8Weight):
        return grouped_matmul(x.astype(stack.dtype), stack, group_sizes, layer, groups_hit=groups_hit,
                              interpret=interpret)
    y = grouped_matmul(x, stack.q, group_sizes, layer, groups_hit=groups_hit, interpret=interpret)
    scale = jax.lax.dynamic_index_in_dim(stack.scale, layer, keepdims=False)
    return y * scale[jnp.minimum(experts, stack.q.shape[1] - 1)]
