"""Ragged paged MLA attention on TPU: each row reads its own pages and stops at its own length.

The serving engine's XLA path (`attention._fold_pages`) gathers a block of pages for every row at
each step of one loop that runs as long as the longest row, so beside one long row every short row
gathers (masked) pages it does not hold. This kernel gives each row its own program: the program
reads the row's page-table entries from SMEM (scalar prefetch), copies the row's pages from the
pool in HBM to VMEM a block at a time (two buffers: block i+1 is on its way while block i is
scored), and stops after the row's last page. The bytes read are the bytes the rows hold, rounded
up to whole pages (`pages_read`).

In absorbed MLA every head (and every new token of a row: verification, short extends) meets the
same latents, so a row's queries `[G, r]` (G = tokens x heads) are scored together, a page at a
time, with an online softmax; the program writes its unnormalized partial softmax (context, max,
sum of exponentials), which `attention` merges with the new tokens' own keys. An int8 cache's
scales multiply the latents' scores and the probabilities, as `attention.scores` and
`weighted_values` apply them. Heads are split over the mesh's tensor axis by the caller
(`shard_map`); the pool is read whole on each device.

`interpret=True` runs the kernel in Pallas' TPU interpreter on any backend (the tests, on CPU);
compiled, it needs a TPU (or libtpu's deviceless compile, `tests/test_paged_attention.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30  # as `attention.NEG_INF`: an empty row's max, whose weight in a merge is exp(-1e30) = 0
BLOCK_TOKENS = 256  # cached positions copied per block (whole pages)
BLOCK_QUERIES = 256  # a row's queries per program: its [G, r] float32 context stays in VMEM
QUERY_ALIGN = 16  # queries padded to whole bf16 sublane tiles
NAME = "mla_paged_attention"  # the kernel's custom call in compiled HLO (`dsr1.bench.hlo` counts its bytes)
POOLS_FROM = 5  # the call's operands from this one on are the pools (layer, lengths, table, q, q_pe before)


def applies(platform: str | None = None) -> bool:
    """Whether the kernel reads an absorbed step's pages on `platform` (JAX's default backend by
    default): on TPU. GPU, CPU: XLA's page loop (`attention._fold_pages`)."""
    return (platform or jax.default_backend()) == "tpu"


