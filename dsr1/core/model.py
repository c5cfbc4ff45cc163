"""DeepSeek-V3 forward passes as pure functions of (params, inputs).

Layers are stacked (the dense ones, then the MoE ones) and run under `jax.lax.scan`, so compile
time does not grow with depth. The residual stream is float32; matmuls run in the weights' dtype.

The layers attend through MLA (`dsr1.core.attention`) or, for V3.2, DeepSeek Sparse Attention
(`dsr1.core.sparse_attention`): `attention_module` picks one from the config.

- `forward`: logits for every position (prefill attention path).
- `prefill`: logits at each row's last token, and a KVCache holding the prompts' latents.
- `decode`: one token per row with absorbed attention against the cache.
- `verify`: T tokens per row against the cache in one pass, causal among themselves (speculative
  verification).
- `verify_per_position`: the same pass with each position in decode's own shapes (the numerics of
  `decode`, bit for bit: the batch-invariant mode); `verify_by_steps`: as T decode steps.
- `extend`: T new tokens per row against each row's pages of a `PagedKVCache` (serving: chunked
  prefill, prefill after a prefix-cache hit, decode with T = 1, speculative verification).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import attention, sparse_attention
from .attention import PagedContext, use_absorbed
from .backend import backend_of
from .cache import (
    KVCache,
    PagedKVCache,
    append_token,
    append_tokens,
    cache_from_prefill,
    keep_cache_rows,
    keep_pool_layout,
    latent_parts,
    pool_axes,
    token_slots,
    write_rank_tokens,
)
from .config import Config
from .layers import mlp, rms_norm
from .moe import RouterStats, moe, router_stats
from .params import STACKS, Params, stack_layers
from .products import einsum, to_float32
from .sharding import ShardingRules, keep_rows

# Activations and the decode cache are laid out by their rows (`keep_rows`): whole on every device
# in the low-latency layout, split over the data-parallel axis under attention data parallelism.

Attend = Callable[[dict, jax.Array, jax.Array], tuple[jax.Array, tuple[jax.Array, ...]]]
"""`attend(layer_params, normed_x, layer_index) -> (out, (c_kv, k_pe))`: one layer's attention (sparse
attention's new latents add the indexer keys: `(c_kv, k_pe, index_k)`)."""


def attention_module(cfg: Config) -> ModuleType:
    """The attention the layers of `cfg` run: `sparse_attention` for DeepSeek Sparse Attention (V3.2),
    else MLA's `attention`. Both give `attend_prefill(p, x, positions, cfg)` and `attend_decode(p, x,
    positions, cache, layer, cfg, one_device=, mesh=)`, and `attend_cached` (T tokens per row)."""
    return sparse_attention if cfg.sparse_attention else attention

DEFAULT_BLOCK_TOKENS = 512  # tokens of context per step of extend's page loop (rounded to whole pages)
CHUNK_BLOCK_TOKENS = 256  # the same for chunks of more than 8 new tokens (see `default_block_pages`)


def _feed_forward(p: dict, x: jax.Array, cfg: Config, mesh: Mesh, rules: ShardingRules,
                  layer: jax.Array | None, train: bool = False) -> tuple[jax.Array, jax.Array | RouterStats | None]:
    """The layer's MLP or MoE output (float32), and the routed expert ids (None for a dense layer).
    `layer`: the index into the routed-expert stacks (see `_run_layers`). `train`: differentiable
    experts, and `RouterStats` of `x [B, T, D]` in place of the expert ids."""
    if "moe" in p:
        with jax.named_scope("moe"):
            out, experts = moe(p["moe"], x, cfg, mesh, rules, layer, differentiable=train)
            return out, (router_stats(p["moe"], x, experts, cfg) if train else experts)
    with jax.named_scope("mlp"):
        return mlp(p["mlp"], x).astype(jnp.float32), None


def _block(p: dict, x: jax.Array, attend, cfg: Config, mesh: Mesh, rules: ShardingRules,
           layer: jax.Array | None = None, train: bool = False):
    """One pre-norm transformer layer; `attend(p, normed_x)` returns (out, new latents).
    Returns the new residual stream and (new latents, routed expert ids or None)."""
    h, new_kv = attend(p, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps))
    x = keep_rows(x + h.astype(jnp.float32), mesh, rules)
    ffn, experts = _feed_forward(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), cfg, mesh, rules, layer, train)
    return keep_rows(x + ffn, mesh, rules), (new_kv, experts)


