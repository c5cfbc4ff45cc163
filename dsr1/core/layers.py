"""Small building blocks shared by attention and the feed-forward blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .products import matmul


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in the weight's dtype."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight * x.astype(weight.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm (mean and variance over the last axis) computed in float32, returned in x's dtype
    (as V3.2's reference computes its indexer's key norm)."""
    f = x.astype(jnp.float32)
    mean = jnp.mean(f, axis=-1, keepdims=True)
    centred = f - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    out = centred * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return out.astype(x.dtype)


def silu(x: jax.Array) -> jax.Array:
    """SiLU computed in float32 and rounded once to x's dtype, as torch computes it for bf16 (HF's
    reference): `jax.nn.silu` of bf16 rounds each of its four steps, which changed ~35% of a bf16
    MLP's `silu(gate) * up` from HF's (and ran slower on CPU)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float = 0.0) -> jax.Array:
    """`silu(gate) * up`; with `limit > 0` (V4) the gate clamped to at most `limit` and the up
    projection to `[-limit, limit]` first, computed in float32 as the official code does."""
    if not limit:
        return jax.nn.silu(gate) * up
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def mlp(p: dict, x: jax.Array, limit: float = 0.0) -> jax.Array:
    """SwiGLU feed-forward: `(silu(x W_gate) * x W_up) W_down`, in x's dtype (`limit`: see `swiglu`)."""
    if limit:
        h = swiglu(matmul(x, p["gate"]), matmul(x, p["up"]), limit)
        return matmul(h.astype(x.dtype), p["down"])
    return matmul(silu(matmul(x, p["gate"])) * matmul(x, p["up"]), p["down"])
