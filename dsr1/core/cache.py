"""The caches of multi-head latent attention: only the latent `c_kv` and the shared `k_pe`.

Per token per layer they hold `kv_lora_rank + qk_rope_head_dim` values (576 for R1), never
per-head keys and values. With `kv_cache_dtype="int8"` the latent `c_kv` (89% of the cache) is
stored as int8 with one float32 scale per token per layer; `k_pe`, which carries position, stays
in the model's dtype.

- `KVCache`: contiguous, one row of `max_len` positions per batch row (`prefill`, `decode`). For
  V3.2 (sparse attention) it also holds each token's indexer key, `index_head_dim` values per layer
  in the model's dtype (not the release's FP8 form), which every decode step scans to choose the
  positions whose latents it reads.
- `PagedKVCache`: a pool of fixed-size pages shared by all sequences, each sequence reading and
  writing its own pages through a page table (`extend`, serving). Rows grow a page at a time and
  sequences with a common prefix can share its pages. `gather_pages` and `scatter_pages` move
  whole pages out of and back into the pool (the prefix cache's host offload). For V3.2 each page
  also holds its tokens' indexer keys (`index_k`, beside the latents, as the contiguous cache keeps
  them), so prefix sharing and offload carry them with the latents; `PagedRows` reads a pool through
  the rows' page tables as sparse attention reads a contiguous cache.

On CPU a bf16 cache stores its latents as their bits (uint16, `stores_bits`): read them through
`latent_values`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import paged_gather
from .sharding import ShardingRules, keep_rows

KV_CACHE_DTYPES = (None, "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """`c_kv [layers, batch, max_len, kv_lora_rank]`, `k_pe [layers, batch, max_len, rope_dim]`,
    `c_scale [layers, batch, max_len]` (int8 cache only, else None), and `lengths [batch]`: how many
    positions of each row are filled (the next token's position). `index_k [layers, batch, max_len,
    index_head_dim]`: the sparse-attention indexer's keys (V3.2; None for dense MLA), stored as
    `k_pe` is."""

    c_kv: jax.Array
    k_pe: jax.Array
    c_scale: jax.Array | None
    lengths: jax.Array
    index_k: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.c_kv.shape[2]

    @property
    def batch_size(self) -> int:
        return self.c_kv.shape[1]

    def nbytes(self) -> int:
        return _latent_bytes(self)

    def read_block(self, layer: jax.Array, start: jax.Array, n: int) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """One layer's latents at positions `[start, start + n)` of every row, as stored: `c_kv [B, n, r]`,
        `c_scale [B, n]` or None, `k_pe [B, n, rope]`. One slice of the whole cache (the layer index is
        part of it): slicing the layer first made XLA copy the layer's whole cache every step."""
        def block(a: jax.Array) -> jax.Array:
            at = (layer, 0, start) + (0,) * (a.ndim - 3)
            return jax.lax.dynamic_slice(a, at, (1, a.shape[1], n, *a.shape[3:]))[0]

        return block(self.c_kv), None if self.c_scale is None else block(self.c_scale), block(self.k_pe)

    def read_index_keys(self, layer: jax.Array) -> jax.Array:
        """One layer's indexer keys at every position of every row `[B, max_len, index_head_dim]`, as
        stored (one slice of the whole cache, as `read_block`)."""
        return jax.lax.dynamic_index_in_dim(self.index_k, layer, axis=0, keepdims=False)

    def gather_positions(self, layer: jax.Array, positions: jax.Array
                         ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """One layer's latents at `positions [B, ...]` of each row, as stored: `c_kv [B, ..., r]`, `c_scale
        [B, ...]` or None, `k_pe [B, ..., rope]`. One gather from the whole cache: only those positions
        are read."""
        rows = jnp.arange(self.batch_size).reshape(-1, *(1,) * (positions.ndim - 1))

        def gather(a: jax.Array) -> jax.Array:
            return a[layer, rows, positions]

        return gather(self.c_kv), None if self.c_scale is None else gather(self.c_scale), gather(self.k_pe)


def latent_parts(latents: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """A layer's (or every layer's) new latents as `(c_kv, k_pe, index_k)`: attention returns `(c_kv,
    k_pe)`, sparse attention `(c_kv, k_pe, index_k)` (its indexer keys; None here for dense MLA)."""
    c_kv, k_pe, *index_k = latents
    return c_kv, k_pe, index_k[0] if index_k else None


def keep_cache_rows(cache: KVCache, mesh: Mesh, rules: ShardingRules) -> KVCache:
    """Inside jit: the decode cache laid out as its rows are (`keep_rows`): under attention data
    parallelism each rank holds only its rows' latents, else every device holds them all."""
    def rows(a: jax.Array | None, axis: int = 1) -> jax.Array | None:
        return None if a is None else keep_rows(a, mesh, rules, axis)

    return KVCache(rows(cache.c_kv), rows(cache.k_pe), rows(cache.c_scale), rows(cache.lengths, 0),
                   rows(cache.index_k))


def _latent_bytes(cache: KVCache | PagedKVCache) -> int:
    """Bytes of a cache's latents, int8 scales (and a contiguous cache's indexer keys) included."""
    index_k = getattr(cache, "index_k", None)
    return sum(x.nbytes for x in (cache.c_kv, cache.k_pe, cache.c_scale, index_k) if x is not None)


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


def stores_bits(dtype: jnp.dtype, platform: str | None = None) -> bool:
    """Whether a cache on `platform`'s devices (by default JAX's default backend) keeps latents of
    `dtype` as their bits (uint16): bf16 on CPU. XLA:CPU computes every bf16 slice, gather and scatter
    in float32 and hoists the widening of the whole cache (or page pool) out of the layer loop, so
    every step would read and write all of it twice."""
    return jnp.dtype(dtype) == jnp.bfloat16 and (platform or jax.default_backend()) == "cpu"


def to_stored(x: jax.Array, platform: str | None = None) -> jax.Array:
    """Latents as a cache on `platform`'s devices stores them (`stores_bits`)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if stores_bits(x.dtype, platform) else x


def latent_values(stored: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Stored latents (a block read from a cache) as `dtype` values; bits are bf16 (`stores_bits`)."""
    if stored.dtype == jnp.uint16:
        stored = jax.lax.bitcast_convert_type(stored, jnp.bfloat16)
    return stored.astype(dtype)


def _put(array: jax.Array, index: tuple, values: jax.Array, **kwargs) -> jax.Array:
    """`array.at[index].set(values, **kwargs)` for a cache's stored array: values, or stored latents."""
    if array.dtype == jnp.uint16 and values.dtype != jnp.uint16:  # values for a bits cache
        values = jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return array.at[index].set(values.astype(array.dtype), **kwargs)


def cache_from_prefill(c_kv: jax.Array, k_pe: jax.Array, lengths: jax.Array, max_len: int,
                       kv_cache_dtype: str | None = None, platform: str | None = None,
                       index_k: jax.Array | None = None) -> KVCache:
    """A cache of `max_len` positions holding the prompts' latents `[layers, batch, T, ...]` (and, for
    sparse attention, their indexer keys `index_k`), for `platform`'s devices (`stores_bits`)."""
    pad = [(0, 0), (0, 0), (0, max_len - c_kv.shape[2]), (0, 0)]
    c_kv, c_scale = _stored(c_kv, kv_cache_dtype)

    def padded(a: jax.Array | None) -> jax.Array | None:
        return None if a is None else jnp.pad(to_stored(a, platform), pad)

    scale = None if c_scale is None else jnp.pad(c_scale, pad[:3], constant_values=1.0)
    return KVCache(padded(c_kv), padded(k_pe), scale, lengths.astype(jnp.int32), padded(index_k))


def append_token(cache: KVCache, c_kv: jax.Array, k_pe: jax.Array, index_k: jax.Array | None = None) -> KVCache:
    """Write one new position per row (`c_kv [layers, batch, r]`) at each row's own length."""
    return append_tokens(cache, c_kv[:, :, None], k_pe[:, :, None], None if index_k is None else index_k[:, :, None])


def append_tokens(cache: KVCache, c_kv: jax.Array, k_pe: jax.Array, index_k: jax.Array | None = None) -> KVCache:
    """Write T new positions per row (`c_kv [layers, batch, T, r]`, and a sparse-attention cache's
    indexer keys `index_k`) at `lengths[b] + t`; lengths grow by T. Positions past `max_len` are
    dropped. Rolling back (speculative decoding) is setting `lengths` lower: positions at or past a
    row's length are never read."""
    if (index_k is None) != (cache.index_k is None):
        raise ValueError("a sparse-attention cache takes the new tokens' indexer keys, a dense one none")
    t = c_kv.shape[2]
    at = (slice(None), jnp.arange(cache.batch_size)[:, None], cache.lengths[:, None] + jnp.arange(t))
    c_kv, c_scale = _stored(c_kv, "int8" if cache.c_scale is not None else None)
    return KVCache(
        _put(cache.c_kv, at, c_kv, mode="drop"),
        _put(cache.k_pe, at, k_pe, mode="drop"),
        None if c_scale is None else _put(cache.c_scale, at, c_scale, mode="drop"),
        cache.lengths + t,
        None if index_k is None else _put(cache.index_k, at, index_k, mode="drop"),
    )


# ---- the paged latent cache (serving) -----------------------------------------------------------

SCRATCH_PAGE = 0
"""A page no sequence owns: writes of padding tokens (idle slots, the unused tail of a chunk) land
here, so device code never masks a write. Nothing reads it as context (reads are masked by length)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A pool of fixed-size pages of latents, shared by every running sequence, for every layer.

    `c_kv [layers, num_pages, page_size, kv_lora_rank]` (the model's dtype, or int8; bf16 on CPU as
    its bits, `stores_bits`),
    `c_scale [layers, num_pages, page_size]` (float32 per-token scales of an int8 cache, else None),
    `k_pe [layers, num_pages, page_size, rope_dim]` (the model's dtype, as stored),
    `index_k [layers, num_pages, page_size, index_head_dim]` (sparse attention's indexer keys, stored as
    `k_pe` is; None for dense MLA). Which pages hold which
    sequence is not stored here: each sequence has a page table (page ids, in order), kept on the
    host by `dsr1.serving.pages` and passed to every call. Token `pos` of a sequence lives in page
    `table[pos // page_size]`, slot `pos % page_size`. Page `SCRATCH_PAGE` is never handed out.
    """

    c_kv: jax.Array
    k_pe: jax.Array
    c_scale: jax.Array | None
    index_k: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return self.c_kv.shape[2]

    @property
    def kv_cache_dtype(self) -> str | None:
        return None if self.c_scale is None else "int8"

    def nbytes(self) -> int:
        return _latent_bytes(self)

    def read_pages(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """One layer's latents in `pages [B, n]`, each row's pages laid end to end: `c_kv [B, n * page_size, r]`
        (as stored), `c_scale [B, n * page_size]` or None, `k_pe [B, n * page_size, rope]`. One gather from
        the whole pool (the layer index is part of it), so no per-layer copy of the pool is made."""
        def flat(a: jax.Array) -> jax.Array:
            a = a[layer, pages]  # [B, n, page_size, ...]
            return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])

        return flat(self.c_kv), None if self.c_scale is None else flat(self.c_scale), flat(self.k_pe)

    def read_index_pages(self, layer: jax.Array, pages: jax.Array) -> jax.Array:
        """One layer's indexer keys in `pages [B, n]`, laid end to end: `[B, n * page_size, index_head_dim]`
        (as stored; one gather from the whole pool, as `read_pages`)."""
        a = self.index_k[layer, pages]
        return a.reshape(a.shape[0], a.shape[1] * a.shape[2], a.shape[3])


def empty_paged_cache(num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                      dtype: jnp.dtype, kv_cache_dtype: str | None = None, platform: str | None = None,
                      index_head_dim: int = 0) -> PagedKVCache:
    """A zeroed page pool (scales 1 for int8) for `platform`'s devices (`stores_bits`); with
    `index_head_dim` (sparse attention) room for each token's indexer key, stored as `k_pe` is. Call
    under jit to create it directly on the devices."""
    check_kv_cache_dtype(kv_cache_dtype)
    shape = (num_layers, num_pages, page_size)
    int8 = kv_cache_dtype == "int8"
    stored = jnp.uint16 if stores_bits(dtype, platform) else dtype
    return PagedKVCache(jnp.zeros((*shape, kv_lora_rank), jnp.int8 if int8 else stored),
                        jnp.zeros((*shape, rope_dim), stored), jnp.ones(shape, jnp.float32) if int8 else None,
                        jnp.zeros((*shape, index_head_dim), stored) if index_head_dim else None)


def token_slots(page_table: jax.Array, starts: jax.Array, counts: jax.Array, chunk: int,
                page_size: int) -> tuple[jax.Array, jax.Array]:
    """Where each of `chunk` new tokens per row is written: `(page [B, T], slot [B, T])`.

    Row b's token t sits at position `starts[b] + t`; the first `counts[b]` are real and go to their
    row's page; the rest are padding and go to `SCRATCH_PAGE`.
    """
    t = jnp.arange(chunk)
    positions = starts[:, None] + t
    index = jnp.minimum(positions // page_size, page_table.shape[1] - 1)  # padding may run past the table
    real = t[None, :] < counts[:, None]
    pages = jnp.where(real, jnp.take_along_axis(page_table, index, axis=1), SCRATCH_PAGE)
    return pages, positions % page_size


def write_tokens(cache: PagedKVCache, c_kv: jax.Array, k_pe: jax.Array, pages: jax.Array,
                 slots: jax.Array, index_k: jax.Array | None = None) -> PagedKVCache:
    """Write every layer's new latents `c_kv [L, B, T, r]`, `k_pe [L, B, T, rope]` (and a sparse-attention
    pool's indexer keys `index_k [L, B, T, index_head_dim]`) at `(pages, slots) [B, T]` in one scatter
    per array (quantized first for an int8 cache)."""
    if (index_k is None) != (cache.index_k is None):
        raise ValueError("a sparse-attention page pool takes the new tokens' indexer keys, a dense one none")
    at = (slice(None), pages, slots)
    c_kv, c_scale = _stored(c_kv, cache.kv_cache_dtype)
    return PagedKVCache(
        _put(cache.c_kv, at, c_kv),
        _put(cache.k_pe, at, k_pe),
        None if c_scale is None else _put(cache.c_scale, at, c_scale),
        None if index_k is None else _put(cache.index_k, at, index_k),
    )


# ---- the page pool under attention data parallelism ---------------------------------------------
# Each data-parallel rank (a device of `rules.batch`'s axis) holds a share of the pool's pages and the
# rows that use them; with `rules.positions` each row's pages are dealt out over that axis too (page
# j of a row on its device j mod T). A row's page table holds page ids local to the device holding
# each page (every device's page 0 is its scratch page). A gather or scatter with such ids, left to
# XLA's partitioner, would assemble the whole pool on every device: they run per device under
# `shard_map`, and no page moves.

def pool_axes(mesh: Mesh | None, rules: ShardingRules) -> tuple[str | None, str | None]:
    """The mesh axes the pool's pages are split over: the ranks' (`rules.batch`) and each row's
    positions' (`rules.positions`), each None where the pool is not split that way."""
    def split(axis: str | None) -> str | None:
        return axis if mesh is not None and axis is not None and mesh.shape[axis] > 1 else None

    return split(rules.batch), split(rules.positions)


def pool_shares(mesh: Mesh | None, rules: ShardingRules) -> int:
    """Into how many shares the pool's pages are split (`pool_axes`): one scratch page each."""
    return math.prod(mesh.shape[a] for a in pool_axes(mesh, rules) if a is not None)


def _pool_spec(mesh: Mesh | None, rules: ShardingRules) -> jax.sharding.PartitionSpec:
    axes = tuple(a for a in pool_axes(mesh, rules) if a is not None)
    return jax.sharding.PartitionSpec(None, axes or None)


def keep_pool_layout(cache: PagedKVCache, mesh: Mesh, rules: ShardingRules) -> PagedKVCache:
    """Inside jit: the pool's pages split as `pool_axes` says, or whole on every device."""
    sharding = jax.sharding.NamedSharding(mesh, _pool_spec(mesh, rules))
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache)