def _embed(params: Params, tokens: jax.Array) -> jax.Array:
    return to_float32(jax.tree.map(lambda a: a[tokens], params["embed"]))


def _logits(params: Params, x: jax.Array, cfg: Config) -> jax.Array:
    with jax.named_scope("lm_head"):
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        return einsum("...d,dv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


ROUTED_EXPERTS = ("gate", "up", "down")  # a MoE layer's routed-expert weights, read in place


def _split_routed_experts(stack: dict, router_in_place: bool = False) -> tuple[dict, dict | None]:
    """A layer stack's weights as (what the layer scan slices, the routed-expert stacks `[L, E, ...]`
    that it does not). The expert kernels slice one expert of one layer in place; scanned, a layer's
    whole expert stack would be sliced out first (on CPU a copy of it, every layer, every step).
    `router_in_place`: the router's stack `[L, D, E]` too, for the CPU backend (`moe.route`)."""
    if "moe" not in stack:
        return stack, None
    moe_p = stack["moe"]
    kept = ROUTED_EXPERTS + (("router",) if router_in_place else ())
    scanned = {**stack, "moe": {k: v for k, v in moe_p.items() if k not in kept}}
    return scanned, {k: moe_p[k] for k in kept}


def _run_layers(params: Params, x: jax.Array, attend: Attend, cfg: Config, mesh: Mesh, rules: ShardingRules,
                train: bool = False, block: Callable | None = None):
    """Every layer stack under `lax.scan`. `attend(p, normed_x, layer)` gets the model-wide layer
    index (a scan input, so a cache is read in place by index, never sliced into a copy); the routed
    experts are read in place the same way, by their index in the stack. `block(p, x, layer,
    in_stack)`: what runs one layer in place of `_block` with `attend` (`verify_per_position`).

    Returns the final hidden states, every layer's new latents `([L, ...r], [L, ...rope])` (sparse
    attention: and `[L, ..., index_head_dim]`, the indexer keys) and the
    routed expert ids of the MoE layers `[L_moe, ..., K]` (None without MoE layers); with `train`
    (differentiable experts, for `dsr1.train`) their `RouterStats` stacked `[L_moe, ...]` instead."""
    new_latents, routing = [], None
    for stack in STACKS:
        if stack not in params:
            continue
        layers = stack_layers(cfg, stack)
        # A backend holding the weights may read the layer's router and weight copies in their stacks.
        backend = backend_of(params[stack])
        in_place = backend.routers_in_stack and not train and mesh.size == 1
        scanned, routed = _split_routed_experts(params[stack], in_place)
        scanned, copies = backend.in_place_copies(scanned)

        def layer(x, inputs, routed=routed, copies=copies, backend=backend):
            p, i, in_stack = inputs
            if copies is not None:
                p = backend.with_layer_copies(p, copies, in_stack)
            if routed is not None:
                router = {"router": backend.router_in_stack(routed["router"], in_stack)} if "router" in routed else {}
                p = {**p, "moe": {**p["moe"], **routed, **router}}
            if block is not None:
                return block(p, x, i, in_stack)
            return _block(p, x, lambda p, h: attend(p, h, i), cfg, mesh, rules, in_stack, train)

        with jax.named_scope(stack):
            x, (kv, experts) = jax.lax.scan(
                layer, x, (scanned, jnp.arange(layers.start, layers.stop), jnp.arange(len(layers))))
        new_latents.append(kv)
        routing = experts if experts is not None else routing
    return x, tuple(jnp.concatenate(parts) for parts in zip(*new_latents)), routing


def _prefill_hidden(params: Params, tokens: jax.Array, cfg: Config, mesh: Mesh, rules: ShardingRules):
    """Final hidden states `[B, T, D]` and every layer's latents `([L, B, T, r], [L, B, T, rope])` (and
    indexer keys, for sparse attention)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = keep_rows(_embed(params, tokens), mesh, rules)
    attend_prefill = attention_module(cfg).attend_prefill
    x, latents, _ = _run_layers(params, x, lambda p, h, _: attend_prefill(p, h, positions, cfg), cfg, mesh, rules)
    return x, latents


def forward(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
            rules: ShardingRules) -> jax.Array:
    """Logits `[B, T, V]` (float32) for right-padded `tokens [B, T]`; positions >= lengths are zero."""
    return forward_hidden(params, tokens, lengths, cfg=cfg, mesh=mesh, rules=rules)[0]


def forward_hidden(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
                   rules: ShardingRules) -> tuple[jax.Array, jax.Array]:
    """`forward`'s logits `[B, T, V]` and the residual stream entering the final norm `[B, T, D]`
    (float32; the MTP module's input, `dsr1.core.mtp`); both zero at positions >= lengths."""
    x, _ = _prefill_hidden(params, tokens, cfg, mesh, rules)
    valid = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None])[..., None]
    logits = jnp.where(valid, _logits(params, x, cfg), 0.0)
    return keep_rows(logits, mesh, rules), keep_rows(jnp.where(valid, x, 0.0), mesh, rules)


