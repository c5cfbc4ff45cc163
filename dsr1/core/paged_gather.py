"""Gather selected positions' latents out of a page pool on TPU, without copying whole pages.

Sparse attention (V3.2, `dsr1.core.sparse_attention`) attends to the `index_topk` positions its
indexer picks per query; in the serving engine's page pool they lie scattered over the row's pages.
XLA's gather (the default, `cache.PagedRows.gather_positions`) reads them on CPU and GPU; on TPU
this kernel does: each program takes one query's block of `BLOCK` selected positions, reads their
pool slots (page * page_size + slot) from SMEM, and starts one DMA per position from the pool in
HBM into VMEM. A DMA of a tiled TPU array starts on a whole tile of rows (8 rows of 32-bit values,
16 of 16-bit, 32 of 8-bit: `tile_rows`), so each copy takes the aligned tile holding the position
(a page, where pages are no longer than a tile), and the program then picks the position's row out
of it in VMEM and writes `tile_rows` picked rows at a time to its output block. The bytes moved
are `bytes_moved`: a tile per selected position, whatever the page size.

`interpret=True` runs the kernel in Pallas' TPU interpreter on any backend (the tests, on CPU);
compiled, it needs a TPU (or libtpu's deviceless compile, `tests/test_paged_gather.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 128  # selected positions per program (one output block)
NAME = "paged_position_gather"  # the kernel's custom call in compiled HLO


def applies(platform: str | None = None) -> bool:
    """Whether the kernel gathers selected positions on `platform` (JAX's default backend by default):
    on TPU. GPU, CPU: XLA's gather."""
    return (platform or jax.default_backend()) == "tpu"


def tile_rows(dtype: jnp.dtype, page_size: int) -> int:
    """The rows one copy takes: a TPU tile's rows for `dtype` (32 bytes of each column), at most a page."""
    return min(page_size, 32 // jnp.dtype(dtype).itemsize)


def bytes_moved(selected: int, width: int, dtype: jnp.dtype, page_size: int) -> int:
    """The bytes the kernel copies out of the pool for `selected` positions of `width` values."""
    return selected * tile_rows(dtype, page_size) * width * jnp.dtype(dtype).itemsize


def _pick(tile: jax.Array, row: jax.Array) -> jax.Array:
    """Row `row` of a copied tile `[tile, w]` as `[1, w]` (a masked sum: exact, one term is nonzero)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    picked = jnp.where(rows == row, tile.astype(jnp.float32), 0.0).sum(axis=0, keepdims=True)
    return picked.astype(tile.dtype)


def _kernel(layer_ref, slots_ref, pool_hbm, out_ref, buf, sem, *, page_size: int, block: int, tile: int):
    """One program: `block` positions of one layer of the pool, each its own tile's DMA into `buf`, their
    rows picked out into `out_ref [block, w]`."""
    layer = layer_ref[0]

    def copy(k):
        slot = slots_ref[k]
        page, at = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        first = pl.multiple_of(jax.lax.div(at, tile) * tile, tile)
        return pltpu.make_async_copy(pool_hbm.at[layer, page, pl.ds(first, tile)], buf.at[k], sem)

    def start(k, carry):
        copy(k).start()
        return carry

    def wait(k, carry):
        copy(k).wait()  # every copy is one tile: each wait takes one tile's bytes off the shared semaphore
        return carry

    jax.lax.fori_loop(0, block, start, 0)
    jax.lax.fori_loop(0, block, wait, 0)

    def write(g, carry):
        base = g * tile
        rows = [_pick(buf[base + i], jax.lax.rem(jax.lax.rem(slots_ref[base + i], page_size), tile))
                for i in range(tile)]
        out_ref[pl.ds(pl.multiple_of(base, tile), tile), :] = jnp.concatenate(rows, axis=0)
        return carry

    jax.lax.fori_loop(0, block // tile, write, 0)


def gather(pool: jax.Array, layer: jax.Array, pages: jax.Array, slots: jax.Array,
           interpret: bool = False) -> jax.Array:
    """`pool[layer, pages, slots]` for a pool `[L, N, page_size, w]` and positions named by their page
    and slot in it (`pages`, `slots` `[..., K]`, of the same shape): `[..., K, w]` in the pool's dtype.
    Entries must name real pages (padding: the scratch page)."""
    page_size, width = pool.shape[2], pool.shape[3]
    tile = tile_rows(pool.dtype, page_size)
    lead, k = pages.shape[:-1], pages.shape[-1]
    flat = (pages.astype(jnp.int32) * page_size + slots.astype(jnp.int32)).reshape(-1, k)
    rows = flat.shape[0]
    block = min(BLOCK, -(-k // tile) * tile)
    padded = -(-k // block) * block
    blocks = padded // block
    # One [1, block] SMEM tile per program (Mosaic blocks must span the array's last two dimensions or
    # be (8, 128)-aligned); padding copies slot 0 of the scratch page, then is dropped.
    flat = jnp.pad(flat, [(0, 0), (0, padded - k)]).reshape(rows * blocks, 1, block)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(rows, blocks),
        in_specs=[pl.BlockSpec((None, None, block), lambda r, j, *_: (r * blocks + j, 0, 0),
                               memory_space=pltpu.SMEM),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((block, width), lambda r, j, *_: (r * blocks + j, 0)),
        scratch_shapes=[pltpu.VMEM((block, tile, width), pool.dtype), pltpu.SemaphoreType.DMA(())],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, block=block, tile=tile),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((rows * padded, width), pool.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=NAME,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), flat, pool)
    return out.reshape(rows, padded, width)[:, :k].reshape(*lead, k, width)