def pages_per_block(page_size: int) -> int:
    """Pages copied per block: `BLOCK_TOKENS` positions, at least one page."""
    return max(1, BLOCK_TOKENS // page_size)


def pages_read(lengths: jax.Array, page_size: int) -> jax.Array:
    """The pages the kernel copies for rows of `lengths` cached positions: each row's own, up to its
    last (a row of more than `BLOCK_QUERIES` queries copies them once per block of queries).
    `bench paged` counts the kernel's bytes with it."""
    return jnp.sum(-(-lengths // page_size))


@dataclasses.dataclass(frozen=True)
class _RowPages:
    """One row's pages of one layer, copied from HBM into VMEM a block of `block` pages at a time, into
    one of two buffers (`slot`) while the other is read; with an int8 pool, their scales too."""

    table_ref: Any
    pools: tuple  # (c_hbm, pe_hbm[, s_hbm])
    buffers: tuple  # (c_buf, pe_buf[, s_buf]), each [2, block, ...]
    sems: Any
    row: jax.Array
    layer: jax.Array
    block: int
    pages: jax.Array  # the row's pages in use

    def copies(self, i, slot, k) -> list:
        """The copies of page k of block i into buffer `slot`."""
        page = self.table_ref[self.row, i * self.block + k]
        out = []
        for j, (pool, buffer) in enumerate(zip(self.pools, self.buffers)):
            one = (page,) if j < 2 else (pl.ds(page, 1),)  # the scales: a page's row of their [pages, page] array
            to = buffer.at[slot, k] if j < 2 else buffer.at[slot, pl.ds(k, 1)]
            out.append(pltpu.make_async_copy(pool.at[(self.layer, *one)], to, self.sems.at[j, slot, k]))
        return out

    def each_held_page(self, i, action) -> None:
        for k in range(self.block):
            pl.when(i * self.block + k < self.pages)(functools.partial(action, k))

    def start(self, i, slot) -> None:
        def start_page(k):
            for c in self.copies(i, slot, k):
                c.start()
        self.each_held_page(i, start_page)

    def wait(self, i, slot) -> None:
        def wait_page(k):
            for c in self.copies(i, slot, k):
                c.wait()
        self.each_held_page(i, wait_page)


def _attend_page(q, qpe, bufs: tuple, state: tuple, slot, k, first: jax.Array, length: jax.Array, page_size: int,
                 scale: float) -> None:
    """Fold page k of buffer `slot` (cached positions `first + [0, page_size)`, those `< length` real) into
    the running softmax `state` (acc, max, sum refs)."""
    f32 = jnp.float32
    acc_ref, max_ref, sum_ref = state
    scaled = len(bufs) == 3
    c_buf, pe_buf = bufs[:2]
    c = c_buf[slot, k].astype(f32).astype(q.dtype) if scaled else c_buf[slot, k]  # int8 values are exact
    product = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
                                preferred_element_type=f32)
    s = product(q, c)  # [G, page]
    if scaled:
        key_scale = bufs[2][slot, pl.ds(k, 1), :]  # [1, page]
        s = s * key_scale
    s = (s + product(qpe, pe_buf[slot, k])) * scale
    positions = first + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    s = jnp.where(positions < length, s, NEG_INF)  # a held page holds at least one position
    run_max = max_ref[...]
    new_max = jnp.maximum(run_max, s.max(axis=1, keepdims=True))
    rescale = jnp.exp(run_max - new_max)
    probs = jnp.exp(s - new_max)
    sum_ref[...] = sum_ref[...] * rescale + probs.sum(axis=1, keepdims=True)
    weights = (probs * key_scale if scaled else probs).astype(c.dtype)
    acc_ref[...] = acc_ref[...] * rescale + jnp.dot(weights, c, preferred_element_type=f32)
    max_ref[...] = new_max


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, qpe_ref, c_hbm, pe_hbm, *refs, page_size: int, block: int,
            scale: float, scaled: bool):
    """One program: one row's block of queries against the row's cached positions, page by page."""
    if scaled:
        s_hbm, acc_ref, max_ref, sum_ref, c_buf, pe_buf, s_buf, sems = refs
        pools, bufs = (c_hbm, pe_hbm, s_hbm), (c_buf, pe_buf, s_buf)
    else:
        acc_ref, max_ref, sum_ref, c_buf, pe_buf, sems = refs
        pools, bufs = (c_hbm, pe_hbm), (c_buf, pe_buf)
    row, length = pl.program_id(0), lengths_ref[pl.program_id(0)]
    # lax's division and remainder: jnp's floor division asks Mosaic for the chip's generation.
    pages = jax.lax.div(length + page_size - 1, page_size)
    blocks = jax.lax.div(pages + block - 1, block)
    held = _RowPages(table_ref, pools, bufs, sems, row, layer_ref[0], block, pages)
    q, qpe = q_ref[...], qpe_ref[...]
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    max_ref[...] = jnp.full(max_ref.shape, NEG_INF, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)

    @pl.when(blocks > 0)
    def _():
        held.start(0, 0)

    def step(i, carry):
        slot = jax.lax.rem(i, 2)
        held.wait(i, slot)

        @pl.when(i + 1 < blocks)
        def _():
            held.start(i + 1, 1 - slot)

        held.each_held_page(i, lambda k: _attend_page(q, qpe, bufs, (acc_ref, max_ref, sum_ref), slot, k,
                                                      (i * block + k) * page_size, length, page_size, scale))
        return carry

    jax.lax.fori_loop(0, blocks, step, 0)


def paged_context(q: jax.Array, q_pe: jax.Array, c_pool: jax.Array, pe_pool: jax.Array, c_scale: jax.Array | None,
                  layer: jax.Array, page_table: jax.Array, lengths: jax.Array, scale: float,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The partial softmax of each row's queries `q [B, G, r]`, `q_pe [B, G, rope]` over its first
    `lengths[b]` cached positions of `layer` of a page pool (`c_pool [L, N, page, r]`, `pe_pool [L, N,
    page, rope]`, an int8 pool's scales `c_scale [L, N, page]`), found through `page_table [B, P]`:
    the unnormalized context `[B, G, r]`, the running max and the sum of exponentials `[B, G]`
    (float32). A row of no cached positions gives max `NEG_INF` and zeros. Queries take the dtype
    of `pe_pool` (the model's)."""
    scaled = c_scale is not None
    # A bf16 pool kept as its bits (`cache.stores_bits`: CPU, the interpreter); an int8 pool's rope keys too.
    c_pool, pe_pool = (jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a
                       for a in (c_pool, pe_pool))
    b, g, rank = q.shape
    rope, page_size = pe_pool.shape[-1], pe_pool.shape[2]
    block = pages_per_block(page_size)
    per_program = min(BLOCK_QUERIES, -(-g // QUERY_ALIGN) * QUERY_ALIGN)
    padded = -(-g // per_program) * per_program
    q, q_pe = (jnp.pad(a.astype(pe_pool.dtype), [(0, 0), (0, padded - g), (0, 0)]) for a in (q, q_pe))
    # Page-table entries past a row's pages are never read, but a block may name them: whole blocks.
    table = jnp.pad(page_table.astype(jnp.int32), [(0, 0), (0, -page_table.shape[1] % block)])
    queries = lambda width: pl.BlockSpec((None, per_program, width), lambda i, j, *_: (i, j, 0))  # noqa: E731
    stats = pl.BlockSpec((None, per_program, 1), lambda i, j, *_: (i, j, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    f32 = jnp.float32
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, padded // per_program),
        in_specs=[queries(rank), queries(rope), hbm, hbm] + ([hbm] if scaled else []),
        out_specs=[queries(rank), stats, stats],
        scratch_shapes=[pltpu.VMEM((2, block, page_size, rank), c_pool.dtype),
                        pltpu.VMEM((2, block, page_size, rope), pe_pool.dtype)]
                       + ([pltpu.VMEM((2, block, page_size), f32)] if scaled else [])
                       + [pltpu.SemaphoreType.DMA((3, 2, block))],
    )
    acc, run_max, run_sum = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, block=block, scale=scale, scaled=scaled),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, padded, rank), f32), jax.ShapeDtypeStruct((b, padded, 1), f32),
                   jax.ShapeDtypeStruct((b, padded, 1), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=NAME,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths.astype(jnp.int32), table, q, q_pe, c_pool, pe_pool,
      *([c_scale] if scaled else []))
    return acc[:, :g], run_max[:, :g, 0], run_sum[:, :g, 0]
