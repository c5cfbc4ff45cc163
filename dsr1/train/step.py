"""The training step: next-token and MTP losses, the sequence-wise balance loss, AdamW, and the
auxiliary-loss-free router-bias update of DeepSeek-V3.

Master weights are float32; the forward runs on a copy of the matrices cast to `compute_dtype`
(bf16 matmuls). The router bias (`e_score_correction_bias`) is not trained by the optimizer: after
every step each MoE layer's bias moves by `gamma * sign(mean load - expert load)`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.config import Config
from ..core.model import forward_train
from ..core.mtp import mtp_forward_train
from ..core.params import draw_weight, float_specs, is_spec
from ..core.sharding import ShardingRules

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Optimization hyper-parameters (V3 report's values where they apply at this scale)."""

    lr: float = 3e-3
    warmup: int = 100
    steps: int = 5000  # the cosine schedule's length
    weight_decay: float = 0.1
    clip: float = 1.0
    balance_alpha: float = 1e-4  # sequence-wise balance loss weight
    bias_gamma: float = 1e-3  # router-bias update speed
    mtp_weight: float = 0.3  # MTP loss weight (depth 1)
    compute_dtype: str = "bfloat16"


class TrainState(NamedTuple):
    params: Params  # float32 master weights, the MTP module under "mtp"
    opt_state: Any
    step: jax.Array  # int32 scalar


def init_master(cfg: Config, seed: int) -> Params:
    """float32 random weights of the model and its MTP module, drawn as `dsr1.init_random` draws them."""
    key = jax.random.key(seed)
    return jax.tree_util.tree_map_with_path(lambda p, s: draw_weight(p, s, key, jnp.float32),
                                            float_specs(cfg, mtp=True), is_leaf=is_spec)


def _is_router_bias(path) -> bool:
    return getattr(path[-1], "key", None) == "router_bias"


def optimizer(cfg: Config, settings: TrainSettings) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay and global-norm clipping; weight decay on the matrices only;
    the router biases frozen (moved by `update_router_bias` instead)."""
    specs = float_specs(cfg, mtp=True)
    decay = jax.tree.map(lambda s: s.init == "normal", specs, is_leaf=is_spec)
    labels = jax.tree_util.tree_map_with_path(lambda p, s: "frozen" if _is_router_bias(p) else "train",
                                              specs, is_leaf=is_spec)
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.lr, max(1, settings.warmup),
                                                  max(settings.steps, settings.warmup + 1), settings.lr * 0.1)
    adamw = optax.chain(optax.clip_by_global_norm(settings.clip),
                        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay, mask=decay))
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def compute_params(params: Params, cfg: Config, dtype: Any) -> Params:
    """The weights the forward uses: matrices cast to `dtype`; norms, router and biases float32."""
    specs = float_specs(cfg, mtp="mtp" in params)
    return jax.tree.map(lambda s, w: w.astype(dtype) if s.init == "normal" and s.dtype is None else w,
                        specs, params, is_leaf=is_spec)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Negative log-likelihood (nats, float32) of `targets [...]` under `logits [..., V]`."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]


def mtp_outputs(params: Params, hidden: jax.Array, next_tokens: jax.Array, *, cfg: Config, mesh: Mesh,
               rules: ShardingRules):
    """The depth-1 MTP module's logits `[B, T, V]` for the token after `next_tokens` and its
    `RouterStats` (None for a dense block); `(None, None)` without an MTP module."""
    if "mtp" not in params:
        return None, None
    return mtp_forward_train(params, hidden, next_tokens, cfg=cfg, mesh=mesh, rules=rules)


def loss_fn(master: Params, batch: jax.Array, *, cfg: Config, mesh: Mesh, rules: ShardingRules,
            settings: TrainSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total loss of `batch [B, T + 2]` (next-token CE + balance + MTP), and its parts (and the loads)."""
    seq = batch.shape[1] - 2
    inputs, targets, after = batch[:, :seq], batch[:, 1:seq + 1], batch[:, 2:]
    params = compute_params(master, cfg, jnp.dtype(settings.compute_dtype))
    logits, hidden, stats = forward_train(params, inputs, cfg=cfg, mesh=mesh, rules=rules)
    ce = token_nll(logits, targets).mean()
    balance = stats.balance.sum() if stats is not None else jnp.zeros(())
    loss = ce + settings.balance_alpha * balance
    metrics = {"ce": ce, "balance": balance}
    if stats is not None:
        metrics["load"] = stats.load
    extra, mtp_stats = mtp_outputs(params, hidden, targets, cfg=cfg, mesh=mesh, rules=rules)
    if extra is not None:
        metrics["mtp_ce"] = token_nll(extra, after).mean()
        loss = loss + settings.mtp_weight * metrics["mtp_ce"]
    if mtp_stats is not None:  # the MTP block's experts are balanced as the model's
        metrics["mtp_load"], metrics["mtp_balance"] = mtp_stats.load, mtp_stats.balance
        loss = loss + settings.balance_alpha * mtp_stats.balance
    metrics["loss"] = loss
    return loss, metrics


