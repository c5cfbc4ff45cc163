"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA over the positions a lightning indexer chooses.

Per layer (the MTP layer's too) the indexer scores every visible position for each query:

    c_q     = q_norm(wq_a x)                       MLA's query latent
    q[t, h] = wq_b(c_q)  [index_n_heads, index_head_dim], rope on the first qk_rope_head_dim channels
    k[s]    = LayerNorm(wk x)  [index_head_dim], roped alike: one key per token, shared by the heads
    w[t, h] = weights_proj(x) * index_n_heads^-0.5 * index_head_dim^-0.5
    I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s])                  for s <= t

and query t attends to its `min(index_topk, t + 1)` positions of highest `I[t, s]`, one set for all of
MLA's heads. The indexer's rope rotates halves (`apply_rope(..., interleaved=False)`), MLA's rope
interleaved pairs, as the reference's update of 2025-11-17 says.

The release rotates q and k by a Hadamard transform and keeps the keys in FP8 with a block scale;
the rotation is orthogonal (q . k is unchanged), so this exact form computes the reference's scores
without it, and the cache holds the keys in the model's dtype (`KVCache.index_k`).

- `attend_prefill`: MLA's expanded form over a block, the selection a mask on the causal scores.
- `attend_cached` / `attend_decode`: the absorbed form against a contiguous `KVCache`: the indexer
  scans every cached key, then only the selected positions' latents are gathered (`index_topk` per
  query) and attended. The new tokens' latents and indexer keys join directly (the cache is only read
  here); the caller writes the returned `(c_kv, k_pe, index_k)`.
- `attend_extend`: the same against the serving engine's page pool (`attention.PagedContext`), read
  through each row's page table (`cache.PagedRows`): the indexer scans the keys of the row's own
  pages, and only the selected positions' latents are gathered (on TPU by `paged_gather`'s kernel).

The functions share MLA's pieces (`dsr1.core.attention`): its queries, latents, the two forms'
`Query` and `Keys`, `scores`, `weighted_values` and `attention_output`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import paged_gather, products
from .attention import (
    Keys,
    PagedContext,
    Query,
    attention_output,
    causal_mask,
    kernel_choice,
    latents,
    make_keys,
    make_query,
    masked_softmax,
    queries,
    query_latent,
    scores,
    weighted_values,
)
from .cache import KVCache, PagedRows, latent_values
from .config import Config
from .layers import layer_norm
from .rope import apply_rope
from .sharding import DEFAULT_RULES, ShardingRules

LAYER_NORM_EPS = 1e-6  # the indexer's key norm (the reference's LayerNorm default)


# ---- the indexer --------------------------------------------------------------------------------

