"""DeepSeekMoE: group-limited sigmoid routing and dropless routed experts with `ragged_dot`.

Routing (DeepSeek-V3): `s = sigmoid(x W_gate)` in float32. Selection uses `s + bias` (the
correction bias): groups are scored by their two best biased scores, the best `topk_group` groups
are kept and the top `num_experts_per_tok` experts taken among them. The weights are the
*unbiased* `s` of the chosen experts, normalized when `norm_topk_prob`, times
`routed_scaling_factor`. Shared experts always run.

Experts run under `shard_map`: each device sorts the token-expert pairs routed to its local experts,
runs `ragged_dot` for gate/up and down on its slice of the expert ffw, and the partial outputs are
summed over the expert and tensor mesh axes. On CPU, decode-sized batches instead gather the few
hit experts (see `use_gather`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .config import Config
from .layers import mlp
from .quant import Int8Weight, ragged_dot
from .sharding import ShardingRules


def route(x: jax.Array, router: jax.Array, bias: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """`x [N, D]` -> `(weights [N, K] float32, expert ids [N, K] int32)`."""
    with jax.named_scope("router"):
        logits = jnp.matmul(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
        scores = jax.nn.sigmoid(logits)
        biased = scores + bias
        if cfg.topk_group < cfg.n_group:
            n, e = biased.shape
            grouped = biased.reshape(n, cfg.n_group, e // cfg.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            _, kept = jax.lax.top_k(group_scores, cfg.topk_group)
            group_mask = jax.nn.one_hot(kept, cfg.n_group, dtype=jnp.bool_).any(axis=1)
            expert_mask = jnp.repeat(group_mask, e // cfg.n_group, axis=1)
            biased = jnp.where(expert_mask, biased, -jnp.inf)
        _, experts = jax.lax.top_k(biased, cfg.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)


def _local_pairs(experts: jax.Array, n_local: int, rules: ShardingRules) -> tuple[jax.Array, jax.Array]:
    """Each token-expert pair's index among this device's experts, and whether it is local."""
    first = jax.lax.axis_index(rules.experts) * n_local if rules.experts else 0
    local = experts.reshape(-1) - first
    return local, (local >= 0) & (local < n_local)


def _gathered(w: Any, index: jax.Array) -> Any:
    return jax.tree.map(lambda a: a[index], w)


def _per_pair(x: jax.Array, w: Any) -> jax.Array:
    """`x [P, in]` times each pair's own `[P, in, out]` weight (float32 out)."""
    if isinstance(w, Int8Weight):
        return jnp.einsum("pi,pio->po", x, w.q.astype(x.dtype), preferred_element_type=jnp.float32) * w.scale
    return jnp.einsum("pi,pio->po", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _gather_experts(x, weights, experts, gate, up, down, rules: ShardingRules):
    """Few pairs: gather just the hit experts' weights, one copy per token-expert pair."""
    local, is_local = _local_pairs(experts, gate.shape[0], rules)
    index = jnp.clip(local, 0, gate.shape[0] - 1)
    token = jnp.arange(local.shape[0]) // experts.shape[1]
    xs = x[token]
    h = jax.nn.silu(_per_pair(xs, _gathered(gate, index))) * _per_pair(xs, _gathered(up, index))
    y = _per_pair(h.astype(x.dtype), _gathered(down, index))
    w = jnp.where(is_local, weights.reshape(-1), 0.0)
    return jnp.zeros((x.shape[0], y.shape[-1]), jnp.float32).at[token].add(y * w[:, None])


def _ragged_experts(x, weights, experts, gate, up, down, rules: ShardingRules):
    """Many pairs: sort them by expert and run grouped matmuls (`ragged_dot`)."""
    n_local = gate.shape[0]
    local, is_local = _local_pairs(experts, n_local, rules)
    local = jnp.where(is_local, local, n_local)  # other devices' pairs sort last and are dropped
    order = jnp.argsort(local)
    token, expert = order // experts.shape[1], local[order]
    group_sizes = jnp.bincount(local, length=n_local + 1)[:n_local].astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(ragged_dot(xs, gate, group_sizes, expert)) * ragged_dot(xs, up, group_sizes, expert)
    y = ragged_dot(h.astype(x.dtype), down, group_sizes, expert)
    w = jnp.where(is_local[order], weights.reshape(-1)[order], 0.0)
    return jnp.zeros((x.shape[0], y.shape[-1]), jnp.float32).at[token].add(y * w[:, None])


def use_gather(n_pairs: int, n_local: int) -> bool:
    """Whether to gather hit experts instead of `ragged_dot`. XLA:CPU lowers `ragged_dot` to a dense
    masked product over *every* local expert (experts x the FLOPs, all weights read), so on CPU a
    decode-sized batch is far faster gathering its few experts (one weight copy per pair: worth it
    while there are no more pairs than experts; measured on the bench preset, 1 token: 21 ms vs
    169 ms per layer). GPU and TPU have grouped-matmul kernels that skip empty groups, so they
    always use `ragged_dot`."""
    return jax.default_backend() == "cpu" and n_pairs <= n_local


def _local_experts(x, weights, experts, gate, up, down, *, rules: ShardingRules):
    """Per-device body: this device's experts (and ffw slice) applied to every token routed to them."""
    body = _gather_experts if use_gather(experts.size, gate.shape[0]) else _ragged_experts
    return jax.lax.psum(body(x, weights, experts, gate, up, down, rules), rules.moe_reduce_axes())


def _partition_spec(w: Any, axes: tuple[str, ...], rules: ShardingRules) -> Any:
    """The shard_map spec of an expert weight (and of its int8 scales, which drop the input axis)."""
    if not isinstance(w, Int8Weight):
        return rules.spec(axes)
    scale_axes = tuple(a for i, a in enumerate(axes) if i not in w.input_axes)
    return Int8Weight(rules.spec(axes), rules.spec(scale_axes), w.input_axes)


def routed_experts(p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array, mesh: Mesh,
                   rules: ShardingRules) -> jax.Array:
    """Dropless routed-expert output `[N, D]` (float32), experts split over the expert mesh axis."""
    with jax.named_scope("routed_experts"):
        w_in = _partition_spec(p["gate"], ("experts", "embed", "expert_ffw"), rules)
        w_out = _partition_spec(p["down"], ("experts", "expert_ffw", "embed"), rules)
        body = jax.shard_map(functools.partial(_local_experts, rules=rules), mesh=mesh,
                             in_specs=(P(), P(), P(), w_in, w_in, w_out), out_specs=P())
        return body(x, weights, experts, p["gate"], p["up"], p["down"])


def moe(p: dict, x: jax.Array, cfg: Config, mesh: Mesh, rules: ShardingRules) -> tuple[jax.Array, jax.Array]:
    """The DeepSeekMoE block on `x [..., D]`: routed plus shared experts, and the routed expert ids
    `[N, K]` (for accounting what a step reads; unused outputs cost nothing under jit)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, experts = route(x, p["router"], p["router_bias"], cfg)
    out = routed_experts(p, x, weights, experts, mesh, rules)
    if "shared" in p:
        with jax.named_scope("shared_experts"):
            out = out + mlp(p["shared"], x).astype(jnp.float32)
    return out.reshape(shape), experts
