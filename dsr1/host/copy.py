"""Host copies that loading weights spends its time in: a transpose (the `[..., out, in]` copies
the CPU backend's decode reads) and the table lookup that dequantizes the release's FP8 blocks.

Both run in C++ (kernels/host_copy.cc) where it is built, a part of the array per call and the calls
in threads (ctypes releases the GIL): several times faster than XLA's transpose or numpy's copy of a
transposed view, and than numpy's `take`, which holds the GIL. The library is built only where a
process runs on CPU devices (`library()`, which the CPU backend calls when it builds its kernels): a
GPU or TPU host never compiles it. Elsewhere, and with `DSR1_CPU_KERNELS=0`, numpy computes the same
values.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

import numpy as np

from . import native

TRANSPOSE_ROWS = 256  # rows per call of a single matrix: splits a large one (an lm_head) over the threads


def releases_gil() -> bool:
    """Whether `take_blocks_into` runs compiled, without the GIL: callers may then run it in threads."""
    return library(build=False) is not None


def transpose_into(out: np.ndarray, x: np.ndarray) -> None:
    """Write `x` with its last two axes swapped into `out` (C-contiguous, `[..., cols, rows]`), in
    threads over its matrices (and over row ranges of a single one). `x`'s rows may be strided (a
    region of a matrix)."""
    *batch, rows, cols = x.shape
    if out.shape != (*batch, cols, rows) or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"transpose_into: out {out.dtype}{list(out.shape)} (C-contiguous) cannot hold "
                         f"{x.dtype}{list(x.shape)} with its last two axes swapped")
    function = _function("dsr1_transpose", x.dtype.itemsize)
    mats = x[None] if x.ndim == 2 else x.reshape(-1, rows, cols)  # (a copy only where x's matrices are strided)
    if function is None or x.size == 0 or mats.strides[2] != x.itemsize or mats.strides[1] % x.itemsize:
        np.copyto(out, np.swapaxes(x, -1, -2))
        return
    outs, stride = out.reshape(-1, cols, rows), mats.strides[1] // x.itemsize
    parts = [(m, r) for m in range(len(mats)) for r in range(0, rows, TRANSPOSE_ROWS)]

    def part(job: tuple[int, int]) -> None:
        m, r = job
        n = min(TRANSPOSE_ROWS, rows - r)
        function(mats[m, r:].ctypes.data, n, cols, stride, outs[m, :, r:].ctypes.data, rows)

    _run(part, parts, x.nbytes)


def take_blocks_into(out: np.ndarray, codes: np.ndarray, tables: np.ndarray, block: int,
                     origin: tuple[int, int]) -> None:
    """`out[r, c] = tables[i, j][codes[r, c]]`, where block `(i, j)` of `block x block` values holds
    `(r, c)`, blocks counted from `origin`, the place of `codes[0, 0]` in the whole weight (the first
    blocks may be partial). `codes` uint8 `[rows, cols]`; `tables [blocks down, blocks across, 256]`
    of `out`'s dtype; `out` any strides (a transposed view is walked in its memory order). One
    thread: callers run weights in threads where `releases_gil`."""
    rows, cols = codes.shape
    function = _function("dsr1_take_blocks", out.itemsize)
    strides = [s // out.itemsize for s in out.strides]
    fits = (out.shape == codes.shape and tables.dtype == out.dtype and codes.strides[1] == 1
            and tables.flags.c_contiguous and min(out.strides) > 0 and all(s % out.itemsize == 0 for s in out.strides))
    if function is None or not fits:
        _take_blocks_numpy(out, codes, tables, block, origin)
        return
    function(codes.ctypes.data, rows, cols, codes.strides[0], tables.ctypes.data, block, *origin,
             out.ctypes.data, *strides)


def _take_blocks_numpy(out: np.ndarray, codes: np.ndarray, tables: np.ndarray, block: int,
                       origin: tuple[int, int]) -> None:
    r0, c0 = origin
    rows, cols = codes.shape
    # A transposed `out` written row by row strides across memory: 3.0 ns per element against 1.4
    # walking it in memory order.
    column_major = out.ndim == 2 and abs(out.strides[0]) < abs(out.strides[1])
    i0, j0 = r0 // block, c0 // block
    for i in range(i0, -(-(r0 + rows) // block)):
        a, b = max(r0, i * block) - r0, min(r0 + rows, (i + 1) * block) - r0
        for j in range(j0, -(-(c0 + cols) // block)):
            c, d = max(c0, j * block) - c0, min(c0 + cols, (j + 1) * block) - c0
            part, dest = codes[a:b, c:d], out[a:b, c:d]
            if column_major:  # np.take writes in its output's index order: walk `out`'s memory in order
                part, dest = part.T, dest.T
            # mode="wrap" writes straight into a strided `out` (mode="raise" would buffer); codes are < 256.
            np.take(tables[i - i0, j - j0], part, out=dest, mode="wrap")


_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = {"dsr1_transpose": [_POINTER, _INT, _INT, _INT, _POINTER, _INT],
              "dsr1_take_blocks": [_POINTER, _INT, _INT, _INT, _POINTER, _INT, _INT, _INT, _POINTER, _INT, _INT]}


def library(build: bool = True) -> ctypes.CDLL | None:
    """The built library of host copies; None without a compiler, on another CPU, or with
    `DSR1_CPU_KERNELS=0`. `build=False`: only where this process has built it already."""
    if os.environ.get("DSR1_CPU_KERNELS", "1") == "0" or not (build or _built.cache_info().currsize):
        return None
    return _built()


@functools.cache
def _built() -> ctypes.CDLL | None:
    """Build (or find) the library, once per process."""
    source = resources.files("dsr1.host").joinpath("kernels/host_copy.cc").read_bytes()
    try:
        path = native.build("host_copy", {"host_copy.cc": source}, ["-O3", "-march=native", "-std=c++17", "-shared",
                                                                    "-fPIC"])
    except (OSError, subprocess.CalledProcessError) as e:  # a broken compiler: say so, copy with numpy
        warnings.warn(f"dsr1: host copies not built ({e}); using numpy instead", stacklevel=3)
        return None
    return None if path is None else ctypes.cdll.LoadLibrary(str(path))


def _function(name: str, itemsize: int) -> Callable[..., None] | None:
    """The library's `name` for elements of `itemsize` bytes (None: not built, or no such size)."""
    built = library(build=False)
    function = None if built is None else getattr(built, f"{name}_{itemsize}", None)
    if function is not None:
        function.restype, function.argtypes = None, _ARGUMENTS[name]
    return function


def _run(part: Callable[[Any], None], parts: list, nbytes: int) -> None:
    """`part` of each of `parts`, in threads where there is enough to share (a few MB)."""
    if nbytes < (4 << 20) or (os.cpu_count() or 1) == 1:
        for p in parts:
            part(p)
        return
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(part, parts))
