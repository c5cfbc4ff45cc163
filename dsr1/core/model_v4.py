"""DeepSeek-V4's forward passes as pure functions of (params, cache, tokens).

The residual is `hc_mult` streams (`dsr1.core.hyper_connections`); each layer's attention is one of
`dsr1.core.compressed_attention`'s three kinds and its MoE routes by token id (the first
`num_hash_layers`) or by `sqrtsoftplus` scores (`dsr1.core.moe`). Layers run in release order, each
read from its stack (`params.v4_stacks`: the kinds hold different weights).

One pass serves all: `extend` feeds T new tokens per row after the cache's `lengths`, writing the
window rings, compressed entries and compressor states. `forward` is `extend` on an empty cache,
`prefill` keeps that cache, `decode` is T = 1; a prompt fed in chunks of any size gives the logits
a whole-prompt prefill gives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import compressed_attention, hyper_connections
from .config import Config
from .layers import rms_norm
from .moe import moe
from .params import Params, attention_kind, v4_stacks
from .products import einsum, matmul, to_float32
from .sharding import ShardingRules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4Cache:
    """`lengths [B]`: the positions each row holds; `layers`: per stack of `params.v4_stacks`, the
    `compressed_attention.LayerCache` arrays of its layers stacked `[L_stack, B, ...]`."""

    lengths: jax.Array
    layers: dict[str, dict[str, jax.Array]]


def init_cache(cfg: Config, batch: int, max_len: int, dtype=jnp.float32) -> V4Cache:
    """An empty cache for `batch` rows of up to `max_len` positions."""
    layers = {}
    for name, members in v4_stacks(cfg).items():
        one = compressed_attention.empty_layer_cache(cfg, attention_kind(cfg, members[0]), batch, max_len, dtype)
        layers[name] = jax.tree.map(lambda a, n=len(members): jnp.broadcast_to(a, (n, *a.shape)), one)
    return V4Cache(jnp.zeros((batch,), jnp.int32), layers)


def _layer(p: dict, streams: jax.Array, tokens: jax.Array, start: jax.Array, counts: jax.Array, cache: dict,
           kind: str, cfg: Config, mesh: Mesh, rules: ShardingRules) -> tuple[jax.Array, dict]:
    """One V4 layer on the streams `[B, T, hc, D]`: attention, then MoE, each between mHC mixings."""
    eps = cfg.rms_norm_eps
    x, post, comb = hyper_connections.pre(p["hc_attn"], streams, cfg)
    with jax.named_scope(f"{kind}_attention"):
        h, cache = compressed_attention.attend(p, rms_norm(x, p["attn_norm"], eps), start, counts, cache, kind, cfg)
    streams = hyper_connections.post(h, streams, post, comb)
    x, post, comb = hyper_connections.pre(p["hc_ffn"], streams, cfg)
    with jax.named_scope("moe"):
        ffn, _ = moe(p["moe"], rms_norm(x, p["mlp_norm"], eps), cfg, mesh, rules, tokens=tokens)
    return hyper_connections.post(ffn, streams, post, comb), cache


def extend_streams(params: Params, cache: V4Cache, tokens: jax.Array, counts: jax.Array, *, cfg: Config, mesh: Mesh,
                   rules: ShardingRules) -> tuple[jax.Array, V4Cache]:
    """The residual streams after the last layer `[B, T, hc, D]` (float32; the MTP module's input)
    for `tokens [B, T]` after `cache.lengths`, of which each row's first `counts [B]` are real, and
    the cache holding them (`lengths + counts`)."""
    start = cache.lengths
    streams = hyper_connections.expand(to_float32(params["embed"][tokens]), cfg)
    layers = dict(cache.layers)
    slots = {name: 0 for name in layers}
    for layer in range(cfg.num_hidden_layers):
        name = next(n for n, members in v4_stacks(cfg).items() if layer in members)
        i = slots[name]
        slots[name] += 1
        p = jax.tree.map(lambda a, i=i: a[i], params[name])
        held = {k: v[i] for k, v in layers[name].items()}
        streams, held = _layer(p, streams, tokens, start, counts, held, attention_kind(cfg, layer), cfg, mesh, rules)
        layers[name] = {k: v.at[i].set(held[k]) for k, v in layers[name].items()}
    return streams, dataclasses.replace(cache, lengths=start + counts, layers=layers)


def extend_hidden(params: Params, cache: V4Cache, tokens: jax.Array, counts: jax.Array, *, cfg: Config, mesh: Mesh,
                  rules: ShardingRules) -> tuple[jax.Array, V4Cache]:
    """`extend_streams` collapsed by `hc_head`: the residual entering the final norm `[B, T, D]`."""
    streams, cache = extend_streams(params, cache, tokens, counts, cfg=cfg, mesh=mesh, rules=rules)
    return hyper_connections.head(params["hc_head"], streams, cfg), cache


def logits_of(params: Params, hidden: jax.Array, cfg: Config) -> jax.Array:
    """The final norm and the output head (float32 logits)."""
    x = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    return einsum("...d,dv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


def extend(params: Params, cache: V4Cache, tokens: jax.Array, counts: jax.Array, *, cfg: Config, mesh: Mesh,
           rules: ShardingRules) -> tuple[jax.Array, V4Cache]:
    """Logits `[B, T, V]` of `tokens [B, T]` fed after `cache.lengths` (`counts [B]` real per row)
    and the grown cache: chunked prefill (any T), decode (T = 1)."""
    hidden, cache = extend_hidden(params, cache, tokens, counts, cfg=cfg, mesh=mesh, rules=rules)
    return logits_of(params, hidden, cfg), cache


def forward(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
            rules: ShardingRules) -> jax.Array:
    """Logits `[B, T, V]` (float32) for right-padded `tokens [B, T]`; positions >= lengths are zero."""
    b, t = tokens.shape
    logits, _ = extend(params, init_cache(cfg, b, t), tokens, lengths, cfg=cfg, mesh=mesh, rules=rules)
    return jnp.where((jnp.arange(t) < lengths[:, None])[..., None], logits, 0.0)


def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh, rules: ShardingRules,
            max_len: int) -> tuple[jax.Array, V4Cache]:
    """Logits `[B, V]` at each row's last prompt token, and a cache of `max_len` positions."""
    logits, cache = extend(params, init_cache(cfg, tokens.shape[0], max_len), tokens, lengths, cfg=cfg, mesh=mesh,
                           rules=rules)
    return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], cache


