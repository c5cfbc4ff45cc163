"""int8 weights: symmetric, one scale per output channel.

A quantized weight is an `Int8Weight(q, scale)`: `q` int8 with the weight's shape, `scale` float32
with the weight's *output* axes only (the contracted input axes are reduced away), so
`W = q * scale` broadcast over the input axes. Matmuls never build a dequantized copy of a
weight stack: `einsum` scales the output (or, when an output channel is itself contracted, as in
absorbed decode, the input), and experts go through a mixed bf16 x int8 `ragged_dot`
(`dsr1.core.products`).
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

    @property
    def nbytes(self) -> int:
        """Bytes held: the values and their scales."""
        return self.bytes_read()

    def bytes_read(self, rows: int = 1) -> int:
        """Bytes a product reads: the values and the scales."""
        return self.q.nbytes + self.scale.nbytes


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


def subscripts(spec: str) -> tuple[str, str, str]:
    """`x, w -> out` of a two-operand einsum."""
    inputs, out = spec.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    return x_sub, w_sub, out
