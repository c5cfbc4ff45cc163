"""Rotary position embedding with YaRN frequency scaling, on interleaved pairs or on halves.

DeepSeek's MLA weights expect RoPE applied to pairs `(x[2i], x[2i+1])`, each rotated by frequency i
(the reference code views them as complex numbers), not to the two halves of the vector. V3.2's
indexer expects the halves: pairs `(x[i], x[i + d/2])` (its reference's `interleaved=False`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import Config, RopeScaling, yarn_mscale


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(cfg: Config) -> np.ndarray:
    """Per-pair angular frequencies `[qk_rope_head_dim // 2]` (float32), YaRN-blended when scaled."""
    return yarn_inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)


def v4_inverse_frequencies(cfg: Config, compressed: bool) -> np.ndarray:
    """V4's per-pair frequencies: window-only layers `rope_theta` without YaRN, layers with compressed
    entries `compress_rope_theta` with YaRN (their queries, window and entries alike)."""
    if compressed:
        return yarn_inverse_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    return yarn_inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, RopeScaling())


def yarn_inverse_frequencies(dim: int, base: float, s: RopeScaling) -> np.ndarray:
    """Per-pair angular frequencies `[dim // 2]` of theta `base` (float32), YaRN-blended when `s` scales."""
    # float32 throughout, as the reference computes it, so angles agree to the last bit that matters.
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    extrapolated = np.float32(1.0) / (np.float32(base) ** exponents)
    if s.factor == 1.0:
        return extrapolated
    interpolated = extrapolated / np.float32(s.factor)
    low = max(math.floor(_correction_dim(s.beta_fast, dim, base, s.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(s.beta_slow, dim, base, s.original_max_position_embeddings)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep_extrapolated = np.float32(1) - ramp
    return (interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated).astype(np.float32)


def attention_factor(cfg: Config) -> float:
    """YaRN's magnitude correction applied to cos and sin (1.0 for R1, where mscale == mscale_all_dim)."""
    s = cfg.rope_scaling
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: Config, interleaved: bool = True) -> jax.Array:
    """Rotate pairs of the last axis of `x [..., T, (H,) rope_dim]` by `positions [..., T]`: interleaved
    pairs `(x[2i], x[2i+1])`, or with `interleaved=False` the halves' pairs `(x[i], x[i + rope_dim/2])`.

    `x` may carry a head axis after the position axis; positions broadcast over it.
    """
    return rotate(x, positions, inverse_frequencies(cfg), interleaved=interleaved, scale=attention_factor(cfg))


def rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, interleaved: bool = True,
           scale: float = 1.0, inverse: bool = False) -> jax.Array:
    """`apply_rope` with the frequencies `inv_freq [rope_dim // 2]` given; `inverse`: rotate back (by
    minus the angles), as V4 does to its attention output's rope slice."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, dim/2]
    if x.ndim == angles.ndim + 1:  # a head axis sits between positions and features
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    if inverse:
        sin = -sin
    if not interleaved:
        first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
