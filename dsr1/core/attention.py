"""Multi-head latent attention (MLA), in two forms, and the paged attention of `extend`.

- *Expanded* (non-absorbed): the latent `c_kv` is expanded into per-head keys `k_nope = W_UK c` and
  values `v = W_UV c`; cheapest when many queries share the keys (prompts). `attend_prefill`.
- *Absorbed*: `W_UK` is folded into the query (`q_nope W_UK` lives in the latent space) and `W_UV`
  is applied after the softmax, so scores are taken directly against the latents and no per-head
  K/V is ever built; cheapest for few queries per row (decode). `attend_decode`.
- `attend_extend`: T new tokens per row against that row's pages of a `PagedKVCache` plus the new
  tokens themselves (causal), in either form (`use_absorbed` picks the cheaper one for T). Pages are
  read block by block with an online softmax (flash-decoding style), for as many blocks as the
  longest row actually holds; on TPU (absorbed) the ragged paged kernel (`paged_attention`) reads
  each row's own pages only; one token per row on one CPU device: dsr1's kernel reads the pages in
  place.

All three share the pieces below: a `Query` and `Keys` in one form, `scores`, `weighted_values`,
`attention_output`. Scores are `q_nope . k_nope + q_pe . k_pe`, two products, not a concatenation.
With an int8 latent cache, each cached token's scale multiplies its scores (after the latent
product) and its probabilities (before the value product), so no dequantized cache is built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import flash_decode, paged_attention, products
from .backend import backend_of
from .cache import KVCache, PagedKVCache, latent_values, local_pages, pool_axes, pool_specs, read_rank_pages
from .config import Config
from .layers import rms_norm
from .rope import apply_rope
from .sharding import DEFAULT_RULES, ShardingRules

NEG_INF = -1e30  # a large finite negative: fully masked rows stay NaN-free

# The decode products of the attention weights (q up-projection, absorbed W_UK and W_UV, o), which the
# CPU backend computes from copies laid out for them (`dsr1.core.backend`).
DECODE_PRODUCTS = {"q_b": "btq,qhk->bthk", "wk_b": "bthn,hnr->bthr", "wv_b": "bhtr,hvr->bhtv", "o": "bhtv,hvd->btd"}


def query_latent(p: dict, x: jax.Array, cfg: Config) -> jax.Array:
    """`x [B, T, D]` -> the normed query latent `c_q [B, T, q_lora_rank]` (V3.2's indexer reads it too)."""
    return rms_norm(products.matmul(x, p["q_a"]), p["q_a_norm"], cfg.rms_norm_eps)


def queries(p: dict, x: jax.Array, positions: jax.Array, cfg: Config,
            c_q: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`x [B, T, D]` -> `q_nope [B, T, H, nope]`, `q_pe [B, T, H, rope]` (rope applied). `c_q`: the
    query latent of `x` where the caller has it already (`query_latent`)."""
    if cfg.q_lora_rank is None:
        q = products.einsum("btd,dhk->bthk", x, p["q"])
    else:
        c_q = query_latent(p, x, cfg) if c_q is None else c_q
        q = products.einsum(DECODE_PRODUCTS["q_b"], c_q, p["q_b"])
    q_nope, q_pe = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, apply_rope(q_pe, positions, cfg)


def latents(p: dict, x: jax.Array, positions: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """`x [B, T, D]` -> the cached quantities: `c_kv [B, T, r]` (normed), `k_pe [B, T, rope]` (roped)."""
    kv = products.matmul(x, p["kv_a"])
    c_kv, k_pe = jnp.split(kv, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(c_kv, p["kv_a_norm"], cfg.rms_norm_eps), apply_rope(k_pe, positions, cfg)


# ---- the two forms: queries and keys ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Query:
    """Queries `[B, T, H, k]` in one form: `main` is `q_nope` (expanded, k = nope) or `q_nope W_UK`
    (absorbed, k = kv_lora_rank); `pe` is the roped `q_pe [B, T, H, rope]`."""

    main: jax.Array
    pe: jax.Array
    absorbed: bool


@dataclasses.dataclass(frozen=True)
class Keys:
    """S keys per row in the form of the queries they meet. Absorbed: `main` and `values` are both
    the latents `c_kv [B, S, r]` (shared by all heads). Expanded: `main` is `k_nope [B, S, H, nope]`,
    `values` is `v [B, S, H, v]`. `pe [B, S, rope]`; `scale [B, S]`: int8 latent scales, or None."""

    main: jax.Array
    values: jax.Array
    pe: jax.Array
    scale: jax.Array | None

    @property
    def shared_by_heads(self) -> bool:
        return self.main.ndim == 3


def make_query(p: dict, q_nope: jax.Array, q_pe: jax.Array, absorbed: bool) -> Query:
    """The query in the chosen form; absorbed folds `W_UK` in (`[B, T, H, nope] -> [B, T, H, r]`)."""
    if not absorbed:
        return Query(q_nope, q_pe, absorbed)
    return Query(products.einsum(DECODE_PRODUCTS["wk_b"], q_nope, p["wk_b"]), q_pe, absorbed)


def make_keys(p: dict, c_kv: jax.Array, c_scale: jax.Array | None, k_pe: jax.Array, absorbed: bool,
              dtype: jnp.dtype) -> Keys:
    """Keys from latents `c_kv [B, S, r]` (possibly int8, then `c_scale [B, S]`), `k_pe [B, S, rope]`.
    Expanded keys are built from the *unscaled* int8 values: `W_UK` and `W_UV` are linear, so the
    scale still applies to scores and probabilities exactly as in the absorbed form."""
    c_kv, k_pe = latent_values(c_kv, dtype), latent_values(k_pe, dtype)
    if absorbed:
        return Keys(c_kv, c_kv, k_pe, c_scale)
    k_nope = products.einsum("bsr,hnr->bshn", c_kv, p["wk_b"])
    v = products.einsum("bsr,hvr->bshv", c_kv, p["wv_b"])
    return Keys(k_nope, v, k_pe, c_scale)


def scores(q: Query, k: Keys, cfg: Config) -> jax.Array:
    """Scaled attention scores `[B, H, T, S]` (float32)."""
    f32 = jnp.float32
    main_spec = "bthk,bsk->bhts" if k.shared_by_heads else "bthk,bshk->bhts"
    s = jnp.einsum(main_spec, q.main, k.main, preferred_element_type=f32)
    if k.scale is not None:
        s = s * k.scale[:, None, None, :]
    return (s + jnp.einsum("bthp,bsp->bhts", q.pe, k.pe, preferred_element_type=f32)) * cfg.softmax_scale


def weighted_values(probs: jax.Array, k: Keys) -> jax.Array:
    """`probs [B, H, T, S]` times the values: the context `[B, H, T, r]` (absorbed) or `[B, H, T, v]`,
    float32. (Heads before T: XLA:CPU has no bf16 x bf16 -> f32 dot for the `[B, T, H, r]` order.)"""
    if k.scale is not None:
        probs = probs * k.scale[:, None, None, :]
    spec = "bhts,bsk->bhtk" if k.shared_by_heads else "bhts,bshk->bhtk"
    return jnp.einsum(spec, probs.astype(k.values.dtype), k.values, preferred_element_type=jnp.float32)


def attention_output(p: dict, ctx: jax.Array, absorbed: bool, dtype: jnp.dtype) -> jax.Array:
    """The attention context `[B, H, T, k]` to the layer's output `[B, T, D]`: `W_UV` first when the
    context is still latent (absorbed), then `o_proj`."""
    ctx = ctx.astype(dtype)
    if absorbed:
        ctx = products.einsum(DECODE_PRODUCTS["wv_b"], ctx, p["wv_b"])
    return products.einsum(DECODE_PRODUCTS["o"], ctx, p["o"])


def _masked(s: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask, s, NEG_INF)


def masked_softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
    """The softmax over the last axis of scores `s` where `mask` (broadcast to them) holds."""
    return jax.nn.softmax(_masked(s, mask), axis=-1)


def causal_mask(t: int) -> jax.Array:
    """`[T, T]`: query i sees keys j <= i."""
    return jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]


# ---- prefill and decode -------------------------------------------------------------------------

def attend_prefill(p: dict, x: jax.Array, positions: jax.Array, cfg: Config):
    """Causal self-attention over a right-padded block `x [B, T, D]` (expanded form).

    Returns `(out [B, T, D], (c_kv, k_pe))`. Padding needs no key mask: a valid query at position i
    only sees keys j <= i, which are valid too.
    """
    with jax.named_scope("mla_prefill"):
        q_nope, q_pe = queries(p, x, positions, cfg)
        c_kv, k_pe = latents(p, x, positions, cfg)
        q = make_query(p, q_nope, q_pe, absorbed=False)
        k = make_keys(p, c_kv, None, k_pe, absorbed=False, dtype=q_nope.dtype)
        probs = masked_softmax(scores(q, k, cfg), causal_mask(x.shape[1]))
        out = attention_output(p, weighted_values(probs, k), absorbed=False, dtype=q_nope.dtype)
    return out, (c_kv, k_pe)


def attend_decode(p: dict, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array, cfg: Config,
                  one_device: bool = False, mesh: Mesh | None = None):
    """One new token per row, `x [B, D]` at `positions [B]`, against `cache.lengths[b]` cached positions
    of `layer` of a contiguous cache. `attend_cached` with T = 1; returns `(out [B, D], (c_kv [B, r],
    k_pe [B, rope]))`."""
    out, (c_new, pe_new) = attend_cached(p, x[:, None], positions[:, None], cache, layer, cfg, one_device=one_device,
                                       mesh=mesh)
    return out[:, 0], (c_new[:, 0], pe_new[:, 0])


def attend_cached(p: dict, x: jax.Array, positions: jax.Array, cache: KVCache, layer: jax.Array, cfg: Config,
                  query_at: jax.Array | None = None, one_device: bool = False, mesh: Mesh | None = None):
    """T new tokens per row, `x [B, T, D]` at `positions [B, T]` (`lengths[b] + t`), against
    `cache.lengths[b]` cached positions of `layer` of a contiguous cache and causally to each other
    (decode, and the multi-token verification of speculative decoding).

    Absorbed form. The new tokens' latents join the softmax directly, so the cache is only read
    here; the caller writes the returned `(c_kv [B, T, r], k_pe [B, T, rope])` once for all layers.
    `query_at [B]`: only row b's token `query_at[b]` queries (out `[B, 1, D]`); all T latents are
    still returned (the MTP catch-up needs the others' latents, not their outputs). `one_device`: the
    cache is whole on one device, so a backend's kernel may attend (`_kernel_attends`). `mesh`:
    the devices the step runs on, which choose the attention kernel (`kernel_choice`); by default
    JAX's default backend and `one_device`.
    """
    with jax.named_scope("mla_decode"):
        b, t = x.shape[0], x.shape[1]
        if query_at is None:
            q_nope, q_pe = queries(p, x, positions, cfg)
            own_mask = jnp.broadcast_to(causal_mask(t)[None, None], (b, 1, t, t))
        else:
            at = query_at[:, None]
            q_nope, q_pe = queries(p, jnp.take_along_axis(x, at[..., None], axis=1),
                                   jnp.take_along_axis(positions, at, axis=1), cfg)
            own_mask = (jnp.arange(t)[None, :] <= at)[:, None, None, :]
        c_new, pe_new = latents(p, x, positions, cfg)
        dt = q_nope.dtype
        q = make_query(p, q_nope, q_pe, absorbed=True)
        own = make_keys(p, c_new, None, pe_new, absorbed=True, dtype=dt)
        platform, one_device = kernel_choice(mesh, one_device)
        if query_at is None and _kernel_attends(p, cache, t, one_device):
            return _attend_by_kernel(p, q, own, cache, layer, cache.lengths, dt, cfg), (c_new, pe_new)
        if flash_decode.applies(q.main.shape[2], q.main.shape[3], q.pe.shape[3], t, cache.c_kv.dtype,
                                cache.c_scale is not None, backend=platform,
                                devices=None if mesh is None else mesh.size):
            c_scale = None if cache.c_scale is None else cache.c_scale[layer]
            ctx = _flash_context(q, own, cache.c_kv[layer], cache.k_pe[layer], c_scale, cache.lengths, cfg)
            return attention_output(p, ctx, absorbed=True, dtype=dt), (c_new, pe_new)
        if cache.max_len <= CACHE_BLOCK:
            ctx = _cache_softmax(p, q, own, own_mask, cache, layer, dt, cfg)
        else:
            ctx = _fold_cache(fold_keys(None, q, own, own_mask, cfg), p, q, cache, layer, dt, cfg).result()
        out = attention_output(p, ctx, absorbed=True, dtype=dt)
    return out, (c_new, pe_new)


CACHE_BLOCK = 256  # cached positions per step of `_fold_cache`; a cache of at most this many: one softmax


def kernel_choice(mesh: Mesh | None, one_device: bool) -> tuple[str | None, bool]:
    """The platform whose attention kernels a step on `mesh` may take (None: JAX's default backend),
    and whether the cache is whole on one device (so a backend's kernel may attend: `one_device`
    without a mesh, else a mesh of one device)."""
    if mesh is None:
        return None, one_device
    return mesh.devices.flat[0].platform, mesh.size == 1


def _kernel_attends(p: dict, cache: KVCache | PagedKVCache, queries: int, one_device: bool) -> bool:
    """Whether the backend holding the layer's weights `p` computes a decode step's attention
    (`Backend.attends`): its kernel takes every cache length in one softmax, as `_cache_softmax` (the
    XLA path folds caches of more than `CACHE_BLOCK` positions, and page pools a block of pages at a
    time)."""
    return backend_of(p).attends(cache, queries, one_device)


def _attend_by_kernel(p: dict, q: Query, own: Keys, cache: KVCache | PagedKVCache, layer: jax.Array,
                      lengths: jax.Array, dtype: jnp.dtype, cfg: Config,
                      page_table: jax.Array | None = None) -> jax.Array:
    """The attention output `[B, 1, D]` of one absorbed query per row against `lengths[b]` cached
    positions of `layer` (a page pool: through `page_table`) and its own key `own`, by the kernel of
    the backend holding `p` (`_kernel_attends`)."""
    ctx = backend_of(p).decode_attention(q.main[:, 0], q.pe[:, 0], cache.c_kv, cache.k_pe, layer, lengths,
                                         own.values[:, 0], own.pe[:, 0], cfg.softmax_scale, page_table=page_table,
                                         c_scale=cache.c_scale)
    return attention_output(p, ctx[:, :, None], absorbed=True, dtype=dtype)


def _cache_softmax(p: dict, q: Query, own: Keys, own_mask: jax.Array, cache: KVCache, layer: jax.Array,
                   dtype: jnp.dtype, cfg: Config) -> jax.Array:
    """The context `[B, H, T, r]` from one softmax over all of `layer`'s cache and the new tokens: the
    probabilities normalized before they are rounded to a bf16 model's dtype, as HF's attention rounds
    them (the online softmax of `_fold_cache` rounds them unnormalized; in a small bf16 model that
    difference, ~2^-9, can flip a routing choice)."""
    s = cache.max_len
    cached = make_keys(p, *cache.read_block(layer, 0, s), absorbed=True, dtype=dtype)
    b, queried = own_mask.shape[0], own_mask.shape[2]
    valid = jnp.arange(s)[None, :] < cache.lengths[:, None]
    mask = jnp.concatenate([jnp.broadcast_to(valid[:, None, None, :], (b, 1, queried, s)), own_mask], axis=-1)
    probs = masked_softmax(jnp.concatenate([scores(q, cached, cfg), scores(q, own, cfg)], axis=-1), mask)
    return weighted_values(probs[..., :s], cached) + weighted_values(probs[..., s:], own)


def _fold_cache(state: PartialSoftmax, p: dict, q: Query, cache: KVCache, layer: jax.Array, dtype: jnp.dtype,
                cfg: Config) -> PartialSoftmax:
    """Fold every row's `cache.lengths[b]` cached positions of `layer` into `state`, `CACHE_BLOCK` at a
    time, in as many steps as the longest row needs: a step's cost follows the positions held, not
    the cache's `max_len`. Each block is one slice of the whole cache (`KVCache.read_block`)."""
    s = cache.max_len
    n = min(CACHE_BLOCK, s)

    def read(i):
        # The last block may overlap the one before it (s not a multiple of n): its earlier positions are masked.
        start = jnp.minimum(i * n, s - n)
        positions = start + jnp.arange(n)
        held = (positions >= i * n)[None, :] & (positions[None, :] < cache.lengths[:, None])
        return cache.read_block(layer, start, n), held

    return _fold_blocks(state, p, q, (jnp.max(cache.lengths) + n - 1) // n, read, dtype, cfg)


def _flash_context(q: Query, own: Keys, c_cache: jax.Array, pe_cache: jax.Array, c_scale: jax.Array | None,
                   lengths: jax.Array, cfg: Config, interpret: bool = False) -> jax.Array:
    """`attend_cached`'s context `[B, H, 1, r]` for one query per row by the GPU kernel
    (`flash_decode`): the cache (int8: with its scales `c_scale`) read in blocks, scores kept on chip,
    the new token's own key folded in after."""
    acc, run_max, run_sum = flash_decode.cached_context(q.main[:, 0], q.pe[:, 0], c_cache, pe_cache, lengths,
                                                        cfg.softmax_scale, c_scale, interpret=interpret)
    own_score = scores(q, own, cfg)[:, :, 0, 0]  # [B, H]
    return flash_decode.combine(acc, run_max, run_sum, own_score, own.values[:, 0])[:, :, None]


# ---- extend: T new tokens per row against paged context ------------------------------------------

def absorbed_crossover(cfg: Config) -> float:
    """The chunk length T below which the absorbed form costs fewer FLOPs than the expanded one.

    Per cached token and head, for a chunk of T queries (r = kv_lora_rank, n = qk_nope, v = v_head):
    absorbed costs `T (r + rope)` for scores plus `T r` for values; expanded first builds the
    token's key and value, `r (n + v)`, then costs `T (n + rope)` plus `T v`. So absorbed wins while
    `T (2r - n - v) < r (n + v)`: T < 171 for R1 (r = 512, n = v = 128). (The per-query terms,
    folding `W_UK` and `W_UV`, cost `r (n + v)` per query whatever the context and lower the
    crossover a little for short contexts: ~146 at 1024 cached tokens.) Infinite when the latent is
    no wider than a head's key plus value.
    """
    r, n, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    saving = 2 * r - n - v
    return math.inf if saving <= 0 else r * (n + v) / saving


def use_absorbed(cfg: Config, chunk: int) -> bool:
    """Whether `extend` with `chunk` new tokens per row should run the absorbed form (static)."""
    return chunk < absorbed_crossover(cfg)


@dataclasses.dataclass(frozen=True)
class PagedContext:
    """What a row's new tokens attend to besides themselves, for every layer: the page pool, each
    row's page table `[B, P]`, and how many of its tokens are cached `[B]` (positions `< cached` are
    read; the new tokens sit right after). `block_pages`: pages read per step of the online softmax."""

    cache: PagedKVCache
    page_table: jax.Array
    cached: jax.Array
    block_pages: int

    @property
    def block_tokens(self) -> int:
        return self.block_pages * self.cache.page_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PartialSoftmax:
    """A softmax over the keys seen so far, kept unnormalized (flash-attention style): the running
    max score `[B, H, T]`, the sum of `exp(score - max)` `[B, H, T]`, and the values weighted by
    those exponentials `[B, H, T, k]` (float32)."""

    max: jax.Array
    total: jax.Array
    acc: jax.Array

    def result(self) -> jax.Array:
        """The normalized context `[B, H, T, k]`."""
        return self.acc / self.total[..., None]

    def merge(self, other: PartialSoftmax) -> PartialSoftmax:
        """The partial softmax over both sets of keys (either may be empty: max `NEG_INF`, zeros)."""
        new_max = jnp.maximum(self.max, other.max)
        mine, theirs = jnp.exp(self.max - new_max), jnp.exp(other.max - new_max)
        return PartialSoftmax(new_max, self.total * mine + other.total * theirs,
                              self.acc * mine[..., None] + other.acc * theirs[..., None])


def fold_keys(state: PartialSoftmax | None, q: Query, k: Keys, mask: jax.Array, cfg: Config) -> PartialSoftmax:
    """Fold one block of keys into a partial softmax (None: start one). `mask` broadcasts to the
    scores `[B, H, T, S]`; a query that has seen no key keeps max NEG_INF and zeros (`empty_softmax`)."""
    s = _masked(scores(q, k, cfg), mask)
    block_max = s.max(axis=-1)
    new_max = block_max if state is None else jnp.maximum(state.max, block_max)
    # Masked scores give 0, also in a block that a query sees none of before any key (its max NEG_INF).
    e = jnp.where(mask, jnp.exp(s - new_max[..., None]), 0.0)
    total, acc = e.sum(axis=-1), weighted_values(e, k)
    if state is None:
        return PartialSoftmax(new_max, total, acc)
    rescale = jnp.exp(state.max - new_max)
    return PartialSoftmax(new_max, state.total * rescale + total, state.acc * rescale[..., None] + acc)


def _fold_pages(state: PartialSoftmax, p: dict, q: Query, context: PagedContext, layer: jax.Array,
                dtype: jnp.dtype, cfg: Config, mesh: Mesh | None = None,
                rules: ShardingRules = DEFAULT_RULES) -> PartialSoftmax:
    """Fold every row's cached tokens into `state`, `block_pages` pages at a time, in as many steps as
    the longest row needs (a dynamic trip count: cost follows the context actually held, not the
    page table's width). Each step gathers one block of pages per row, never a whole context."""
    n = context.block_pages
    width = context.page_table.shape[1]
    table = jnp.pad(context.page_table, [(0, 0), (0, -width % n)])  # whole blocks; padding is masked
    steps = (jnp.max(context.cached) + context.block_tokens - 1) // context.block_tokens

    def read(i):
        pages = jax.lax.dynamic_slice_in_dim(table, i * n, n, axis=1)
        positions = i * context.block_tokens + jnp.arange(context.block_tokens)
        stored = read_rank_pages(context.cache, layer, pages, mesh, rules)
        return stored, positions[None, :] < context.cached[:, None]

    return _fold_blocks(state, p, q, steps, read, dtype, cfg)


def _kernel_pages(q: Query, context: PagedContext, layer: jax.Array, cfg: Config, mesh: Mesh | None,
                  rules: ShardingRules) -> PartialSoftmax:
    """Every row's cached tokens of `layer` as one partial softmax, by the ragged paged kernel
    (`paged_attention`): a row's T queries and H heads meet its latents together, each row reads its
    own pages. On a mesh the heads stay split as the queries are (`rules.heads`); the pool is read
    whole on every device, or, under attention data parallelism, each rank reads its own pages for its
    own rows (`cache.pool_axes`)."""
    cache = context.cache

    def run(main, pe, c_kv, k_pe, c_scale, table, cached, layer):
        b, t, h, r = main.shape
        acc, run_max, total = paged_attention.paged_context(
            main.reshape(b, t * h, r), pe.reshape(b, t * h, -1), c_kv, k_pe, c_scale, layer, table, cached,
            cfg.softmax_scale)
        by_head = lambda a: a.reshape(b, t, h, *a.shape[2:]).swapaxes(1, 2)  # noqa: E731  [B, H, T, ...]
        return by_head(acc), by_head(run_max), by_head(total)

    args = (q.main, q.pe, cache.c_kv, cache.k_pe, cache.c_scale, context.page_table, context.cached, layer)
    if mesh is not None and mesh.size > 1:
        heads, stats = rules.spec(("batch", None, "heads", None)), rules.spec(("batch", "heads", None))
        pool, rows = pool_specs(cache, mesh, rules).c_kv, rules.spec(("batch",))
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, heads, pool, pool, pool, rows, rows, P()),
                            out_specs=(rules.spec(("batch", "heads", None, None)), stats, stats), check_vma=False)
    acc, run_max, total = run(*args)
    return PartialSoftmax(run_max, total, acc)


def empty_softmax(q: Query) -> PartialSoftmax:
    """A partial softmax over no keys, for `q`'s rows, heads and queries (absorbed: latent values)."""
    b, t, h, k = q.main.shape
    return PartialSoftmax(jnp.full((b, h, t), NEG_INF, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
                          jnp.zeros((b, h, t, k), jnp.float32))


def _positions_split_pages(q: Query, context: PagedContext, layer: jax.Array, dtype: jnp.dtype, cfg: Config,
                           mesh: Mesh, rules: ShardingRules, kernel: bool) -> PartialSoftmax:
    """Every row's cached tokens of `layer` as one partial softmax, from a pool whose rows' pages are
    dealt out over the positions axis (`cache.pool_axes`; absorbed queries only): each device folds
    the pages it holds for every head of its rows (by the ragged paged kernel where `kernel`, else
    XLA's page loop), and one max and two sums over the positions axis combine the partials
    (flash-decoding across devices; the sums reduce-scattered over the heads where the heads are split
    over the same axis). The queries are gathered over their heads' split first: latent keys are
    shared by all heads, so a device serves all heads of its positions."""
    rows_axis, positions_axis = pool_axes(mesh, rules)
    page_size, block_pages = context.cache.page_size, context.block_pages

    def run(main, pe, pool, table, cached, layer):
        device, devices = jax.lax.axis_index(positions_axis), jax.lax.axis_size(positions_axis)
        table, cached = local_pages(table, cached, page_size, device, devices)
        local = PagedContext(pool, table, cached, block_pages)
        q = Query(main, pe, absorbed=True)
        state = (_kernel_pages(q, local, layer, cfg, None, rules) if kernel
                 else _fold_pages(empty_softmax(q), {}, q, local, layer, dtype, cfg))
        top = jax.lax.pmax(state.max, positions_axis)
        weight = jnp.exp(state.max - top)
        total, acc = state.total * weight, state.acc * weight[..., None]
        if not by_heads:
            return top, jax.lax.psum(total, positions_axis), jax.lax.psum(acc, positions_axis)
        # Each device keeps the sums of the heads it serves next (a reduce-scatter, half an all-reduce).
        share = top.shape[1] // devices
        return (jax.lax.dynamic_slice_in_dim(top, device * share, share, axis=1),
                jax.lax.psum_scatter(total, positions_axis, scatter_dimension=1, tiled=True),
                jax.lax.psum_scatter(acc, positions_axis, scatter_dimension=1, tiled=True))

    by_heads = rules.heads == positions_axis  # the heads are split over the positions' devices
    rows, out = P(rows_axis), P(rows_axis, positions_axis if by_heads else None)
    run = jax.shard_map(run, mesh=mesh, in_specs=(rows, rows, pool_specs(context.cache, mesh, rules), rows, rows, P()),
                        out_specs=(out, out, out), axis_names={a for a in (rows_axis, positions_axis) if a},
                        check_vma=False)
    top, total, acc = run(q.main, q.pe, context.cache, context.page_table, context.cached, layer)
    return PartialSoftmax(top, total, acc)


def _fold_blocks(state: PartialSoftmax, p: dict, q: Query, steps: jax.Array, read: Callable, dtype: jnp.dtype,
                 cfg: Config) -> PartialSoftmax:
    """`steps` blocks of cached keys folded into `state`: `read(i)` gives block i's stored latents
    `(c_kv, c_scale, k_pe)` and which of its positions each row holds `[B, n]`."""
    def step(i, state):
        stored, held = read(i)
        keys = make_keys(p, *stored, q.absorbed, dtype)
        return fold_keys(state, q, keys, held[:, None, None, :], cfg)

    return jax.lax.fori_loop(0, steps, step, state)


def attend_extend(p: dict, x: jax.Array, positions: jax.Array, context: PagedContext, layer: jax.Array,
                  cfg: Config, *, absorbed: bool, one_device: bool = False, mesh: Mesh | None = None,
                  rules: ShardingRules = DEFAULT_RULES):
    """T new tokens per row, `x [B, T, D]` at `positions [B, T]` (`context.cached[b] + t`), attending
    to their row's cached tokens in `layer` of the page pool and causally to each other.

    The new tokens' latents join the softmax directly (the pool is only read here); the caller writes
    the returned `(c_kv [B, T, r], k_pe [B, T, rope])` for all layers at once. `absorbed` picks the
    form (see `use_absorbed`). `one_device`: the pool is whole on one device, so with one new token per
    row a backend's kernel may attend (`_kernel_attends`); `mesh`: see `attend_cached`; on TPU
    (absorbed) the ragged paged kernel reads the pages, its heads split as `rules` split them.
    Returns `(out [B, T, D], (c_kv, k_pe))`.
    """
    with jax.named_scope("mla_extend"):
        q_nope, q_pe = queries(p, x, positions, cfg)
        c_new, pe_new = latents(p, x, positions, cfg)
        dt = q_nope.dtype
        q = make_query(p, q_nope, q_pe, absorbed)
        if absorbed and _kernel_attends(p, context.cache, x.shape[1], kernel_choice(mesh, one_device)[1]):
            own = make_keys(p, c_new, None, pe_new, absorbed=True, dtype=dt)
            return (_attend_by_kernel(p, q, own, context.cache, layer, context.cached, dt, cfg, context.page_table),
                    (c_new, pe_new))
        with jax.named_scope("new_tokens"):
            state = fold_keys(None, q, make_keys(p, c_new, None, pe_new, absorbed, dt), causal_mask(x.shape[1]), cfg)
        with jax.named_scope("cached_pages"):
            kernel = absorbed and paged_attention.applies(kernel_choice(mesh, one_device)[0])
            if pool_axes(mesh, rules)[1] is not None:
                state = state.merge(_positions_split_pages(q, context, layer, dt, cfg, mesh, rules, kernel))
            elif kernel:
                state = state.merge(_kernel_pages(q, context, layer, cfg, mesh, rules))
            else:
                state = _fold_pages(state, p, q, context, layer, dt, cfg, mesh, rules)
        out = attention_output(p, state.result(), absorbed, dt)
    return out, (c_new, pe_new)
