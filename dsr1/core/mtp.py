"""DeepSeek-V3's multi-token-prediction (MTP) module, as pure functions of (params, inputs).

Module k (`params["mtp"]`, a stack of `cfg.num_nextn_predict_layers`; the release's layer
`num_hidden_layers + k`) predicts the token two positions ahead from the main model's residual
stream `h_i` (before the final norm) and the embedding of the next token `t_{i+1}`:

    h'_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])      (DeepSeek's reference code order)
    m_i  = block(h')                                        (MLA over the same positions, then MoE)
    logits for t_{i+2} = head(head_norm(m_i))

`m_i` plays the role of `h_i` for a further step, so applying the module again drafts further
ahead (speculative decoding with k > 1 drafts).

- `mtp_forward`: full sequences (tests, benchmarks); differentiable. `mtp_forward_train` adds the
  module's router statistics (training balances its experts as the model's).
- `mtp_step`: the same computation with any attention (`dsr1.generation.speculative` runs it
  against the MTP module's own latent cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .config import Config
from .layers import rms_norm
from .model import _block, _split_routed_experts, attention_module
from .params import Params
from .products import einsum, matmul, to_float32
from .sharding import ShardingRules, keep_rows


def mtp_module(params: Params, index: int = 0) -> tuple[dict, dict | None]:
    """Module `index` of the MTP stack: its weights without the routed experts (sliced), and the
    routed-expert stacks `[L, E, ...]` of all modules (read in place by index, not copied)."""
    if "mtp" not in params:
        raise ValueError("these params hold no MTP module: load with mtp=True (or init_random(..., mtp=True))")
    stack = params["mtp"]
    block, routed = _split_routed_experts(stack["block"])
    module = jax.tree.map(lambda a: a[index], {**stack, "block": block})
    return module, routed


def mtp_input(p: dict, hidden: jax.Array, next_tokens: jax.Array, cfg: Config) -> jax.Array:
    """`h' = eh_proj([enorm(embed(next_tokens)); hnorm(hidden)])` `[..., D]` float32."""
    with jax.named_scope("mtp_input"):
        e = rms_norm(to_float32(jax.tree.map(lambda a: a[next_tokens], p["embed"])), p["enorm"], cfg.rms_norm_eps)
        h = rms_norm(hidden, p["hnorm"], cfg.rms_norm_eps)
        x = jnp.concatenate([e, h.astype(e.dtype)], axis=-1)
        return matmul(x, p["eh_proj"]).astype(jnp.float32)


def mtp_logits(p: dict, x: jax.Array, cfg: Config) -> jax.Array:
    """The module's shared head: `head(head_norm(x))`, float32 logits `[..., V]`."""
    with jax.named_scope("mtp_head"):
        return einsum("...d,dv->...v", rms_norm(x, p["head_norm"], cfg.rms_norm_eps), p["head"],
                      preferred_element_type=jnp.float32)


def _mtp_block(params: Params, hidden: jax.Array, next_tokens: jax.Array, attend, *, cfg: Config, mesh: Mesh,
               rules: ShardingRules, index: int, train: bool, query_at: jax.Array | None = None):
    """Module `index`'s input projection and block: its output `[B, T, D]`, the new latents and the
    routed expert ids (`RouterStats` with `train`; None for a dense block). `query_at [B]`: the block
    runs row b's position `query_at[b]` only (output `[B, 1, D]`), and `attend(p, normed_x, query_at)`
    gets every position's normed input (their latents are still all written)."""
    p, routed = mtp_module(params, index)
    block = p["block"] if routed is None else {**p["block"], "moe": {**p["block"]["moe"], **routed}}
    with jax.named_scope("mtp"):
        x = keep_rows(mtp_input(p, hidden, next_tokens, cfg), mesh, rules)
        if query_at is not None:
            every, inner = x, attend
            x = jnp.take_along_axis(every, query_at[:, None, None], axis=1)

            def attend(bp: dict, _normed_queried: jax.Array):
                return inner(bp, rms_norm(every, bp["attn_norm"], cfg.rms_norm_eps), query_at)
        layer = None if routed is None else jnp.asarray(index, jnp.int32)
        x, (latents, routing) = _block(block, x, attend, cfg, mesh, rules, layer, train)
        return p, x, latents, routing