def decode(params: Params, cache: V4Cache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
           rules: ShardingRules) -> tuple[jax.Array, V4Cache]:
    """Logits `[B, V]` of one new token per row at position `cache.lengths`, and the grown cache."""
    ones = jnp.ones(tokens.shape[:1], jnp.int32)
    logits, cache = extend(params, cache, tokens[:, None], ones, cfg=cfg, mesh=mesh, rules=rules)
    return logits[:, 0], cache


# ---- the MTP module ---------------------------------------------------------------------------------

def init_mtp_cache(cfg: Config, batch: int, max_len: int, dtype=jnp.float32) -> V4Cache:
    """An empty cache for the first MTP module's layer (`layers["mtp"]`, one layer)."""
    one = compressed_attention.empty_layer_cache(cfg, attention_kind(cfg, cfg.num_hidden_layers), batch, max_len,
                                                 dtype)
    return V4Cache(jnp.zeros((batch,), jnp.int32), {"mtp": jax.tree.map(lambda a: a[None], one)})


def mtp_extend(params: Params, cache: V4Cache, streams: jax.Array, tokens: jax.Array, counts: jax.Array, *,
               cfg: Config, mesh: Mesh, rules: ShardingRules) -> tuple[jax.Array, V4Cache]:
    """The first MTP module's logits `[B, T, V]`: at each of T positions after `cache.lengths`, the
    model's streams there `[B, T, hc, D]` (`extend_streams`) with the next token `tokens [B, T]`,
    `e_proj(enorm(embed)) + h_proj(hnorm(streams))` through its layer (`counts [B]` real per row),
    its `hc_head`, its norm and the model's head; and its grown cache (`init_mtp_cache`)."""
    p = jax.tree.map(lambda a: a[0], params["mtp"])
    eps = cfg.rms_norm_eps
    e = rms_norm(to_float32(params["embed"][tokens]), p["enorm"], eps)
    x = matmul(e, p["e_proj"]).astype(jnp.float32)[..., None, :] + matmul(rms_norm(streams, p["hnorm"], eps),
                                                                          p["h_proj"]).astype(jnp.float32)
    held = {k: v[0] for k, v in cache.layers["mtp"].items()}
    kind = attention_kind(cfg, cfg.num_hidden_layers)
    x, held = _layer(p, x, tokens, cache.lengths, counts, held, kind, cfg, mesh, rules)
    hidden = rms_norm(hyper_connections.head(p["hc_head"], x, cfg), p["head_norm"], eps)
    logits = einsum("...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    layers = {"mtp": {k: v[None] for k, v in held.items()}}
    return logits, dataclasses.replace(cache, lengths=cache.lengths + counts, layers=layers)