def pool_specs(cache: PagedKVCache, mesh: Mesh | None, rules: ShardingRules) -> PagedKVCache:
    """The `shard_map` specs of the pool's arrays (`keep_pool_layout`'s split)."""
    return _specs_like(cache, _pool_spec(mesh, rules))


def _specs_like(cache: PagedKVCache, spec: jax.sharding.PartitionSpec) -> PagedKVCache:
    """`spec` for each array `cache` holds (None where it holds none)."""
    return PagedKVCache(*(None if a is None else spec for a in (cache.c_kv, cache.k_pe, cache.c_scale, cache.index_k)))


def _per_device(fn, mesh: Mesh, rules: ShardingRules, in_specs, out_specs):
    """`fn` run on each device's share of the pool (manual over the pool's axes only: the rest of the
    mesh stays XLA's)."""
    manual = {a for a in pool_axes(mesh, rules) if a is not None}
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual, check_vma=False)


def read_rank_pages(cache: PagedKVCache, layer: jax.Array, pages: jax.Array, mesh: Mesh | None,
                    rules: ShardingRules) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """`cache.read_pages(layer, pages)`, each row's pages read on its own rank when the pool's pages
    are split over ranks only (a split over positions reads by `attention`'s per-device partials)."""
    rows_axis, positions_axis = pool_axes(mesh, rules)
    if positions_axis is not None:
        raise ValueError("a pool split over positions is read by per-device partials, not gathered per row")
    if rows_axis is None:
        return cache.read_pages(layer, pages)
    rows, whole = jax.sharding.PartitionSpec(rows_axis), jax.sharding.PartitionSpec()
    read = _per_device(lambda c, i, p: c.read_pages(i, p), mesh, rules, (pool_specs(cache, mesh, rules), whole, rows),
                       (rows, None if cache.c_scale is None else rows, rows))
    return read(cache, layer, pages)


