"""The decode cache of multi-head latent attention: only the latent `c_kv` and the shared `k_pe`.

Per token per layer it holds `kv_lora_rank + qk_rope_head_dim` values (576 for R1), never
per-head keys and values. With `kv_cache_dtype="int8"` the latent `c_kv` (89% of the cache) is
stored as int8 with one float32 scale per token per layer; `k_pe`, which carries position, stays
in the model's dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = (None, "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """`c_kv [layers, batch, max_len, kv_lora_rank]`, `k_pe [layers, batch, max_len, rope_dim]`,
    `c_scale [layers, batch, max_len]` (int8 cache only, else None), and `lengths [batch]`: how many
    positions of each row are filled (the next token's position)."""

    c_kv: jax.Array
    k_pe: jax.Array
    c_scale: jax.Array | None
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.c_kv.shape[2]

    @property
    def batch_size(self) -> int:
        return self.c_kv.shape[1]

    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.c_kv, self.k_pe, self.c_scale) if x is not None)


def check_kv_cache_dtype(kv_cache_dtype: str | None) -> str | None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose one of {KV_CACHE_DTYPES}")
    return kv_cache_dtype


def quantize_latent(c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8 of `c [..., r]`: `(int8 [..., r], scale [...])`."""
    c = c.astype(jnp.float32)
    scale = jnp.max(jnp.abs(c), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(c / scale[..., None]), -127, 127).astype(jnp.int8), scale


def _stored(c_kv: jax.Array, kv_cache_dtype: str | None) -> tuple[jax.Array, jax.Array | None]:
    return quantize_latent(c_kv) if kv_cache_dtype == "int8" else (c_kv, None)


def cache_from_prefill(c_kv: jax.Array, k_pe: jax.Array, lengths: jax.Array, max_len: int,
                       kv_cache_dtype: str | None = None) -> KVCache:
    """A cache of `max_len` positions holding the prompts' latents `[layers, batch, T, ...]`."""
    pad = [(0, 0), (0, 0), (0, max_len - c_kv.shape[2])]
    c_kv, c_scale = _stored(c_kv, kv_cache_dtype)
    return KVCache(jnp.pad(c_kv, pad + [(0, 0)]), jnp.pad(k_pe, pad + [(0, 0)]),
                   None if c_scale is None else jnp.pad(c_scale, pad, constant_values=1.0),
                   lengths.astype(jnp.int32))


def append_token(cache: KVCache, c_kv: jax.Array, k_pe: jax.Array) -> KVCache:
    """Write one new position per row (`c_kv [layers, batch, r]`) at each row's own length."""
    rows = jnp.arange(cache.batch_size)
    c_kv, c_scale = _stored(c_kv, "int8" if cache.c_scale is not None else None)
    return KVCache(
        cache.c_kv.at[:, rows, cache.lengths].set(c_kv.astype(cache.c_kv.dtype)),
        cache.k_pe.at[:, rows, cache.lengths].set(k_pe.astype(cache.k_pe.dtype)),
        None if c_scale is None else cache.c_scale.at[:, rows, cache.lengths].set(c_scale),
        cache.lengths + 1,
    )
