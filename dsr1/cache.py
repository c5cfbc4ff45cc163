"""The decode cache of multi-head latent attention: only the latent `c_kv` and the shared `k_pe`.

Per token per layer it holds `kv_lora_rank + qk_rope_head_dim` values (576 for R1), never
per-head keys and values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """`c_kv [layers, batch, max_len, kv_lora_rank]`, `k_pe [layers, batch, max_len, rope_dim]`, and
    `lengths [batch]`: how many positions of each row are filled (the next token's position)."""

    c_kv: jax.Array
    k_pe: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.c_kv.shape[2]

    @property
    def batch_size(self) -> int:
        return self.c_kv.shape[1]

    def nbytes(self) -> int:
        return self.c_kv.nbytes + self.k_pe.nbytes


def cache_from_prefill(c_kv: jax.Array, k_pe: jax.Array, lengths: jax.Array, max_len: int) -> KVCache:
    """A cache of `max_len` positions holding the prompt's latents `[layers, batch, T, ...]`."""
    pad = ((0, 0), (0, 0), (0, max_len - c_kv.shape[2]), (0, 0))
    return KVCache(jnp.pad(c_kv, pad), jnp.pad(k_pe, pad), lengths.astype(jnp.int32))


def append_token(cache: KVCache, c_kv: jax.Array, k_pe: jax.Array) -> KVCache:
    """Write one new position per row (`c_kv [layers, batch, r]`) at each row's own length."""
    rows = jnp.arange(cache.batch_size)
    return KVCache(
        cache.c_kv.at[:, rows, cache.lengths].set(c_kv.astype(cache.c_kv.dtype)),
        cache.k_pe.at[:, rows, cache.lengths].set(k_pe.astype(cache.k_pe.dtype)),
        cache.lengths + 1,
    )
