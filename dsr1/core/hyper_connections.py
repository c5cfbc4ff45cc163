"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual as `hc_mult` streams.

Each sub-block (attention, MoE) reads one mix of the streams and writes its output back into all of
them: from the streams flattened and RMS-normalised (no weight), `mixes = x fn` gives `pre` (sigmoid,
plus eps: the input's weights), `post` (2 sigmoid: the output's weights per stream) and `comb`, a
`hc x hc` matrix made doubly stochastic by Sinkhorn's alternating row and column normalisation
(`sinkhorn`). The block runs on `sum_k pre_k x_k`; stream k becomes `post_k y + sum_j comb[j, k] x_j`.
`head` collapses the streams once more (pre weights only) before the final norm. All float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import Config


def expand(x: jax.Array, cfg: Config) -> jax.Array:
    """The embeddings `[..., D]` copied into `hc_mult` streams `[..., hc, D]`."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], cfg.hc_mult, x.shape[-1]))


def _mixes(p: dict, streams: jax.Array, cfg: Config) -> jax.Array:
    """`fn` applied to the RMS-normalised flattened streams `[..., hc * D]` (float32)."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    rsqrt = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return jnp.matmul(flat, p["fn"], precision=jax.lax.Precision.HIGHEST) * rsqrt


def sinkhorn(logits: jax.Array, cfg: Config) -> jax.Array:
    """`[..., hc, hc]` logits to a (nearly) doubly stochastic matrix: a row softmax plus eps, then
    column and row normalisations alternating, `hc_sinkhorn_iters` column steps in all."""
    eps = cfg.hc_eps
    comb = jax.nn.softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)

    def step(_, c):
        c = c / (c.sum(-1, keepdims=True) + eps)
        return c / (c.sum(-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, step, comb)


def pre(p: dict, streams: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A sub-block's input `[..., D]` from `streams [..., hc, D]`, with its `post [..., hc]` and
    `comb [..., hc, hc]` weights (see the module)."""
    hc = cfg.hc_mult
    mixes = _mixes(p, streams, cfg)
    scale, base = p["scale"], p["base"]
    weights = jax.nn.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post_w = 2 * jax.nn.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*mixes.shape[:-1], hc, hc)
    collapsed = jnp.sum(weights[..., None] * streams.astype(jnp.float32), axis=-2)
    return collapsed, post_w, sinkhorn(logits, cfg)


def post(y: jax.Array, streams: jax.Array, post_w: jax.Array, comb: jax.Array) -> jax.Array:
    """The streams after a sub-block of output `y [..., D]`: `post_k y + sum_j comb[j, k] streams_j`."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, streams.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return post_w[..., None] * y.astype(jnp.float32)[..., None, :] + mixed


def head(p: dict, streams: jax.Array, cfg: Config) -> jax.Array:
    """The streams collapsed before the final norm: `sum_k (sigmoid(mix_k scale + base_k) + eps) x_k`."""
    weights = jax.nn.sigmoid(_mixes(p, streams, cfg) * p["scale"][0] + p["base"]) + cfg.hc_eps
    return jnp.sum(weights[..., None] * streams.astype(jnp.float32), axis=-2)
