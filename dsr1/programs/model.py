"""The model's passes as programs: `forward`, `prefill`, `decode` and `extend` of `dsr1.core.model`,
`greedy_decode`, `random_cache` and `greedy_main_and_draft` for benchmarks and profiles, `paged_cache` for the serving
engine's page pool (the table: `dsr1.programs`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..core import model, mtp, params
from ..core.cache import (
    KVCache,
    PagedKVCache,
    empty_paged_cache,
    keep_cache_rows,
    keep_pool_layout,
    quantize_latent,
    to_stored,
)
from ..core.config import Config
from ..core.params import Params
from ..core.quant import check_quant
from ..core.sharding import DEFAULT_RULES, ShardingRules
from .sampling import argmax

__all__ = ["decode", "extend", "forward", "greedy_decode", "greedy_main_and_draft", "paged_cache", "prefill",
           "random_cache"]

_MODEL = ("cfg", "mesh", "rules")  # the static arguments every program shares

forward = jax.jit(model.forward, static_argnames=_MODEL)
prefill = jax.jit(model.prefill, static_argnames=(*_MODEL, "max_len", "kv_cache_dtype"))
decode = jax.jit(model.decode, static_argnames=_MODEL, donate_argnames=("cache",))
extend = jax.jit(model.extend, static_argnames=(*_MODEL, "absorbed", "block_pages"), donate_argnames=("cache",))
random_params = jax.jit(params.random_params, static_argnames=(*_MODEL, "dtype", "quant", "mtp"))


def init_params(cfg: Config, mesh: Mesh, rules: ShardingRules, *, seed: int, dtype: Any, quant: str | None = None,
                mtp: bool = False) -> Params:
    """Random weights created directly in their shardings (`dsr1.core.params.random_params`, one program,
    no host copy); the values depend on `seed` only, not on the mesh."""
    return random_params(jax.random.key(seed), cfg=cfg, mesh=mesh, rules=rules, dtype=jnp.dtype(dtype),
                         quant=check_quant(quant), mtp=mtp)


# ---- benchmarks and profiles ---------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=(*_MODEL, "steps"), donate_argnames=("cache",))
def greedy_decode(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                  rules: ShardingRules, steps: int) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """`steps` greedy decode steps in one program. Returns the grown cache, the tokens fed at each
    step `[steps, B]` (the first is `tokens`, then each step's argmax), the routed expert ids of
    each step `[steps, L_moe, B, K]`, and the last step's argmax `[B]`."""
    batch, k = tokens.shape[0], cfg.num_experts_per_tok
    fed = jnp.zeros((steps, batch), jnp.int32)
    ids = jnp.zeros((steps, cfg.num_moe_layers, batch, k), jnp.int32)

    def body(i, carry):
        cache, tokens, fed, ids = carry
        logits, cache, routed = model.decode(params, cache, tokens, cfg=cfg, mesh=mesh, rules=rules)
        fed = fed.at[i].set(tokens)
        if routed is not None:
            ids = ids.at[i].set(routed)
        return cache, argmax(logits), fed, ids

    cache, last, fed, ids = jax.lax.fori_loop(0, steps, body, (cache, tokens, fed, ids))
    return cache, fed, ids, last


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "batch", "context", "max_len", "dtype", "kv_cache_dtype",
                                             "rules"))
def random_cache(key: jax.Array, *, cfg: Config, mesh: Mesh, batch: int, context: int, max_len: int, dtype: Any,
                 kv_cache_dtype: str | None, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
    """A cache as if `batch` prompts of `context` tokens had been prefilled: random latents (and, for
    sparse attention, indexer keys) in the cache's dtype, room for `max_len` positions, laid out over
    the mesh by `rules` (`keep_cache_rows`)."""
    layers = cfg.num_hidden_layers
    k_lat, k_pe = jax.random.split(key)
    c_kv = jax.random.normal(k_lat, (layers, batch, max_len, cfg.kv_lora_rank), jnp.float32)
    pe = jax.random.normal(k_pe, (layers, batch, max_len, cfg.qk_rope_head_dim), jnp.float32).astype(dtype)
    c_kv, c_scale = quantize_latent(c_kv) if kv_cache_dtype == "int8" else (c_kv.astype(dtype), None)
    platform = mesh.devices.flat[0].platform
    index_k = None
    if cfg.sparse_attention:
        keys = jax.random.normal(jax.random.fold_in(key, 2), (layers, batch, max_len, cfg.index_head_dim))
        index_k = to_stored(keys.astype(dtype), platform)
    cache = KVCache(to_stored(c_kv, platform), to_stored(pe, platform), c_scale, jnp.full((batch,), context, jnp.int32),
                    index_k)
    return keep_cache_rows(cache, mesh, rules)


@functools.partial(jax.jit, static_argnames=_MODEL)
def greedy_main_and_draft(params: Params, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                          rules: ShardingRules) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced argmaxes of whole rows `tokens [B, T]`: the model's at each position `[B, T]`, and
    the MTP module's from the model's hidden state there and the true next token `[B, T]` (what
    `dsr1.bench quality` compares to count the drafts greedy decoding would accept)."""
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits, hidden = model.forward_hidden(params, tokens, lengths, cfg=cfg, mesh=mesh, rules=rules)
    following = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # the token after each position
    drafts, _ = mtp.mtp_forward(params, hidden, following, lengths, cfg=cfg, mesh=mesh, rules=rules)
    return logits.argmax(-1), drafts.argmax(-1)


# ---- serving -------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "num_pages", "page_size", "dtype", "kv_cache_dtype",
                                             "rules"))
def paged_cache(*, cfg: Config, mesh: Mesh, num_pages: int, page_size: int, dtype: Any,
                kv_cache_dtype: str | None, rules: ShardingRules = DEFAULT_RULES) -> PagedKVCache:
    """An empty pool of `num_pages` pages of `page_size` tokens (page 0 is the scratch page) for every
    layer, in the model's `dtype` (or int8 latents with per-token scales; sparse attention's indexer keys
    beside them, in the model's dtype), whole on every device; or,
    under attention data parallelism (`rules.batch`, `rules.positions`), split evenly over the devices
    of those axes, each share's first page its own scratch page (`cache.pool_axes`)."""
    cache = empty_paged_cache(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                              jnp.dtype(dtype), kv_cache_dtype, mesh.devices.flat[0].platform,
                              cfg.index_head_dim if cfg.sparse_attention else 0)
    return keep_pool_layout(cache, mesh, rules)