def write_rank_tokens(cache: PagedKVCache, c_kv: jax.Array, k_pe: jax.Array, pages: jax.Array, slots: jax.Array,
                      page_index: jax.Array, mesh: Mesh | None, rules: ShardingRules,
                      index_k: jax.Array | None = None) -> PagedKVCache:
    """`write_tokens`, each row's tokens written on the device holding their page when the pool is
    split (`page_index [B, T]`: each token's page's index in its row's table, which names the device
    of the positions axis holding it)."""
    rows_axis, positions_axis = pool_axes(mesh, rules)
    if rows_axis is None and positions_axis is None:
        return write_tokens(cache, c_kv, k_pe, pages, slots, index_k)

    def write(cache, c_kv, k_pe, pages, slots, page_index, index_k):
        if positions_axis is not None:  # another device's page: this device writes to its scratch page
            mine = page_index % jax.lax.axis_size(positions_axis) == jax.lax.axis_index(positions_axis)
            pages = jnp.where(mine, pages, SCRATCH_PAGE)
        return write_tokens(cache, c_kv, k_pe, pages, slots, index_k)

    pool, rows = pool_specs(cache, mesh, rules), jax.sharding.PartitionSpec(rows_axis)
    new = jax.sharding.PartitionSpec(None, rows_axis)
    keys = None if index_k is None else new
    return _per_device(write, mesh, rules, (pool, new, new, rows, rows, rows, keys), pool)(
        cache, c_kv, k_pe, pages, slots, page_index, index_k)