def forward_train(params: Params, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                  rules: ShardingRules) -> tuple[jax.Array, jax.Array, RouterStats | None]:
    """The differentiable full-sequence forward that `dsr1.train` trains: logits `[B, T, V]` (float32)
    of full-length `tokens [B, T]`, the residual stream entering the final norm `[B, T, D]` (the MTP
    module's input), and the MoE layers' `RouterStats` stacked `[L_moe, ...]` (None without MoE).
    Pass float32 or bf16 arrays (weights in a backend's layout are for inference)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = _embed(params, tokens)
    attend_prefill = attention_module(cfg).attend_prefill
    x, _, stats = _run_layers(params, x, lambda p, h, _: attend_prefill(p, h, positions, cfg), cfg, mesh, rules,
                              train=True)
    return _logits(params, x, cfg), x, stats


def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
            rules: ShardingRules, max_len: int, kv_cache_dtype: str | None = None) -> tuple[jax.Array, KVCache]:
    """Logits `[B, V]` at each row's last prompt token, and a cache of `max_len` positions."""
    logits, cache, _ = prefill_hidden(params, tokens, lengths, cfg=cfg, mesh=mesh, rules=rules, max_len=max_len,
                                      kv_cache_dtype=kv_cache_dtype)
    return logits, cache


def prefill_hidden(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
                   rules: ShardingRules, max_len: int,
                   kv_cache_dtype: str | None = None) -> tuple[jax.Array, KVCache, jax.Array]:
    """`prefill`, and the residual stream entering the final norm at every position `[B, T, D]`
    (float32; what the MTP module reads, `dsr1.generation.speculative`)."""
    x, latents = _prefill_hidden(params, tokens, cfg, mesh, rules)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = keep_rows(_logits(params, last, cfg), mesh, rules)
    c_kv, k_pe, index_k = latent_parts(latents)
    cache = cache_from_prefill(c_kv, k_pe, lengths, max_len, kv_cache_dtype, mesh.devices.flat[0].platform, index_k)
    return logits, keep_cache_rows(cache, mesh, rules), keep_rows(x, mesh, rules)


