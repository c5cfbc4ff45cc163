"""DeepSeek-V3 forward passes as pure functions of (params, inputs).

Layers are stacked (the dense ones, then the MoE ones) and run under `jax.lax.scan`, so compile
time does not grow with depth. The residual stream is float32; matmuls run in the weights' dtype.

- `forward`: logits for every position (prefill attention path).
- `prefill`: logits at each row's last token, and a KVCache holding the prompts' latents.
- `decode`: one token per row with absorbed attention against the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .attention import attend_decode, attend_prefill
from .cache import KVCache, append_token, cache_from_prefill
from .config import Config
from .layers import mlp, rms_norm
from .moe import moe
from .params import STACKS, Params, stack_layers
from .sharding import ShardingRules, keep_replicated

# Low-latency layout: activations are replicated (`keep_replicated`); only weights are split.


def _feed_forward(p: dict, x: jax.Array, cfg: Config, mesh: Mesh,
                  rules: ShardingRules) -> tuple[jax.Array, jax.Array | None]:
    """The layer's MLP or MoE output (float32), and the routed expert ids (None for a dense layer)."""
    if "moe" in p:
        with jax.named_scope("moe"):
            return moe(p["moe"], x, cfg, mesh, rules)
    with jax.named_scope("mlp"):
        return mlp(p["mlp"], x).astype(jnp.float32), None


def _block(p: dict, x: jax.Array, attend, cfg: Config, mesh: Mesh, rules: ShardingRules):
    """One pre-norm transformer layer; `attend(p, normed_x)` returns (out, new latents).
    Returns the new residual stream and (new latents, routed expert ids or None)."""
    h, new_kv = attend(p, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps))
    x = keep_replicated(x + h.astype(jnp.float32), mesh)
    ffn, experts = _feed_forward(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), cfg, mesh, rules)
    return keep_replicated(x + ffn, mesh), (new_kv, experts)


def _embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens].astype(jnp.float32)


def _logits(params: Params, x: jax.Array, cfg: Config) -> jax.Array:
    with jax.named_scope("lm_head"):
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        return jnp.matmul(x, params["lm_head"], preferred_element_type=jnp.float32)


def _prefill_hidden(params: Params, tokens: jax.Array, cfg: Config, mesh: Mesh, rules: ShardingRules):
    """Final hidden states `[B, T, D]` and every layer's latents `([L, B, T, r], [L, B, T, rope])`."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = keep_replicated(_embed(params, tokens), mesh)
    latents = []
    for stack in STACKS:
        if stack not in params:
            continue

        def layer(x, p):
            return _block(p, x, lambda p, h: attend_prefill(p, h, positions, cfg), cfg, mesh, rules)

        with jax.named_scope(stack):
            x, (kv, _) = jax.lax.scan(layer, x, params[stack])
        latents.append(kv)
    c_kv = jnp.concatenate([c for c, _ in latents])
    k_pe = jnp.concatenate([k for _, k in latents])
    return x, (c_kv, k_pe)


def forward(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
            rules: ShardingRules) -> jax.Array:
    """Logits `[B, T, V]` (float32) for right-padded `tokens [B, T]`; positions >= lengths are zero."""
    x, _ = _prefill_hidden(params, tokens, cfg, mesh, rules)
    logits = _logits(params, x, cfg)
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return keep_replicated(jnp.where(valid[..., None], logits, 0.0), mesh)


def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: Config, mesh: Mesh,
            rules: ShardingRules, max_len: int, kv_cache_dtype: str | None = None) -> tuple[jax.Array, KVCache]:
    """Logits `[B, V]` at each row's last prompt token, and a cache of `max_len` positions."""
    x, (c_kv, k_pe) = _prefill_hidden(params, tokens, cfg, mesh, rules)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = keep_replicated(_logits(params, last, cfg), mesh)
    cache = cache_from_prefill(c_kv, k_pe, lengths, max_len, kv_cache_dtype)
    return logits, jax.tree.map(lambda a: keep_replicated(a, mesh), cache)


def decode(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
           rules: ShardingRules) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Logits `[B, V]` for one new token per row at position `cache.lengths`, the grown cache, and
    the routed expert ids of every MoE layer `[L_moe, B, K]` (None without MoE layers): what the
    step read, for benchmarks and profiles (an unused output costs nothing under jit)."""
    positions = cache.lengths
    x = keep_replicated(_embed(params, tokens), mesh)
    new_latents, routing = [], None
    for stack in STACKS:
        if stack not in params:
            continue
        layers = stack_layers(cfg, stack)

        def layer(x, inputs):
            p, i = inputs
            # The cache is read in place by layer index (a loop invariant), never sliced into a copy.
            c_scale = None if cache.c_scale is None else cache.c_scale[i]

            def attend(p, h):
                return attend_decode(p, h, positions, cache.c_kv[i], c_scale, cache.k_pe[i], cache.lengths, cfg)

            return _block(p, x, attend, cfg, mesh, rules)

        with jax.named_scope(stack):
            x, (kv, experts) = jax.lax.scan(layer, x, (params[stack], jnp.arange(layers.start, layers.stop)))
        new_latents.append(kv)
        routing = experts if experts is not None else routing
    c_new = jnp.concatenate([c for c, _ in new_latents])
    pe_new = jnp.concatenate([k for _, k in new_latents])
    logits = keep_replicated(_logits(params, x, cfg), mesh)
    return logits, jax.tree.map(lambda a: keep_replicated(a, mesh), append_token(cache, c_new, pe_new)), routing