def _rank_only(mesh: Mesh | None, rules: ShardingRules, what: str) -> str | None:
    """The ranks' axis of a pool split over ranks only (None: whole); ValueError for a positions split."""
    rows_axis, positions_axis = pool_axes(mesh, rules)
    if positions_axis is not None:
        raise ValueError(f"{what} takes a pool split over ranks only, not over each row's positions")
    return rows_axis


def gather_rank_pages(cache: PagedKVCache, pages: jax.Array, mesh: Mesh | None,
                      rules: ShardingRules) -> PagedKVCache:
    """`gather_pages` of `pages [K]` named by their index in the whole pool (rank r's pages are
    `r * P/R ..`), whole on every device: when the pool is split over ranks, each rank reads its own
    pages and one sum over the ranks (K pages) gathers them; the pool itself never moves."""
    rows_axis = _rank_only(mesh, rules, "gather_rank_pages")
    if rows_axis is None:
        return gather_pages(cache, pages)

    def gather(cache: PagedKVCache, pages: jax.Array) -> PagedKVCache:
        per = cache.c_kv.shape[1]
        mine = pages // per == jax.lax.axis_index(rows_axis)
        got = gather_pages(cache, jnp.where(mine, pages % per, SCRATCH_PAGE))

        def summed(a: jax.Array) -> jax.Array:  # other ranks' pages count zero
            return jax.lax.psum(jnp.where(mine.reshape(1, -1, *(1,) * (a.ndim - 2)), a, jnp.zeros((), a.dtype)),
                                rows_axis)

        return jax.tree.map(summed, got)

    whole = jax.sharding.PartitionSpec()
    out = _specs_like(cache, whole)
    return _per_device(gather, mesh, rules, (pool_specs(cache, mesh, rules), whole), out)(cache, pages)