def mtp_step(params: Params, hidden: jax.Array, next_tokens: jax.Array, attend, *, cfg: Config, mesh: Mesh,
             rules: ShardingRules, index: int = 0, train: bool = False, query_at: jax.Array | None = None):
    """MTP module `index` on `hidden [B, T, D]` and `next_tokens [B, T]`, with `attend(block_params,
    normed_x) -> (out, (c_kv, k_pe))` as its attention. Returns `(logits [B, T, V] float32,
    mtp_hidden [B, T, D] float32, (c_kv, k_pe))`: the new latents for the module's own cache (with
    sparse attention `(c_kv, k_pe, index_k)`).
    `train`: differentiable experts (see `dsr1.core.moe.moe`). `query_at [B]`: outputs at row b's
    position `query_at[b]` only (`T` = 1 in them; every position's latents), with
    `attend(block_params, normed_x, query_at)` (see `attend_cached`)."""
    p, x, latents, _ = _mtp_block(params, hidden, next_tokens, attend, cfg=cfg, mesh=mesh, rules=rules, index=index,
                                  train=train, query_at=query_at)
    with jax.named_scope("mtp"):
        return keep_rows(mtp_logits(p, x, cfg), mesh, rules), x, latents


def mtp_forward_train(params: Params, hidden: jax.Array, next_tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                      rules: ShardingRules, index: int = 0):
    """`mtp_forward` over full (unpadded) training rows, for `dsr1.train`: the logits `[B, T, V]` and
    the module's `RouterStats` (its load and sequence-wise balance loss, as the model's MoE layers
    report theirs; None for a dense block)."""
    positions = jnp.broadcast_to(jnp.arange(hidden.shape[1]), next_tokens.shape)
    attend_prefill = attention_module(cfg).attend_prefill
    p, x, _, stats = _mtp_block(params, hidden, next_tokens, lambda p, h: attend_prefill(p, h, positions, cfg),
                                cfg=cfg, mesh=mesh, rules=rules, index=index, train=True)
    return keep_rows(mtp_logits(p, x, cfg), mesh, rules), stats


def mtp_forward(params: Params, hidden: jax.Array, next_tokens: jax.Array, lengths: jax.Array, *, cfg: Config,
                mesh: Mesh, rules: ShardingRules, index: int = 0) -> tuple[jax.Array, jax.Array]:
    """The MTP module over full right-padded sequences (causal attention over the same positions).

    Args:
      params: the model's params, holding `params["mtp"]`; used as given, like
        `model.forward_train`: differentiable for float32 or bf16 weights.
      hidden: `[B, T, D]` the main model's residual stream entering its final norm, every position
        (`model.forward_hidden` or `model.forward_train` return it).
      next_tokens: `[B, T]` int32, `next_tokens[b, t]` = the token at position t + 1.
      lengths: `[B]` valid positions per row; outputs at positions `>= lengths` are zero.
      index: which module of the stack (DeepSeek-V3 has one).

    Returns:
      `(logits [B, T, V] float32, mtp_hidden [B, T, D] float32)`: logits at position t predict the
      token at t + 2; `mtp_hidden` is the module's output before its head norm (the next module's,
      or the next recursive application's, `hidden`).
    """
    positions = jnp.broadcast_to(jnp.arange(hidden.shape[1]), next_tokens.shape)
    attend_prefill = attention_module(cfg).attend_prefill
    logits, x, _ = mtp_step(params, hidden, next_tokens, lambda p, h: attend_prefill(p, h, positions, cfg),
                            cfg=cfg, mesh=mesh, rules=rules, index=index, train=True)
    valid = (jnp.arange(hidden.shape[1])[None, :] < lengths[:, None])[..., None]
    return keep_rows(jnp.where(valid, logits, 0.0), mesh, rules), keep_rows(jnp.where(valid, x, 0.0), mesh, rules)
