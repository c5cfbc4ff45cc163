"""The attention bytes of a ragged batch on a TPU chip: the ragged paged kernel against XLA's page loop.

Rows of the given lengths (by default the serving target's worst case: one row of 32,768 positions
beside 63 of 1,024) read their latents from a page pool that holds exactly their pages, with R1's
widths and the heads of one tensor-parallel device. Both forms are compiled by XLA:TPU for one v5e
chip (libtpu's deviceless compile: the `tpu-plan` extra) and their bytes counted per layer:

- **held**: the bytes of the rows' cached positions (latents, rope keys, int8 scales);
- **kernel**: the pages the kernel copies (each row's own, up to its last: `paged_attention.pages_read`)
  plus its queries and outputs, from the compiled call's operands; XLA's cost analysis counts a
  Mosaic call by its whole operands, and its copies are the kernel's own;
- **XLA loop**: the compiled page loop (`attention._fold_pages`) walked with its trip count (the
  longest row's blocks), every row gathering a block at each step (`dsr1.bench.hlo`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import jax
import jax.numpy as jnp

from ..core import attention, paged_attention
from ..core.cache import PagedKVCache
from ..options import positive_ints
from . import hlo
from .report import markdown_table
from .tpu import check_libtpu

PAGED_COLUMNS = ("page_size", "kv_cache_dtype", "rows", "held_mb", "kernel_mb", "kernel_x", "xla_loop_mb", "xla_x")


def parse_lengths(text: str) -> list[int]:
    """`32768,1024x63` -> one 32,768 and 63 1,024s."""
    lengths = []
    for part in text.split(","):
        length, _, count = part.partition("x")
        lengths += [int(length)] * int(count or 1)
    if not lengths or min(lengths) < 0:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: want LENGTH[xCOUNT],... of positions >= 0")
    return lengths


def add_paged_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", type=parse_lengths, default=parse_lengths("32768,1024x63"),
                    help="cached positions per row, LENGTH[xCOUNT],... (default: 32768,1024x63)")
    ap.add_argument("--page-size", type=positive_ints, default=[16, 64], help="pages of these many positions")
    ap.add_argument("--heads", type=int, default=16, help="query heads per device (R1: 128 over a tensor axis of 8)")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "int8"], default="bf16")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def _chip() -> Any:
    check_libtpu()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1).devices[0]


def measure(lengths: list[int], page_size: int, heads: int, int8: bool, rank: int = 512, rope: int = 64) -> dict:
    """One row of the table: both forms compiled for a v5e chip, their bytes per layer."""
    on_chip = jax.sharding.SingleDeviceSharding(_chip())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)

    rows, dtype = len(lengths), jnp.bfloat16
    held_pages = sum(-(-n // page_size) for n in lengths)
    pages, width = held_pages + 1, -(-max(lengths) // page_size)  # + the scratch page
    pool = (1, pages, page_size)
    c_dtype = jnp.int8 if int8 else dtype
    args = (spec((rows, 1, heads, rank), dtype), spec((rows, 1, heads, rope), dtype), spec((*pool, rank), c_dtype),
            spec((*pool, rope), dtype), spec(pool, jnp.float32) if int8 else None, spec((rows, width), jnp.int32),
            spec((rows,), jnp.int32))
    per_position = rank * jnp.dtype(c_dtype).itemsize + rope * 2 + (4 if int8 else 0)
    block_pages = max(1, 256 // page_size)
    cfg = argparse.Namespace(softmax_scale=0.1)

    def xla_loop(q, q_pe, c_kv, k_pe, c_scale, table, lengths):
        query = attention.Query(q, q_pe, absorbed=True)
        b = q.shape[0]
        start = attention.PartialSoftmax(jnp.full((b, heads, 1), attention.NEG_INF), jnp.zeros((b, heads, 1)),
                                         jnp.zeros((b, heads, 1, rank)))
        context = attention.PagedContext(PagedKVCache(c_kv, k_pe, c_scale), table, lengths, block_pages)
        state = attention._fold_pages(start, {}, query, context, jnp.zeros((), jnp.int32), dtype, cfg)
        return state.acc, state.max, state.total

    def kernel(q, q_pe, c_kv, k_pe, c_scale, table, lengths):
        return paged_attention.paged_context(q[:, 0], q_pe[:, 0], c_kv, k_pe, c_scale, jnp.zeros((), jnp.int32),
                                             table, lengths, 0.1)

    loop_steps = -(-width // block_pages)
    xla_module = hlo.parse_module(jax.jit(xla_loop).lower(*args).compile().as_text())
    xla_bytes = hlo.bytes_accessed(xla_module, hlo.executions(xla_module, loop_steps))
    kernel_module = hlo.parse_module(jax.jit(kernel).lower(*args).compile().as_text())
    calls = [i for c in kernel_module.values() for i in c.instructions if i.name.startswith(paged_attention.NAME)]
    if len(calls) != 1:
        raise RuntimeError(f"expected one {paged_attention.NAME} call in the compiled kernel, found {len(calls)}")
    # The call's operands before the pools (queries, lengths, page table) and its outputs, from the
    # compiled HLO; of the pools, the pages the kernel copies.
    shapes = {i.name: i.shape for c in kernel_module.values() for i in c.instructions}
    small = sum(hlo.shape_bytes(shapes[o]) for o in calls[0].operands[:paged_attention.POOLS_FROM])
    copied = int(paged_attention.pages_read(jnp.asarray(lengths), page_size)) * page_size * per_position
    kernel_bytes = small + hlo.shape_bytes(calls[0].shape) + copied
    held = sum(lengths) * per_position
    return dict(page_size=page_size, kv_cache_dtype="int8" if int8 else "bf16", rows=rows, held_mb=held / 1e6,
                kernel_mb=kernel_bytes / 1e6, kernel_x=kernel_bytes / held, xla_loop_mb=xla_bytes / 1e6,
                xla_x=xla_bytes / held)


def _cell(column: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if column.endswith("_x") else f"{value:,.1f}"
    return str(value)


def run_paged(args: argparse.Namespace) -> dict:
    """Print the table; returns it with the settings."""
    results = [measure(args.lengths, p, args.heads, args.kv_cache_dtype == "int8") for p in args.page_size]
    print(markdown_table(PAGED_COLUMNS, [[_cell(c, r[c]) for c in PAGED_COLUMNS] for r in results]))
    return {"lengths": args.lengths, "heads": args.heads, "results": results}
