"""Grouped matmul on TPU for a MoE layer's routed experts: each group's rows times its own expert.

XLA's `ragged_dot` on `stack[layer]` (the layer's experts sliced out of the layer-stacked `[L, E,
in, out]` weights) copies the whole slice every step on TPU, so every expert of the layer is read
whatever the batch routed. This kernel reads the stack in place (the layer is a scalar-prefetched
block index) and reads only the matrices of groups that hold rows.

The rows, sorted by group, are cut into m-tiles of `tm` rows. A *visit* is one (group, m-tile)
pair where the group holds rows of the tile: a group spanning several tiles is visited once per
tile, a tile holding several groups once per group, a group without rows never; the visits of one
tile follow each other, so its output block stays in VMEM across them and each visit writes only
its group's rows. There are at most `tiles_m + G - 1` visits (tiles, plus one per group that
starts inside a tile), a static bound the grid is sized to; the metadata (`_visits`, computed in
jnp from the group sizes) also lists, past the real visits, one visit per tile that holds no row
(it writes zeros) and then idle visits, which name the blocks of the visit before them so that
the pipeline copies nothing for them. Grid: (n-blocks, visits, k-blocks), k innermost, summing a
float32 tile in VMEM scratch.

`interpret=True` runs the kernel in Pallas' TPU interpreter on any backend (the tests, on CPU);
compiled, it needs a TPU (or libtpu's deviceless compile, `tests/test_grouped_matmul.py`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NAME = "grouped_matmul"  # the kernel's custom call in compiled HLO
ROW_ALIGN = 32  # m-tiles in whole sublane tiles of every input dtype (int8's are 32 rows)
LANE = 128  # k and n blocks in whole lane tiles


def applies(platform: str | None = None) -> bool:
    """Whether the kernel runs on `platform` (JAX's default backend by default): TPU only. Other
    platforms keep XLA's `ragged_dot`."""
    return (platform or jax.default_backend()) == "tpu"


class Visits(NamedTuple):
    """Per-visit block indices and counts (int32), as the kernel's scalar prefetch reads them."""

    offsets: jax.Array  # [G + 1]: the row where each group starts, then the rows held
    groups: jax.Array  # [V]: the visit's group (the last real visit's past the real visits)
    tiles: jax.Array  # [V]: the m-tile whose rows the visit reads (likewise)
    out_tiles: jax.Array  # [V]: the m-tile the visit writes: a real visit's, then the empty tiles
    counts: jax.Array  # [2]: the real visits, then the end of the visits that zero an empty tile


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _visits(group_sizes: jax.Array, m: int, tm: int, tiles_m: int) -> Visits:
    """The visits of `tiles_m` m-tiles of `tm` rows by groups of `group_sizes` rows over `m` rows
    (rows past `m` belong to no group), padded to the static bound `tiles_m + G - 1`."""
    i32 = jnp.int32
    g = group_sizes.shape[0]
    bound = tiles_m + g - 1
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(i32)), m)
    starts = jnp.concatenate([jnp.zeros(1, i32), ends[:-1]])
    first_tile = starts // tm
    count = jnp.where(ends > starts, (ends - 1) // tm - first_tile + 1, 0)  # tiles each group touches
    after = jnp.cumsum(count)  # visits up to and including each group's
    real = after[-1]
    visit = jnp.arange(bound, dtype=i32)
    # Past the real visits, the last real one's blocks: the pipeline sees no new block to copy.
    held = jnp.minimum(visit, jnp.maximum(real - 1, 0))
    groups = jnp.minimum(jnp.searchsorted(after, held, side="right", method="compare_all"), g - 1).astype(i32)
    tiles = first_tile[groups] + held - (after[groups] - count[groups])
    used = (ends[-1] + tm - 1) // tm  # tiles holding rows: the first ones, as groups start at row 0
    out_tiles = jnp.where(visit < real, tiles, jnp.minimum(used + visit - real, tiles_m - 1))
    counts = jnp.stack([real, real + tiles_m - used]).astype(i32)
    return Visits(jnp.concatenate([jnp.zeros(1, i32), ends]), groups, tiles, out_tiles.astype(i32), counts)


def _lane_block(block: int, dim: int) -> int:
    """A k or n block: whole lane tiles, at most the dimension; a dimension of part of a lane tile is
    one block of its own width (Mosaic takes a block as wide as its array), so it is never padded."""
    return dim if dim % LANE else min(_round_up(block, LANE), dim)


def _varying(*arrays: jax.Array):
    """The manual mesh axes (inside `shard_map`) the output varies over: those of any input."""
    axes = [jax.typeof(a).mat for a in arrays]
    return axes[0].update(varying=frozenset().union(*(a.varying for a in axes)))


def _kernel(layer_ref, offsets_ref, groups_ref, tiles_ref, out_tiles_ref, counts_ref, lhs_ref, rhs_ref, out_ref,
            acc_ref, *, tiles_k: int):
    """One k-block of one visit: sum into the scratch; on the last, store the group's rows."""
    del layer_ref, out_tiles_ref  # block indices only
    visit, kb = pl.program_id(1), pl.program_id(2)
    real = visit < counts_ref[0]
    zeroes = jnp.logical_and(visit >= counts_ref[0], visit < counts_ref[1])
    last_k = kb == tiles_k - 1

    @pl.when(jnp.logical_and(real, kb == 0))
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(real)
    def _():
        lhs = lhs_ref[...]
        rhs = rhs_ref[...]
        if jnp.issubdtype(rhs.dtype, jnp.integer):  # int8 values are exact in bf16 (and float32)
            rhs = rhs.astype(jnp.float32)
        acc_ref[...] += jnp.dot(lhs, rhs.astype(lhs.dtype), preferred_element_type=jnp.float32)

    @pl.when(jnp.logical_and(real, last_k))
    def _():
        group, tile = groups_ref[visit], tiles_ref[visit]
        tm, tn = acc_ref.shape
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = jnp.logical_and(rows >= offsets_ref[group], rows < offsets_ref[group + 1])
        # The tile's first visit finds the block unwritten: the other groups' rows (or rows of none) are 0.
        first = jnp.logical_or(visit == 0, tile != tiles_ref[jnp.maximum(visit - 1, 0)])

        @pl.when(first)
        def _():
            out_ref[...] = jnp.where(mine, acc_ref[...], 0.0)

        @pl.when(jnp.logical_not(first))
        def _():
            out_ref[...] = jnp.where(mine, acc_ref[...], out_ref[...])

    @pl.when(jnp.logical_and(zeroes, last_k))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _blocks(tile: tuple[int, int, int], m: int, k: int, n: int) -> tuple[int, int, int]:
    """The (rows, k, n) of a block for `tile` on an `[m, k] x [k, n]` product (see `grouped_matmul`)."""
    tm, tk, tn = tile
    # Fewer rows than a sublane tile: one block of exactly the rows (Mosaic takes a block as tall as its array).
    tm = m if m < ROW_ALIGN else min(_round_up(tm, ROW_ALIGN), _round_up(m, ROW_ALIGN))
    return tm, _lane_block(tk, k), _lane_block(tn, n)


def _cost(lhs: jax.Array, rhs: jax.Array, m: int, blocks: tuple[int, int], groups_hit: float | None
          ) -> pl.CostEstimate:
    """The kernel's cost on the padded `lhs [mp, kp]` (`m` real rows) and `rhs [L, G, kp, np]` with
    `blocks` (rows per block, n-blocks)."""
    (mp, kp), (g, np_), (tm, tiles_n) = lhs.shape, (rhs.shape[1], rhs.shape[3]), blocks
    # At most one real visit per row: the rows bound the matrices read when there are fewer than visits.
    # The matrices read: at most one per row, and per group; `groups_hit` where the caller knows better.
    reads = min(g, m) if groups_hit is None else min(g, m, groups_hit)
    real_visits = mp // tm + reads  # each tile once, plus once more per group that starts inside it
    return pl.CostEstimate(
        flops=int(2 * real_visits * tm * kp * np_),
        bytes_accessed=int(reads * kp * np_ * rhs.dtype.itemsize + real_visits * tm * kp * lhs.dtype.itemsize * tiles_n
                           + mp * np_ * 4),
        transcendentals=0)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, layer: jax.Array | int | None = None, *,
                   tile: tuple[int, int, int] = (128, 512, 512), groups_hit: float | None = None,
                   interpret: bool = False) -> jax.Array:
    """float32 [m, n]: rows of `lhs [m, k]` sorted by group (group g's rows follow group g-1's), each
    times its group's matrix of `rhs` ([G, k, n], or [L, G, k, n] read at `layer`); rows past
    sum(group_sizes) are zero. int8 `rhs` is widened to lhs's dtype inside the kernel (exact for int8
    values), sums in float32. Reads only the matrices of groups that have rows.

    `tile` is (rows, k, n) per block, each clamped to its dimension; m is padded to whole row tiles.
    A k or n of part of a lane tile is one block of its own width; one of whole lane tiles that the
    block does not divide is padded to whole blocks, which copies `rhs` (the model's widths divide).
    `groups_hit`: how many groups get rows on average, for the kernel's cost estimate only (which
    XLA's cost analysis reports; default: the most, one per row)."""
    rhs, layer = (rhs[None], 0) if rhs.ndim == 3 else (rhs, layer)  # a stack of one layer: a free reshape
    if layer is None:
        raise ValueError("a stacked rhs [L, G, k, n] needs its layer")
    m, k = lhs.shape
    _, g, k_rhs, n = rhs.shape
    if k_rhs != k or group_sizes.shape != (g,):
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape} and group_sizes {group_sizes.shape} do not match")
    tm, tk, tn = _blocks(tile, m, k, n)
    mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
    tiles_m, tiles_k, tiles_n = mp // tm, kp // tk, np_ // tn
    lhs = jnp.pad(lhs, [(0, mp - m), (0, kp - k)]) if (mp, kp) != (m, k) else lhs
    if (kp, np_) != (k, n):  # zero rows of k add nothing; columns past n are sliced off
        rhs = jnp.pad(rhs, [(0, 0), (0, 0), (0, kp - k), (0, np_ - n)])
    visits = _visits(group_sizes, m, tm, tiles_m)
    bound = visits.groups.shape[0]

    def live_k(visit, kb, counts):  # idle visits keep the last real visit's last k-block
        return jnp.where(visit < counts[0], kb, tiles_k - 1)

    def lhs_block(nb, visit, kb, layer_ref, offsets, groups, tiles, out_tiles, counts):
        return tiles[visit], live_k(visit, kb, counts)

    def rhs_block(nb, visit, kb, layer_ref, offsets, groups, tiles, out_tiles, counts):
        return layer_ref[0], groups[visit], live_k(visit, kb, counts), nb

    def out_block(nb, visit, kb, layer_ref, offsets, groups, tiles, out_tiles, counts):
        return out_tiles[visit], nb

    cost = _cost(lhs, rhs, m, (tm, tiles_n), groups_hit)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(tiles_n, bound, tiles_k),
        in_specs=[pl.BlockSpec((tm, tk), lhs_block), pl.BlockSpec((None, None, tk, tn), rhs_block)],
        out_specs=pl.BlockSpec((tm, tn), out_block),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, tiles_k=tiles_k),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32, manual_axis_type=_varying(lhs, rhs, group_sizes)),
        # A tile's visits must run in order (each keeps the rows the others wrote): only n is parallel.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost,
        name=NAME,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *visits, lhs, rhs)
    return out[:m, :n] if (mp, np_) != (m, n) else out
