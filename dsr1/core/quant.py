"""int8 weights: symmetric, one scale per output channel.

A quantized weight is an `Int8Weight(q, scale)`: `q` int8 with the weight's shape, `scale` float32
with the weight's *output* axes only (the contracted input axes are reduced away), so
`W = q * scale` broadcast over the input axes. Matmuls never build a dequantized copy of a
weight stack: `einsum` scales the output (or, when an output channel is itself contracted, as in
absorbed decode, the input), and experts go through a mixed bf16 x int8 `ragged_dot`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

QUANT_MODES = (None, "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    q: Any  # int8, the weight's shape
    scale: Any  # float32, the weight's shape without its input axes
    input_axes: tuple[int, ...] = dataclasses.field(default=(0,), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype


def check_quant(quant: str | None) -> str | None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant={quant!r} is not supported; choose one of {QUANT_MODES}")
    return quant


def quantize(w: Any, input_axes: tuple[int, ...]) -> Int8Weight:
    """Symmetric per-output-channel int8 of `w` (numpy or jax), reducing over `input_axes`."""
    xp = jnp if isinstance(w, jax.Array) else np
    w = w.astype(xp.float32)
    amax = xp.max(xp.abs(w), axis=input_axes, keepdims=True)
    # Multiply by reciprocals explicitly: XLA rewrites divisions that way, and host (numpy, the
    # converter) and device (the loader) quantization must agree to the last bit.
    scale = xp.where(amax > 0, amax * np.float32(1 / 127), np.float32(1))
    q = xp.clip(xp.round(w * (np.float32(1) / scale)), -127, 127).astype(xp.int8)
    return Int8Weight(q, xp.squeeze(scale, axis=input_axes).astype(xp.float32), tuple(input_axes))


def einsum(spec: str, x: jax.Array, w: Any, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a plain or an `Int8Weight` weight (the second operand)."""
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x.astype(w.dtype), w, **kwargs)
    inputs, out_sub = spec.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    if "..." in w_sub or len(w_sub) != w.q.ndim:
        raise ValueError(f"einsum {spec!r}: the weight needs one subscript per axis")
    scale_sub = "".join(c for i, c in enumerate(w_sub) if i not in w.input_axes)
    if all(c in out_sub for c in scale_sub):
        y = jnp.einsum(spec, x, w.q.astype(x.dtype), **kwargs)
        return jnp.einsum(f"{out_sub},{scale_sub}->{out_sub}", y, w.scale.astype(y.dtype))
    # An output channel of the weight is contracted here (absorbed decode): scale the input instead.
    x = jnp.einsum(f"{x_sub},{scale_sub}->{x_sub}", x, w.scale.astype(x.dtype))
    return jnp.einsum(spec, x, w.q.astype(x.dtype), **kwargs)


def matmul(x: jax.Array, w: Any) -> jax.Array:
    """`x @ w` for a plain or `Int8Weight` `[in, out]` weight."""
    return einsum("...i,io->...o", x, w)


def ragged_dot(x: jax.Array, w: Any, group_sizes: jax.Array, experts: jax.Array) -> jax.Array:
    """Grouped matmul of rows sorted by expert against `[E, in, out]` expert weights (float32 out).

    int8 experts enter `ragged_dot` as int8 (mixed bf16 x int8), then each row is scaled by its
    expert's output-channel scales: no dequantized copy of the expert stack is ever built.
    """
    if not isinstance(w, Int8Weight):
        return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(x, w.q, group_sizes, preferred_element_type=jnp.float32)
    return y * w.scale[jnp.minimum(experts, w.q.shape[0] - 1)]