def _rope_first(x: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """Rope (on halves) the first `qk_rope_head_dim` channels of `x [..., T, (H,) index_head_dim]`."""
    pe, rest = jnp.split(x, [cfg.qk_rope_head_dim], axis=-1)
    return jnp.concatenate([apply_rope(pe, positions, cfg, interleaved=False), rest], axis=-1)


def index_queries(ip: dict, c_q: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """The indexer's queries `[B, T, index_n_heads, index_head_dim]` from the query latent `c_q`."""
    return _rope_first(products.einsum("btq,qhk->bthk", c_q, ip["wq_b"]), positions, cfg)


def index_keys(ip: dict, x: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """The indexer's keys `[B, T, index_head_dim]` (x's dtype) from the layer's normed input `x`."""
    k = layer_norm(products.matmul(x, ip["wk"]), ip["k_norm"], ip["k_norm_bias"], LAYER_NORM_EPS)
    return _rope_first(k, positions, cfg)


def index_weights(ip: dict, x: jax.Array, cfg: Config) -> jax.Array:
    """Each query's per-head weights `[B, T, index_n_heads]` (float32, scales folded in)."""
    w = products.einsum("btd,dh->bth", x.astype(jnp.float32), ip["weights_proj"], preferred_element_type=jnp.float32)
    return w * (cfg.index_n_heads ** -0.5 * cfg.index_head_dim ** -0.5)


def index_scores(q: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    """`I[b, t, s] = sum_h w[b, t, h] relu(q[b, t, h] . k[b, s])` `[B, T, S]` (float32)."""
    dots = jnp.einsum("bthk,bsk->bths", q, k, preferred_element_type=jnp.float32)
    return jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w)


def select(index: jax.Array, visible: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """The `min(topk, S)` positions of highest score among the visible ones, per query: their indices
    into S `[B, T, K]` and whether each is a chosen position `[B, T, K]` (a query that sees fewer than
    K positions gets all of them, and K - seen unchosen fillers)."""
    top, picked = jax.lax.top_k(jnp.where(visible, index, -jnp.inf), min(topk, index.shape[-1]))
    return picked, top > -jnp.inf


def selection_mask(picked: jax.Array, chosen: jax.Array, positions: int) -> jax.Array:
    """`[B, T, positions]`: whether each query attends to each position (`select`'s choice as a mask)."""
    b, t, _ = picked.shape
    mask = jnp.zeros((b, t, positions), bool)
    return mask.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], picked].set(chosen)


# ---- prefill: the expanded form, the selection a mask -------------------------------------------

def attend_prefill(p: dict, x: jax.Array, positions: jax.Array, cfg: Config):
    """Causal sparse attention over a right-padded block `x [B, T, D]` (expanded form): query t
    attends to the positions `s <= t` its indexer chooses. Returns `(out [B, T, D], (c_kv, k_pe,
    index_k))`: the block's latents and indexer keys, for the cache."""
    with jax.named_scope("dsa_prefill"):
        ip = p["indexer"]
        c_q = query_latent(p, x, cfg)
        q_nope, q_pe = queries(p, x, positions, cfg, c_q)
        c_kv, k_pe = latents(p, x, positions, cfg)
        keys = index_keys(ip, x, positions, cfg)
        index = index_scores(index_queries(ip, c_q, positions, cfg), index_weights(ip, x, cfg), keys)
        t = x.shape[1]
        chosen = selection_mask(*select(index, causal_mask(t)[None], cfg.index_topk), t)
        q = make_query(p, q_nope, q_pe, absorbed=False)
        k = make_keys(p, c_kv, None, k_pe, absorbed=False, dtype=q_nope.dtype)
        probs = masked_softmax(scores(q, k, cfg), chosen[:, None])
        out = attention_output(p, weighted_values(probs, k), absorbed=False, dtype=q_nope.dtype)
    return out, (c_kv, k_pe, keys)


# ---- decode: the absorbed form over the selected latents ----------------------------------------

def attend_decode(p: dict, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array, cfg: Config,
                  one_device: bool = False, mesh: Mesh | None = None):
    """One new token per row, `x [B, D]` at `positions [B]`, against `cache.lengths[b]` cached positions
    of `layer`: `attend_cached` with T = 1. Returns `(out [B, D], (c_kv [B, r], k_pe [B, rope], index_k
    [B, index_head_dim]))`."""
    out, new = attend_cached(p, x[:, None], positions[:, None], cache, layer, cfg, one_device=one_device, mesh=mesh)
    return out[:, 0], tuple(a[:, 0] for a in new)


def attend_cached(p: dict, x: jax.Array, positions: jax.Array, cache: KVCache | PagedRows, layer: jax.Array,
                  cfg: Config,
                  query_at: jax.Array | None = None, one_device: bool = False, mesh: Mesh | None = None):
    """T new tokens per row, `x [B, T, D]` at `positions [B, T]` (`lengths[b] + t`), against
    `cache.lengths[b]` cached positions of `layer` of a contiguous cache and causally to each other,
    each query attending to the positions its indexer chooses among them (absorbed form).

    `query_at [B]`: only row b's token `query_at[b]` queries (out `[B, 1, D]`); all T latents and keys
    are still returned. `one_device` and `mesh` are `attention.attend_cached`'s; this form has no
    kernel of its own, so they choose nothing. Returns `(out, (c_kv [B, T, r], k_pe [B, T, rope],
    index_k [B, T, index_head_dim]))`.
    """
    del one_device, mesh
    with jax.named_scope("dsa_decode"):
        ip = p["indexer"]
        c_q = query_latent(p, x, cfg)
        c_new, pe_new = latents(p, x, positions, cfg)
        keys_new = index_keys(ip, x, positions, cfg)
        xq, c_qq, pos_q, own_visible = _queried(x, c_q, positions, query_at)
        q_nope, q_pe = queries(p, xq, pos_q, cfg, c_qq)
        index = jnp.concatenate([_cached_index(ip, xq, c_qq, pos_q, cache, layer, cfg),
                                 index_scores(index_queries(ip, c_qq, pos_q, cfg), index_weights(ip, xq, cfg),
                                              keys_new)], axis=-1)
        cached_visible = jnp.arange(cache.max_len)[None, None, :] < cache.lengths[:, None, None]
        visible = jnp.concatenate([jnp.broadcast_to(cached_visible, own_visible.shape[:2] + (cache.max_len,)),
                                   own_visible], axis=-1)
        picked, chosen = select(index, visible, cfg.index_topk)
        keys = _selected_keys(cache, layer, picked, c_new, pe_new, q_nope.dtype)
        ctx = _selected_context(make_query(p, q_nope, q_pe, absorbed=True), keys, chosen, cfg)
        out = attention_output(p, ctx, absorbed=True, dtype=q_nope.dtype)
    return out, (c_new, pe_new, keys_new)


def attend_extend(p: dict, x: jax.Array, positions: jax.Array, context: PagedContext, layer: jax.Array,
                  cfg: Config, *, absorbed: bool = True, one_device: bool = False, mesh: Mesh | None = None,
                  rules: ShardingRules = DEFAULT_RULES):
    """T new tokens per row, `x [B, T, D]` at `positions [B, T]` (`context.cached[b] + t`), against their
    row's cached positions of `layer` in the page pool and causally to each other: `attend_cached`
    over the pool read through the rows' page tables (`PagedRows`), its selected latents gathered by
    the TPU kernel where `one_device`/`mesh` name a TPU (`paged_gather.applies`). Always the absorbed
    form (`absorbed` is `attention.attend_extend`'s and chooses nothing). Returns `(out [B, T, D],
    (c_kv, k_pe, index_k))`, each `[B, T, ...]`."""
    del absorbed
    kernel = paged_gather.applies(kernel_choice(mesh, one_device)[0])
    rows = PagedRows(context.cache, context.page_table, context.cached, mesh, rules, kernel)
    return attend_cached(p, x, positions, rows, layer, cfg)


def _queried(x: jax.Array, c_q: jax.Array, positions: jax.Array, query_at: jax.Array | None):
    """The querying tokens' inputs, query latents and positions, and which new tokens each sees
    `[B, Tq, T]` (`attend_cached`'s `query_at`: one per row, else all T, causally)."""
    b, t = x.shape[:2]
    if query_at is None:
        return x, c_q, positions, jnp.broadcast_to(causal_mask(t)[None], (b, t, t))
    at = query_at[:, None]
    take = lambda a: jnp.take_along_axis(a, at[..., None], axis=1)  # noqa: E731
    return take(x), take(c_q), jnp.take_along_axis(positions, at, axis=1), (jnp.arange(t)[None, :] <= at)[:, None, :]


def _cached_index(ip: dict, x: jax.Array, c_q: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array,
                  cfg: Config) -> jax.Array:
    """The queries' index scores `[B, Tq, max_len]` against every cached indexer key of `layer`."""
    stored = latent_values(cache.read_index_keys(layer), x.dtype)
    return index_scores(index_queries(ip, c_q, positions, cfg), index_weights(ip, x, cfg), stored)


def _selected_keys(cache: KVCache, layer: jax.Array, picked: jax.Array, c_new: jax.Array, pe_new: jax.Array,
                   dtype: jnp.dtype) -> Keys:
    """The latents at `picked [B, Tq, K]` (indices into the cache's positions, then the T new tokens),
    as absorbed keys with one row per query `[B * Tq, K, ...]`: the cache's positions gathered from it
    (only those are read), the new tokens' from `c_new`, `pe_new` `[B, T, ...]`."""
    s, t = cache.max_len, c_new.shape[1]
    cached = picked < s
    c_kv, c_scale, k_pe = cache.gather_positions(layer, jnp.minimum(picked, s - 1))
    rows = jnp.arange(picked.shape[0])[:, None, None]
    new = jnp.clip(picked - s, 0, t - 1)

    def pick(stored: jax.Array, own: jax.Array) -> jax.Array:
        merged = jnp.where(cached[..., None], latent_values(stored, dtype), own[rows, new].astype(dtype))
        return merged.reshape(-1, *merged.shape[2:])

    scale = None if c_scale is None else jnp.where(cached, c_scale, 1.0).reshape(-1, picked.shape[-1])
    c = pick(c_kv, c_new)
    return Keys(c, c, pick(k_pe, pe_new), scale)


def _selected_context(q: Query, keys: Keys, chosen: jax.Array, cfg: Config) -> jax.Array:
    """The context `[B, H, Tq, r]` of absorbed queries `[B, Tq, H, ...]`, each against its own selected
    keys (`_selected_keys`, one row per query) where `chosen [B, Tq, K]`."""
    b, tq = q.main.shape[:2]
    flat = Query(q.main.reshape(b * tq, 1, *q.main.shape[2:]), q.pe.reshape(b * tq, 1, *q.pe.shape[2:]), True)
    probs = masked_softmax(scores(flat, keys, cfg), chosen.reshape(b * tq, 1, 1, -1))
    ctx = weighted_values(probs, keys)  # [B * Tq, H, 1, r]
    return ctx.reshape(b, tq, *ctx.shape[1:])[:, :, :, 0].swapaxes(1, 2)