def scatter_rank_pages(cache: PagedKVCache, pages: jax.Array, contents: PagedKVCache, mesh: Mesh | None,
                       rules: ShardingRules) -> PagedKVCache:
    """`scatter_pages` of `pages [K]` named by their index in the whole pool (`gather_rank_pages`):
    each rank writes the pages it holds (the others' contents go to its scratch page)."""
    rows_axis = _rank_only(mesh, rules, "scatter_rank_pages")
    if rows_axis is None:
        return scatter_pages(cache, pages, contents)

    def scatter(cache: PagedKVCache, pages: jax.Array, contents: PagedKVCache) -> PagedKVCache:
        per = cache.c_kv.shape[1]
        mine = pages // per == jax.lax.axis_index(rows_axis)
        return scatter_pages(cache, jnp.where(mine, pages % per, SCRATCH_PAGE), contents)

    whole, pool = jax.sharding.PartitionSpec(), pool_specs(cache, mesh, rules)
    specs = _specs_like(contents, whole)
    return _per_device(scatter, mesh, rules, (pool, whole, specs), pool)(cache, pages, contents)


def local_pages(page_table: jax.Array, cached: jax.Array, page_size: int, device: jax.Array,
                devices: int) -> tuple[jax.Array, jax.Array]:
    """(Per device of a positions axis of `devices`) this device's share of each row's pages: its page
    table `[B, ceil(P / devices)]` (pages `device`, `device + devices`, ...) and how many positions
    of them are cached `[B]`. Only a row's last page is partly filled, so the cached positions of the
    device's pages are the first ones of its table, whatever their positions in the row."""
    b, width = page_table.shape
    table = jnp.pad(page_table, ((0, 0), (0, -width % devices))).reshape(b, -1, devices)
    table = jax.lax.dynamic_index_in_dim(table, device, axis=2, keepdims=False)
    full, rem = cached // page_size, cached % page_size
    mine = (full - device + devices - 1) // devices  # full pages j < full with j % devices == device
    return table, mine * page_size + jnp.where(full % devices == device, rem, 0)


