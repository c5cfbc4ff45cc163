"""Multi-head latent attention (MLA), in two forms.

- `attend_prefill`: non-absorbed. Expands the latent `c_kv` into per-head keys and values and runs
  standard causal attention: cheapest when many queries share the keys (prompts).
- `attend_decode`: absorbed. Folds `W_UK` into the query and `W_UV` after the softmax, so the
  scores are taken directly against the cached 512-d latents; no per-head K/V is ever built.

Both compute `q_nope . k_nope + q_pe . k_pe` as two products rather than a concatenation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import Config
from .layers import rms_norm
from .quant import einsum, matmul
from .rope import apply_rope

NEG_INF = -1e30  # a large finite negative: fully masked rows stay NaN-free


def queries(p: dict, x: jax.Array, positions: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """`x [B, T, D]` -> `q_nope [B, T, H, nope]`, `q_pe [B, T, H, rope]` (rope applied)."""
    if cfg.q_lora_rank is None:
        q = einsum("btd,dhk->bthk", x, p["q"])
    else:
        c_q = rms_norm(matmul(x, p["q_a"]), p["q_a_norm"], cfg.rms_norm_eps)
        q = einsum("btq,qhk->bthk", c_q, p["q_b"])
    q_nope, q_pe = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, apply_rope(q_pe, positions, cfg)


def latents(p: dict, x: jax.Array, positions: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """`x [B, T, D]` -> the cached quantities: `c_kv [B, T, r]` (normed), `k_pe [B, T, rope]` (roped)."""
    kv = matmul(x, p["kv_a"])
    c_kv, k_pe = jnp.split(kv, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(c_kv, p["kv_a_norm"], cfg.rms_norm_eps), apply_rope(k_pe, positions, cfg)


def _softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    return jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)


def attend_prefill(p: dict, x: jax.Array, positions: jax.Array, cfg: Config):
    """Causal self-attention over a right-padded block `x [B, T, D]`.

    Returns `(out [B, T, D], (c_kv, k_pe))`. Padding needs no key mask: a valid query at position i
    only sees keys j <= i, which are valid too.
    """
    with jax.named_scope("mla_prefill"):
        q_nope, q_pe = queries(p, x, positions, cfg)
        c_kv, k_pe = latents(p, x, positions, cfg)
        k_nope = einsum("btr,hnr->bthn", c_kv, p["wk_b"])
        v = einsum("btr,hvr->bthv", c_kv, p["wv_b"])
        f32 = jnp.float32
        scores = (jnp.einsum("bshn,bthn->bhst", q_nope, k_nope, preferred_element_type=f32)
                  + jnp.einsum("bshp,btp->bhst", q_pe, k_pe, preferred_element_type=f32)) * cfg.softmax_scale
        t = x.shape[1]
        causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        probs = _softmax(scores, causal).astype(v.dtype)
        ctx = jnp.einsum("bhst,bthv->bshv", probs, v)
        out = einsum("bshv,hvd->bsd", ctx, p["o"])
    return out, (c_kv, k_pe)


def attend_decode(p: dict, x: jax.Array, positions: jax.Array, c_cache: jax.Array, c_scale: jax.Array | None,
                  pe_cache: jax.Array, lengths: jax.Array, cfg: Config):
    """One new token per row, `x [B, D]` at `positions [B]`, against `lengths[b]` cached positions.

    `c_scale [B, S]` is the per-token scale of an int8 latent cache (None for a bf16/f32 cache): it
    multiplies the scores after the latent product and the probabilities before the value product,
    so no dequantized cache is built. The new token's own latent joins the softmax directly, so the
    cache is only read here; the caller writes the returned `(c_kv [B, r], k_pe [B, rope])` once for
    all layers.
    """
    with jax.named_scope("mla_decode"):
        q_nope, q_pe = queries(p, x[:, None], positions[:, None], cfg)
        c_new, pe_new = latents(p, x[:, None], positions[:, None], cfg)
        q_nope, q_pe, c_new, pe_new = q_nope[:, 0], q_pe[:, 0], c_new[:, 0], pe_new[:, 0]
        f32, dt = jnp.float32, q_nope.dtype
        q_lat = einsum("bhn,hnr->bhr", q_nope, p["wk_b"])  # absorb W_UK
        latent_scores = jnp.einsum("bhr,bsr->bhs", q_lat, c_cache.astype(dt), preferred_element_type=f32)
        if c_scale is not None:
            latent_scores = latent_scores * c_scale[:, None, :]
        cached = latent_scores + jnp.einsum("bhp,bsp->bhs", q_pe, pe_cache, preferred_element_type=f32)
        own = (jnp.einsum("bhr,br->bh", q_lat, c_new, preferred_element_type=f32)
               + jnp.einsum("bhp,bp->bh", q_pe, pe_new, preferred_element_type=f32))
        scores = jnp.concatenate([cached, own[..., None]], axis=-1) * cfg.softmax_scale
        valid = jnp.arange(c_cache.shape[1])[None, :] < lengths[:, None]
        mask = jnp.concatenate([valid, jnp.ones_like(valid[:, :1])], axis=-1)[:, None, :]
        probs = _softmax(scores, mask)
        cached_probs = probs[..., :-1] if c_scale is None else probs[..., :-1] * c_scale[:, None, :]
        ctx_lat = (jnp.einsum("bhs,bsr->bhr", cached_probs.astype(dt), c_cache.astype(dt), preferred_element_type=f32)
                   + probs[..., -1:] * c_new[:, None, :].astype(f32))
        ctx = einsum("bhr,hvr->bhv", ctx_lat.astype(dt), p["wv_b"])  # absorb W_UV
        out = einsum("bhv,hvd->bd", ctx, p["o"])
    return out, (c_new, pe_new)