def _nudged(bias: jax.Array, load: jax.Array, gamma: float) -> jax.Array:
    """`bias + gamma * sign(mean load - load)` over the last (expert) axis: busy experts down, idle up."""
    return bias + gamma * jnp.sign(load.mean(-1, keepdims=True) - load)


def update_router_bias(params: Params, load: jax.Array, gamma: float, mtp_load: jax.Array | None = None) -> Params:
    """Auxiliary-loss-free balancing: each MoE layer's bias (`load [L_moe, E]`) and, with `mtp_load [E]`,
    the drafting MTP module's (module 0) moves by `gamma * sign(mean load - load)`."""
    if "moe_layers" in params:
        moe = params["moe_layers"]["moe"]
        moe = {**moe, "router_bias": _nudged(moe["router_bias"], load, gamma)}
        params = {**params, "moe_layers": {**params["moe_layers"], "moe": moe}}
    if mtp_load is not None:
        block = params["mtp"]["block"]
        bias = block["moe"]["router_bias"]
        block = {**block, "moe": {**block["moe"], "router_bias": bias.at[0].set(_nudged(bias[0], mtp_load, gamma))}}
        params = {**params, "mtp": {**params["mtp"], "block": block}}
    return params


def replicate(tree: Any, mesh: Mesh) -> Any:
    """`tree`'s arrays placed whole on every device of `mesh` (as the train step returns them, so the
    first and later steps share one compiled program)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def init_state(cfg: Config, settings: TrainSettings, seed: int, mesh: Mesh) -> TrainState:
    """Fresh weights (from `seed`), optimizer state and step 0, replicated over `mesh`."""
    params = init_master(cfg, seed)
    return replicate(TrainState(params, optimizer(cfg, settings).init(params), jnp.zeros((), jnp.int32)), mesh)


@functools.cache
def make_train_step(cfg: Config, mesh: Mesh, rules: ShardingRules,
                    settings: TrainSettings) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """A jitted `(state, batch [B, T + 2]) -> (new state, metrics)`; the old state is donated.
    Cached: runs with the same settings in one process share the compiled step."""
    opt = optimizer(cfg, settings)

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(state.params, batch, cfg=cfg, mesh=mesh, rules=rules, settings=settings)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if "load" in metrics:
            params = update_router_bias(params, metrics["load"], settings.bias_gamma, metrics.get("mtp_load"))
        metrics["grad_norm"] = optax.tree.norm(grads)
        return TrainState(params, opt_state, state.step + 1), metrics

    return jax.jit(step, donate_argnums=0)


@functools.cache
def make_eval_step(cfg: Config, mesh: Mesh, rules: ShardingRules,
                   settings: TrainSettings) -> Callable[[Params, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """A jitted `(params, windows [B, T + 1], byte_lengths [V]) -> (NLL in bits of the text targets,
    their UTF-8 bytes)`: the numerator and denominator of bits per byte (special-token targets skipped)."""
    def evaluate(master: Params, windows: jax.Array, byte_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        params = compute_params(master, cfg, jnp.dtype(settings.compute_dtype))
        logits, _, _ = forward_train(params, windows[:, :-1], cfg=cfg, mesh=mesh, rules=rules)
        targets = windows[:, 1:]
        nbytes = byte_lengths[targets]
        bits = token_nll(logits, targets) / jnp.log(2.0)
        return jnp.where(nbytes > 0, bits, 0.0).sum(), nbytes.sum()

    return jax.jit(evaluate)