def gather_pages(cache: PagedKVCache, pages: jax.Array) -> PagedKVCache:
    """The contents of `pages [K]` for every layer, as a pool of K pages (`c_kv [L, K, page_size, r]`, ...):
    what the prefix cache copies to host memory when it evicts pages (the indexer keys too, if any)."""
    return PagedKVCache(*(None if a is None else a[:, pages]
                          for a in (cache.c_kv, cache.k_pe, cache.c_scale, cache.index_k)))


def scatter_pages(cache: PagedKVCache, pages: jax.Array, contents: PagedKVCache) -> PagedKVCache:
    """The pool with `pages [K]` overwritten by `contents` (a pool of K pages, as `gather_pages` returns):
    what the prefix cache does to bring evicted pages back. Padding entries may name `SCRATCH_PAGE`."""
    def put(pool: jax.Array | None, new: jax.Array | None) -> jax.Array | None:
        return None if pool is None else _put(pool, (slice(None), pages), new)

    return PagedKVCache(put(cache.c_kv, contents.c_kv), put(cache.k_pe, contents.k_pe),
                        put(cache.c_scale, contents.c_scale), put(cache.index_k, contents.index_k))


# ---- a page pool read as each row's positions (sparse attention) ---------------------------------

@dataclasses.dataclass(frozen=True)
class PagedRows:
    """A page pool seen as a contiguous cache of `page_table.shape[1] * page_size` positions per row:
    row b's position s is slot `s % page_size` of its page `page_table[b, s // page_size]`, and it
    holds `lengths[b]` positions. Sparse attention (`sparse_attention.attend_cached`) reads it as it
    reads a `KVCache`: every indexer key of the row's pages (`read_index_keys`), then only the
    selected positions' latents (`gather_positions`; by the TPU kernel `paged_gather` where `kernel`).
    Under attention data parallelism (the pool split over ranks, `pool_axes`) each rank reads its own
    rows' pages; a pool split over each row's positions is not read this way (ValueError)."""

    cache: PagedKVCache
    page_table: jax.Array
    lengths: jax.Array
    mesh: Mesh | None = None
    rules: ShardingRules | None = None
    kernel: bool = False

    def __post_init__(self):
        if self.cache.index_k is None:
            raise ValueError("PagedRows: the page pool holds no indexer keys (a sparse-attention pool has index_k)")
        if self.rules is not None and pool_axes(self.mesh, self.rules)[1] is not None:
            raise ValueError("sparse attention reads each row's pages on the device holding them: a page pool split "
                             f"over each row's positions (rules.positions={self.rules.positions!r}) is not supported")

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.cache.page_size

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    def _rows_axis(self) -> str | None:
        return None if self.rules is None else pool_axes(self.mesh, self.rules)[0]

    def read_index_keys(self, layer: jax.Array) -> jax.Array:
        """One layer's indexer keys at every position of each row's pages `[B, max_len, index_head_dim]`,
        as stored."""
        rows_axis = self._rows_axis()
        if rows_axis is None:
            return self.cache.read_index_pages(layer, self.page_table)
        rows, whole = jax.sharding.PartitionSpec(rows_axis), jax.sharding.PartitionSpec()
        read = _per_device(lambda c, i, t: c.read_index_pages(i, t), self.mesh, self.rules,
                           (pool_specs(self.cache, self.mesh, self.rules), whole, rows), rows)
        return read(self.cache, layer, self.page_table)

    def gather_positions(self, layer: jax.Array, positions: jax.Array
                         ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """One layer's latents at `positions [B, ...]` (each below `max_len`) of each row, as stored:
        `c_kv [B, ..., r]`, `c_scale [B, ...]` or None, `k_pe [B, ..., rope]`; only those positions are
        read."""
        gather = functools.partial(_gather_row_positions, kernel=self.kernel)
        rows_axis = self._rows_axis()
        if rows_axis is None:
            return gather(self.cache, layer, self.page_table, positions)
        rows, whole = jax.sharding.PartitionSpec(rows_axis), jax.sharding.PartitionSpec()
        out = (rows, None if self.cache.c_scale is None else rows, rows)
        run = _per_device(gather, self.mesh, self.rules,
                          (pool_specs(self.cache, self.mesh, self.rules), whole, rows, rows), out)
        return run(self.cache, layer, self.page_table, positions)


def _gather_row_positions(cache: PagedKVCache, layer: jax.Array, page_table: jax.Array, positions: jax.Array,
                          kernel: bool) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """`PagedRows.gather_positions` on a pool whose page ids `page_table` names (one device's share)."""
    b, size = positions.shape[0], cache.page_size
    pages = jnp.take_along_axis(page_table, (positions // size).reshape(b, -1), axis=1).reshape(positions.shape)
    slots = positions % size

    def take(a: jax.Array) -> jax.Array:
        return paged_gather.gather(a, layer, pages, slots) if kernel else a[layer, pages, slots]

    scale = None if cache.c_scale is None else cache.c_scale[layer, pages, slots]
    return take(cache.c_kv), scale, take(cache.k_pe)
