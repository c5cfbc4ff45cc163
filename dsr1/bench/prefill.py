"""Timing prefill: milliseconds, tokens/s and FLOP/s against the matmul peak measured in the same run
(model FLOPs utilization). The peak is of the dtype a prefill computes in: the weights' dtype (bf16)
on GPU and TPU, and on CPU for bf16 weights too (products of many rows run as bf16 dots,
`dsr1.cpu.products.native_bf16`); float32 on CPU for int8 weights, which are widened where they are used."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import cpu
from ..api import Model
from ..core.config import Config
from .timing import best_of

PREFILL_COLUMNS = ("batch", "tokens", "ms", "tok_s", "gflop", "gflop_s", "pct_of_peak")


def prefill_flops(cfg: Config, batch: int, prompt_len: int) -> float:
    """The matmul FLOPs a prefill of `batch` x `prompt_len` tokens needs (2 per multiply-add): every
    projection per token, the routed experts it is routed to (not all of them), causal attention
    scores and values, and `lm_head` at each row's last token."""
    d, h, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    q = d * h * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * (d + h * cfg.qk_head_dim)
    attention = q + d * (r + cfg.qk_rope_head_dim) + r * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
        + h * cfg.v_head_dim * d + (prompt_len + 1) / 2 * h * (cfg.qk_head_dim + cfg.v_head_dim)
    moe = d * cfg.n_routed_experts + 3 * d * (cfg.shared_intermediate_size
                                              + cfg.num_experts_per_tok * cfg.moe_intermediate_size)
    per_token = cfg.num_hidden_layers * attention + cfg.num_dense_layers * 3 * d * cfg.intermediate_size \
        + cfg.num_moe_layers * moe
    return 2 * (batch * prompt_len * per_token + batch * d * cfg.vocab_size)


def compute_dtype(model: Model) -> jnp.dtype:
    """The dtype most of a prefill's matmul FLOPs run in on this device: the weights' dtype, but float32
    for int8 weights on CPU (widened where they are used). On CPU bf16 weights are widened only in
    products of few rows (decode), which a prefill's projections and expert blocks are not."""
    return jnp.dtype(jnp.float32) if cpu.enabled(model.mesh) and model.quant else model.dtype


def matmul_peak_flops(dtype: Any = jnp.float32, size: int | None = None, repeats: int = 5) -> float:
    """This device's measured matmul rate in `dtype` (FLOP/s): the best of `repeats` jitted
    `[size, size] @ [size, size]` products (float32 at HIGHEST precision; a narrower dtype with
    float32 accumulation), the reference for a prefill's FLOP/s. `size` defaults to 2048 on CPU and
    8192 on an accelerator, where a smaller product does not fill the device."""
    size = size or (2048 if jax.default_backend() == "cpu" else 8192)
    dtype = jnp.dtype(dtype)
    a = jnp.ones((size, size), dtype)
    if dtype == jnp.float32:
        dot = jax.jit(lambda a: jnp.dot(a, a, precision=jax.lax.Precision.HIGHEST))
    else:
        dot = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
    return 2 * size ** 3 / best_of(lambda: dot(a), repeats)[0]


def time_prefill(model: Model, batch: int, tokens: int, repeats: int = 2, seed: int = 0) -> float:
    """Seconds of the fastest of `repeats` prefills of `batch` random prompts of `tokens` tokens (a
    cache of exactly `tokens` positions), after a compiling warm-up."""
    if tokens > model.cfg.max_position_embeddings:
        raise ValueError(f"{tokens} tokens exceed max_position_embeddings={model.cfg.max_position_embeddings}")
    prompts = np.random.default_rng(seed).integers(2, model.cfg.vocab_size, (batch, tokens)).astype(np.int32)
    return best_of(lambda: model.prefill(prompts, max_len=tokens), repeats)[0]


def prefill_row(cfg: Config, batch: int, tokens: int, seconds: float, peak_flop_s: float) -> dict[str, Any]:
    """One line of the prefill table: time, tokens/s, the FLOPs `prefill_flops` counts and their rate
    against `peak_flop_s`."""
    flop = prefill_flops(cfg, batch, tokens)
    return {"batch": batch, "tokens": tokens, "ms": 1e3 * seconds, "tok_s": batch * tokens / seconds,
            "gflop": flop / 1e9, "gflop_s": flop / seconds / 1e9, "pct_of_peak": 100 * flop / seconds / peak_flop_s}
