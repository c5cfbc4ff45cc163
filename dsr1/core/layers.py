"""Small building blocks shared by attention and the feed-forward blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .quant import matmul


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in the weight's dtype."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight * x.astype(weight.dtype)


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """SwiGLU feed-forward: `(silu(x W_gate) * x W_up) W_down`, in x's dtype."""
    return matmul(jax.nn.silu(matmul(x, p["gate"])) * matmul(x, p["up"]), p["down"])