def decode(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
           rules: ShardingRules) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Logits `[B, V]` for one new token per row at position `cache.lengths`, the grown cache, and
    the routed expert ids of every MoE layer `[L_moe, B, K]` (None without MoE layers): what the
    step read, for benchmarks and profiles (an unused output costs nothing under jit)."""
    logits, cache, routing, _ = decode_hidden(params, cache, tokens, cfg=cfg, mesh=mesh, rules=rules)
    return logits, cache, routing


def decode_hidden(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                  rules: ShardingRules) -> tuple[jax.Array, KVCache, jax.Array | None, jax.Array]:
    """`decode`, and the residual stream entering the final norm `[B, D]` (float32; the MTP module's
    input): the one-token step that `verify_by_steps` repeats."""
    positions = cache.lengths
    x = keep_rows(_embed(params, tokens), mesh, rules)
    attend_decode = attention_module(cfg).attend_decode

    def attend(p, h, i):
        return attend_decode(p, h, positions, cache, i, cfg, mesh=mesh)

    x, new_latents, routing = _run_layers(params, x, attend, cfg, mesh, rules)
    logits = keep_rows(_logits(params, x, cfg), mesh, rules)
    cache = keep_cache_rows(append_token(cache, *latent_parts(new_latents)), mesh, rules)
    return logits, cache, routing, keep_rows(x, mesh, rules)


def verify(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
           rules: ShardingRules) -> tuple[jax.Array, jax.Array, KVCache]:
    """T new tokens per row at positions `cache.lengths + t` against a contiguous cache in one pass over
    the weights, causal among themselves (absorbed attention: `decode` for T tokens), the verification
    step of speculative decoding. Its logits equal T decode steps' up to float rounding: the products
    run on T times the rows, in the shapes' own reduction orders (`verify_by_steps` has decode's own).
    Returns logits `[B, T, V]` (float32), the residual stream entering the final norm `[B, T, D]` (the
    MTP module's input) and the cache with all T written and `lengths + T`; keep fewer by setting
    `lengths` back (rejected drafts are then never read, and later overwritten)."""
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    x = keep_rows(_embed(params, tokens), mesh, rules)
    attend_cached = attention_module(cfg).attend_cached

    def attend(p, h, i):
        return attend_cached(p, h, positions, cache, i, cfg, mesh=mesh)

    x, new_latents, _ = _run_layers(params, x, attend, cfg, mesh, rules)
    logits = keep_rows(_logits(params, x, cfg), mesh, rules)
    cache = keep_cache_rows(append_tokens(cache, *latent_parts(new_latents)), mesh, rules)
    return logits, keep_rows(x, mesh, rules), cache


def _layer_view(cache: KVCache, layer: jax.Array) -> KVCache:
    """One layer of a contiguous cache as a cache of one layer (a copy of that layer's latents)."""
    def one(a: jax.Array | None) -> jax.Array | None:
        return None if a is None else jax.lax.dynamic_slice_in_dim(a, layer, 1, axis=0)

    return KVCache(one(cache.c_kv), one(cache.k_pe), one(cache.c_scale), cache.lengths, one(cache.index_k))


def verify_per_position(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                        rules: ShardingRules) -> tuple[jax.Array, jax.Array, KVCache]:
    """`verify` with every position's arithmetic that of the one-token decode step, bit for bit, in one
    pass over the layer stack: each layer runs the T positions one after another in decode's own
    shapes (`[B]` rows per product, one query per row), position t attending to a copy of the layer's
    cache holding positions `< lengths + t` (the positions before it appended there, stored as decode
    stores them). The k+1 positions of a verification meet each layer's weights together, but its
    products do not batch them: what a row computes never depends on how many positions share the
    step (the batch-invariant mode, `dsr1.generate(..., batch_invariant=True)`). Returns what
    `verify` returns."""
    x = keep_rows(_embed(params, tokens), mesh, rules)
    attend_decode = attention_module(cfg).attend_decode

    def block(p: dict, x: jax.Array, i: jax.Array, in_stack: jax.Array):
        # A loop over the positions, not T copies of the layer: XLA may merge independent products
        # that share a weight into one of more rows, which would sum them in another order.
        def position(view: KVCache, x_t: jax.Array):
            def attend(p, h):
                return attend_decode(p, h, view.lengths, view, jnp.zeros((), jnp.int32), cfg, mesh=mesh)

            out, (kv, routed) = _block(p, x_t, attend, cfg, mesh, rules, in_stack)
            view = append_token(view, *(None if a is None else a[None] for a in latent_parts(kv)))
            return view, (out, kv, routed)

        _, (outs, kv, routed) = jax.lax.scan(position, _layer_view(cache, i), jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(outs, 0, 1), (jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), (kv, routed)))

    x, new_latents, _ = _run_layers(params, x, None, cfg, mesh, rules, block=block)
    logits = jnp.swapaxes(jax.lax.map(lambda x_t: _logits(params, x_t, cfg), jnp.swapaxes(x, 0, 1)), 0, 1)
    logits = keep_rows(logits, mesh, rules)
    cache = keep_cache_rows(append_tokens(cache, *latent_parts(new_latents)), mesh, rules)
    return logits, keep_rows(x, mesh, rules), cache


def verify_by_steps(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                    rules: ShardingRules) -> tuple[jax.Array, jax.Array, KVCache]:
    """T new tokens per row at positions `cache.lengths + t` against a contiguous cache (speculative
    verification) with the numerics of decoding: position t is `decode_hidden`'s own one-token step
    against the cache holding positions `< lengths + t` (the step before wrote t - 1), so every
    position's logits are bit for bit those that decoding the same tokens one at a time gives, on any
    platform and with any cache dtype: the same kernels, shapes and reduction orders. (A T-token step
    computes the same values in other shapes, and in bfloat16 their roundings differ enough to flip a
    greedy choice.) The price: T passes over the weights instead of one. Returns logits `[B, T, V]`
    (float32), the residual stream entering the final norm `[B, T, D]` (the MTP module's input) and
    the cache with all T written and `lengths + T`; keep fewer by setting `lengths` back (rejected
    drafts are then never read, and later overwritten)."""

    def step(cache, token):
        logits, cache, _, hidden = decode_hidden(params, cache, token, cfg=cfg, mesh=mesh, rules=rules)
        return cache, (logits, hidden)

    cache, (logits, hidden) = jax.lax.scan(step, cache, tokens.T)
    return jnp.swapaxes(logits, 0, 1), jnp.swapaxes(hidden, 0, 1), cache


def default_block_pages(page_size: int, table_width: int, chunk: int = 1) -> int:
    """Pages per step of extend's page loop for `chunk` new tokens per row: about `DEFAULT_BLOCK_TOKENS`
    tokens, `CHUNK_BLOCK_TOKENS` for a prefill chunk (more than 8 tokens), at most the table. Larger
    blocks mean fewer loop steps but more masked work in a row's last, partial block, and that work
    grows with the chunk's queries, so a prefill chunk takes the smaller blocks."""
    tokens = CHUNK_BLOCK_TOKENS if chunk > 8 else DEFAULT_BLOCK_TOKENS
    return max(1, min(table_width, tokens // page_size))


def extend(params: Params, cache: PagedKVCache, tokens: jax.Array, starts: jax.Array, counts: jax.Array,
           page_table: jax.Array, logits_at: jax.Array, *, cfg: Config, mesh: Mesh, rules: ShardingRules,
           absorbed: bool | None = None, block_pages: int | None = None,
           hidden_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, PagedKVCache]:
    """`extend_routed` without the routing: the logits, hidden states and cache (see there)."""
    logits, hidden, cache, _ = extend_routed(params, cache, tokens, starts, counts, page_table, logits_at, cfg=cfg,
                                             mesh=mesh, rules=rules, absorbed=absorbed, block_pages=block_pages,
                                             hidden_at=hidden_at)
    return logits, hidden, cache


def _extend_form(cfg: Config, chunk: int, absorbed: bool | None, mesh: Mesh, rules: ShardingRules) -> bool:
    """Whether `extend` attends in the absorbed form: as asked, else the cheaper for `chunk` tokens
    (`use_absorbed`); always where a row's positions are split over devices, which meet all heads'
    queries as latents. Sparse attention (V3.2) always attends absorbed, over the selected latents, and
    reads a row's pages on the device holding them (a pool split over positions: ValueError)."""
    if cfg.sparse_attention:
        if pool_axes(mesh, rules)[1] is not None:
            raise ValueError(f"extend: a sparse-attention (V3.2) model reads each row's pages on one device; the "
                             f"page pool is split over each row's positions (rules.positions={rules.positions!r}): "
                             "use a mesh without that axis, or rules with positions=None")
        return True
    if pool_axes(mesh, rules)[1] is not None:
        return True
    return use_absorbed(cfg, chunk) if absorbed is None else absorbed


def _write_new_tokens(cache: PagedKVCache, latents: tuple[jax.Array, ...], page_table: jax.Array,
                      cached: jax.Array, counts: jax.Array, chunk: int, mesh: Mesh,
                      rules: ShardingRules) -> PagedKVCache:
    """The pool with each row's real new latents `(c_kv, k_pe[, index_k])` (`chunk` per row, padded)
    written at positions `cached[b] + t` (padding goes to `SCRATCH_PAGE`)."""
    c_new, pe_new, index_k = latent_parts(latents)
    with jax.named_scope("write_pages"):
        pages, slots = token_slots(page_table, cached, counts, chunk, cache.page_size)
        page_index = (cached[:, None] + jnp.arange(chunk)) // cache.page_size
        return write_rank_tokens(cache, c_new, pe_new, pages, slots, page_index, mesh, rules, index_k)


def _at(x: jax.Array, indices: jax.Array, counts: jax.Array) -> jax.Array:
    """`x [B, T, D]` at `indices [B, K]` into T, zero where an index is `>= counts[b]`."""
    picked = jnp.take_along_axis(x, jnp.clip(indices, 0, x.shape[1] - 1)[..., None], axis=1)
    return jnp.where((indices < counts[:, None])[..., None], picked, 0.0)


def _wanted_logits(params: Params, head_input: jax.Array, wanted: jax.Array, chunk: int, cfg: Config) -> jax.Array:
    """The logits of `head_input [B, K, D]` (zero rows give zero logits: rms_norm(0) = 0, no bias, so no
    second `[B, K, V]` select). A call wanting no logits at all (prompt chunks that sample nothing)
    skips the lm_head's weight read; a one-token call (decode: every row samples) has no branch,
    whose output XLA would copy."""
    if chunk == 1:
        return _logits(params, head_input, cfg)
    return jax.lax.cond(jnp.any(wanted), lambda h: _logits(params, h, cfg),
                        lambda h: jnp.zeros((*h.shape[:-1], cfg.vocab_size), jnp.float32), head_input)


def extend_routed(params: Params, cache: PagedKVCache, tokens: jax.Array, starts: jax.Array, counts: jax.Array,
                  page_table: jax.Array, logits_at: jax.Array, *, cfg: Config, mesh: Mesh, rules: ShardingRules,
                  absorbed: bool | None = None, block_pages: int | None = None, hidden_at: jax.Array | None = None,
                  ) -> tuple[jax.Array, jax.Array, PagedKVCache, jax.Array | None]:
    """Run T new tokens per row against that row's cached pages, and write their latents: the one
    serving primitive (chunked prefill, a prompt's remainder after a prefix hit, decode with T = 1,
    speculative verification with T = draft length + 1).

    Args:
      cache: the page pool; donated by `dsr1.programs.extend`.
      tokens: `[B, T]` int32; row b's new tokens, the first `counts[b]` real, the rest padding.
      starts: `[B]` how many tokens row b has cached, i.e. the position of its first new token.
      counts: `[B]` real new tokens per row, in `[0, T]`; 0 marks an idle slot (none of the pool
        is read or written for it, its outputs are zero).
      page_table: `[B, P]` row b's pages in order; entries past what the row uses are ignored (use
        `SCRATCH_PAGE`). Must cover `starts[b] + counts[b]` tokens. Under attention data parallelism
        (`rules.batch`) the pool's pages and the rows are split over the ranks, and with
        `rules.positions` a row's page j lives on device j mod T of that axis; a row's page ids are
        those of the device holding each page (`cache.pool_axes`).
      logits_at: `[B, K]` indices into T whose logits are wanted (e.g. `counts - 1` for the next
        token, or every draft position for verification).
      absorbed: the attention form (None: the cheaper for T, `use_absorbed`; sparse attention: absorbed).
      block_pages: pages per step of the page loop (None: `default_block_pages`).
      hidden_at: `[B, K']` indices into T whose hidden states are wanted (None: `logits_at`), e.g.
        every position of a prompt chunk for the MTP module while only the last needs logits.

    Returns:
      logits `[B, K, V]` float32 at `logits_at`; hidden `[B, K', D]` float32 at `hidden_at`, the
      residual stream *entering* the final norm (the MTP module's input; the lm_head input is
      `rms_norm(hidden, params["final_norm"])`); each zero where its index is `>= counts[b]`. And
      the cache with the real new tokens written at positions `starts[b] + t` (padding goes to
      `SCRATCH_PAGE`). And the logical expert ids each MoE layer routed the tokens to, `[L_moe, B, T,
      K]` (None without MoE layers; padding tokens' too), which `extend` drops (unused outputs cost
      nothing under jit): the routing statistics of redundant experts (`dsr1.core.eplb`).

    Each new token attends to its row's cached positions `< starts[b]` and causally to the new
    tokens. Every shape is static (B, T, P, K), so rows joining, growing and leaving compile nothing;
    the page loop's trip count is dynamic, set by the longest row in use.
    """
    chunk = tokens.shape[1]
    absorbed = _extend_form(cfg, chunk, absorbed, mesh, rules)
    block_pages = block_pages or default_block_pages(cache.page_size, page_table.shape[1], chunk)
    cached = jnp.where(counts > 0, starts, 0)  # idle slots read nothing and do not lengthen the page loop
    context = PagedContext(cache, page_table, cached, block_pages)
    positions = cached[:, None] + jnp.arange(chunk)
    x = keep_rows(_embed(params, tokens), mesh, rules)

    def attend(p, h, i):
        return attention_module(cfg).attend_extend(p, h, positions, context, i, cfg, absorbed=absorbed, mesh=mesh,
                                                   rules=rules)

    x, new_latents, routing = _run_layers(params, x, attend, cfg, mesh, rules)
    cache = _write_new_tokens(cache, new_latents, page_table, cached, counts, chunk, mesh, rules)
    head_input = _at(x, logits_at, counts)
    hidden = head_input if hidden_at is None else _at(x, hidden_at, counts)
    logits = _wanted_logits(params, head_input, logits_at < counts[:, None], chunk, cfg)
    if routing is not None:
        routing = routing.reshape(routing.shape[0], *tokens.shape, routing.shape[-1])
    return (keep_rows(logits, mesh, rules), keep_rows(hidden, mesh, rules), keep_pool_layout(cache, mesh, rules),
            routing)
