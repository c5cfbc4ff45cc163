"""Timing decode: `steps` greedy steps inside one jitted program (`dsr1.programs.greedy_decode`,
the cache donated) on a cache built directly at the asked context length, no prefill; and the
best-of-N timing the other benchmarks share."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import programs
from ..api import Model
from ..core.cache import KVCache
from ..core.sharding import put_replicated, to_host
from .accounting import StepBytes, mean_step_bytes

DECODE_COLUMNS = ("batch", "context", "tok_s_per_seq", "tok_s", "mb_per_step", "achieved_gbs", "pct_of_copy_bw",
                  "pct_of_read_bw")


def best_of(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Seconds of the fastest of `repeats` calls of `run` (each waited for), after an untimed warm-up
    call (compilation), and the last call's result."""
    out = jax.block_until_ready(run())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return best, out


def random_cache(model: Model, batch: int, context: int, max_len: int, seed: int = 0) -> KVCache:
    """A cache as if `batch` prompts of `context` tokens had been prefilled (random latents of the
    model's cache dtype), with room for `max_len` positions, laid out on the model's mesh by its rules."""
    return programs.random_cache(jax.random.key(seed), cfg=model.cfg, mesh=model.mesh, batch=batch, context=context,
                                 max_len=max_len, dtype=model.dtype, kv_cache_dtype=model.kv_cache_dtype,
                                 rules=model.rules)


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """One timed decode loop: wall time, and what was fed and routed at each step (host arrays)."""

    seconds: float
    tokens: np.ndarray  # [steps, B] tokens fed
    expert_ids: np.ndarray | None  # [steps, L_moe, B, K]
    last: np.ndarray  # [B] the argmax after the last step


def time_decode(model: Model, make_cache: Callable[[int], KVCache], tokens: np.ndarray, steps: int,
                repeats: int = 1) -> DecodeRun:
    """Compile and warm up the decode loop, then time it `repeats` times on fresh caches
    (`make_cache(i)`: the loop consumes its cache) and keep the fastest run."""
    first = put_replicated(np.asarray(tokens, np.int32), model.mesh)

    def run(cache: KVCache) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
        return programs.greedy_decode(model.params, cache, first, **model.program_kwargs, steps=steps)

    jax.block_until_ready(run(make_cache(0)))  # compile + warm-up
    best = None
    for i in range(repeats):
        cache = jax.block_until_ready(make_cache(i + 1))
        start = time.perf_counter()
        out = jax.block_until_ready(run(cache))
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, out[1:])  # drop the grown cache: only what was fed and routed is kept
        del cache, out
    seconds, (fed, ids, last) = best
    return DecodeRun(seconds, to_host(fed), to_host(ids) if model.cfg.num_moe_layers else None, to_host(last))


def decode_row(batch: int, context: int, steps: int, seconds: float, nbytes: StepBytes,
               copy_gbs: float, read_gbs: float) -> dict[str, Any]:
    """One line of the decode table. `achieved_gbs` = bytes per step / step time, also as a share of
    the measured copy and read bandwidths."""
    step_s = seconds / steps
    achieved = nbytes.total / step_s / 1e9
    return {
        "batch": batch, "context": context, "tok_s_per_seq": 1 / step_s, "tok_s": batch / step_s,
        "mb_per_step": nbytes.total / 1e6, "achieved_gbs": achieved, "pct_of_copy_bw": 100 * achieved / copy_gbs,
        "pct_of_read_bw": 100 * achieved / read_gbs,
        "step_ms": 1e3 * step_s, "bytes_per_step": nbytes.total, "distinct_experts_per_layer": nbytes.distinct_experts,
        "bytes": {"fixed_weights": nbytes.fixed_weights, "experts": nbytes.experts, "embed": nbytes.embed,
                  "cache": nbytes.cache},
    }


def bench_decode_point(model: Model, batch: int, context: int, steps: int, copy_gbs: float, read_gbs: float,
                       seed: int = 0, repeats: int = 1) -> dict[str, Any]:
    """Time `steps` decode steps at one (batch, context) and account their bytes."""
    cfg = model.cfg
    max_len = context + steps + 1
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"context {context} + {steps} steps exceeds "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    tokens = np.random.default_rng(seed).integers(2, cfg.vocab_size, batch)
    run = time_decode(model, lambda i: random_cache(model, batch, context, max_len, seed=seed + i), tokens, steps,
                      repeats)
    nbytes = mean_step_bytes(model.params, cfg, model.kv_cache_dtype, context, run.tokens, run.expert_ids)
    return decode_row(batch, context, steps, run.seconds, nbytes, copy_gbs, read_gbs)
