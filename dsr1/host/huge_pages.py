"""Weights on CPU held in 2 MiB pages (Linux transparent huge pages).

A decode step streams every weight it uses from memory once. With the default 4 KiB pages the CPU's
hardware prefetchers stop at each page boundary, every two rows of a bf16 matrix of 1,024 columns,
and the kernel reads a large matrix markedly slower than from 2 MiB pages. XLA:CPU allocates its
buffers with `malloc`, which Linux backs with huge pages only where asked (`madvise`, the default
setting of `/sys/kernel/mm/transparent_hugepage/enabled`), so `on_huge_pages` moves large weights
into memory that asks, and hands it to XLA without a copy (`jax.device_put` of an aligned host array
on CPU keeps that array as the buffer). While they move, the weights are held twice. Weights made on
the host (`dsr1.load`'s buffers, the transposed copies) are born there instead (`empty`), and stay
put. `DSR1_HUGE_PAGES=0` leaves every weight where XLA or numpy put it."""

from __future__ import annotations

import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
MIN_BYTES = HUGE_PAGE  # smaller arrays keep their memory: they would not fill one page
ALIGNMENT = 64  # XLA:CPU takes a host buffer so aligned as a device buffer without copying it


def supported() -> bool:
    """Whether weights move to huge pages here: the platform can ask for them (Linux:
    `madvise(MADV_HUGEPAGE)`), unless `DSR1_HUGE_PAGES=0`."""
    return (os.environ.get("DSR1_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
            and hasattr(mmap, "MAP_PRIVATE"))


def on_huge_pages(tree: Any) -> Any:
    """`tree` with each array of at least `MIN_BYTES` held on one CPU device moved into memory
    backed by 2 MiB pages; other leaves (sharded, accelerator, small, not arrays) as they are. An
    array that appears twice in the tree is moved once and stays shared; one already where a move
    would put it (made by `empty`: `_in_place`) stays. Values do not change."""
    if not supported():
        return tree
    asking = _memory_asking_for_huge_pages()
    movable = {id(x): x for x in jax.tree.leaves(tree) if _movable(x) and not _in_place(x, asking)}
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # the copies and the page faults run in parallel
        moved = dict(zip(movable, pool.map(_moved, movable.values())))
    return jax.tree.map(lambda x: moved.get(id(x), x), tree)


def _movable(x: Any) -> bool:
    return (isinstance(x, jax.Array) and x.nbytes >= MIN_BYTES and len(x.sharding.device_set) == 1
            and next(iter(x.sharding.device_set)).platform == "cpu")


def _memory_asking_for_huge_pages() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings that asked for huge pages (`hg` among their
    VmFlags in /proc/self/smaps)."""
    ranges, current = [], None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: `start-end perms ...`
                    current = tuple(int(a, 16) for a in head.split("-"))
                elif head == "VmFlags:" and "hg" in line.split():
                    ranges.append(current)
    except OSError:  # no /proc: nothing is known to be there
        return []
    return ranges


def _in_place(x: jax.Array, asking: list[tuple[int, int]]) -> bool:
    """Whether `x` starts at a huge-page boundary in memory that asks for huge pages (`asking`), as
    `empty`'s and a move's arrays do. Both count: numpy asks for huge pages for its own large arrays
    too, and the heap keeps the flag where XLA may later allocate (seen in the test suite)."""
    address = x.unsafe_buffer_pointer()
    return address % HUGE_PAGE == 0 and any(start <= address < end for start, end in asking)


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized host array to fill and hand to a CPU device (`jax.device_put` takes it without
    a copy): in memory that asks for huge pages where `supported` and at least `MIN_BYTES`, else
    `ALIGNMENT`-aligned. `on_huge_pages` leaves the first kind where it is."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if supported() and nbytes >= MIN_BYTES:
        return _huge_page_array(tuple(shape), dtype)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _moved(x: jax.Array) -> jax.Array:
    host = _huge_page_array(x.shape, x.dtype)
    np.copyto(host, np.asarray(x))
    return jax.device_put(host, x.sharding)


def _huge_page_array(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized array in a private anonymous mapping that asks for huge pages, its data at a
    page boundary (so every whole 2 MiB of it can be one page). Freed when the last view goes."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)  # a hint: with huge pages off it changes nothing
    raw = np.frombuffer(memory, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)
