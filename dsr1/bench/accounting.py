"""What a decode step must read, in bytes: every weight it touches, the embedding rows of its
tokens, only the routed experts the batch hit in each MoE layer, and the cached latents up to each
row's length. Bytes / step time is the achieved bandwidth a benchmark reports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.cache import check_kv_cache_dtype
from ..core.config import Config
from ..core.params import Params
from ..core.quant import Int8Weight
from ..cpu import Bf16Bits

ROUTED = ("gate", "up", "down")  # the routed-expert stacks under params["moe_layers"]["moe"]


def _nbytes(tree: Any, rows: int | None = None) -> int:
    """Bytes of every array in a pytree (int8 values and their scales both count); with `rows`, the
    bytes a product of that many rows reads (a `Bf16Bits` head's float32 copy for one row, else its bits;
    an int8 weight's values and scales), not the CPU's transposed copies as well."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (Bf16Bits, Int8Weight)))
    return sum(int(x.bytes_read(rows) if rows and isinstance(x, (Bf16Bits, Int8Weight)) else x.nbytes)
               for x in leaves)


def expert_bytes(params: Params) -> int:
    """Bytes of ONE routed expert of one layer: its gate, up and down weights (with int8 scales)."""
    moe = params.get("moe_layers", {}).get("moe")
    if moe is None:
        return 0
    layers, experts = moe["gate"].shape[:2]
    # What a product reads (`rows`): one copy of each weight, not the CPU's transposed copy as well.
    return _nbytes([moe[k] for k in ROUTED], rows=1) // (layers * experts)


def fixed_weight_bytes(params: Params, rows: int) -> int:
    """Bytes every decode step of `rows` rows reads whatever the tokens: all weights except the
    embedding table (a step reads only its tokens' rows), the routed experts (only those hit) and
    the MTP module (decode never runs it)."""
    total = _nbytes({k: v for k, v in params.items() if k not in ("embed", "moe_layers", "mtp")}, rows)
    if "moe_layers" in params:
        stack = params["moe_layers"]
        total += _nbytes({k: v for k, v in stack.items() if k != "moe"}, rows)
        total += _nbytes({k: v for k, v in stack["moe"].items() if k not in ROUTED}, rows)
    return total


def cache_token_bytes(cfg: Config, dtype: Any, kv_cache_dtype: str | None) -> int:
    """Bytes of one cached position of one layer: the latent `c_kv` (int8 + a float32 scale with the
    int8 cache) and `k_pe` (always in the model's dtype)."""
    item = jnp.dtype(dtype).itemsize
    latent = cfg.kv_lora_rank + 4 if check_kv_cache_dtype(kv_cache_dtype) == "int8" else cfg.kv_lora_rank * item
    return latent + cfg.qk_rope_head_dim * item


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """What one decode step reads, split by kind (bytes)."""

    fixed_weights: int  # attention, dense MLP, shared experts, routers, norms, lm_head
    experts: int  # the distinct routed experts hit, summed over MoE layers
    embed: int  # the embedding rows of the step's (distinct) tokens
    cache: int  # cached latents up to each row's length, all layers
    distinct_experts: float  # mean distinct routed experts per MoE layer

    @property
    def total(self) -> int:
        return self.fixed_weights + self.experts + self.embed + self.cache


def step_bytes(params: Params, cfg: Config, kv_cache_dtype: str | None, lengths: np.ndarray, tokens: np.ndarray,
               expert_ids: np.ndarray | None) -> StepBytes:
    """Bytes one decode step reads, given its rows' cached `lengths [B]`, its input `tokens [B]` and
    the routed expert ids it chose, `[L_moe, B, K]` (None without MoE layers)."""
    embed = params["embed"]
    per_layer = [] if expert_ids is None else [len(np.unique(layer)) for layer in np.asarray(expert_ids)]
    cache = int(np.asarray(lengths, np.int64).sum()) * cfg.num_hidden_layers
    return StepBytes(
        fixed_weights=fixed_weight_bytes(params, len(np.asarray(tokens))),
        experts=sum(per_layer) * expert_bytes(params),
        embed=len(np.unique(np.asarray(tokens))) * embed.shape[1] * embed.dtype.itemsize,
        cache=cache * cache_token_bytes(cfg, embed.dtype, kv_cache_dtype),
        distinct_experts=float(np.mean(per_layer)) if per_layer else 0.0,
    )


def mean_step_bytes(params: Params, cfg: Config, kv_cache_dtype: str | None, context: int, tokens: np.ndarray,
                    expert_ids: np.ndarray | None) -> StepBytes:
    """`step_bytes` averaged over a run: `tokens [steps, B]` fed at each step, `expert_ids
    [steps, L_moe, B, K]`; at step i every row holds `context + i` cached positions."""
    steps, batch = tokens.shape
    per_step = [step_bytes(params, cfg, kv_cache_dtype, np.full(batch, context + i), tokens[i],
                           None if expert_ids is None else expert_ids[i]) for i in range(steps)]

    def mean(field: str) -> float:
        return sum(getattr(s, field) for s in per_step) / steps

    return StepBytes(*(round(mean(f)) for f in ("fixed_weights", "experts", "embed", "cache")),
                     distinct_experts=mean("distinct_experts"))
