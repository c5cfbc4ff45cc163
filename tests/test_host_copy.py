"""Host copies for loading on CPU (`dsr1.host.copy`): compiled where the kernel library builds,
numpy elsewhere; both give the same bits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dsr1.host import copy as host_copy

compiled = pytest.mark.skipif(host_copy.library() is None, reason="dsr1's kernel library is not built here")


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    """Each test once with the library's functions and once with numpy's (`DSR1_CPU_KERNELS=0`)."""
    if request.param == "compiled" and host_copy.library() is None:
        pytest.skip("dsr1's kernel library is not built here")
    if request.param == "numpy":
        monkeypatch.setenv("DSR1_CPU_KERNELS", "0")
    return request.param


@pytest.mark.parametrize("dtype", [np.int8, ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("shape", [(37, 21), (3, 70, 9), (2, 2, 130, 67)])
def test_transpose_into_swaps_the_last_two_axes(path, dtype, shape):
    """Tiles and 8 x 8 squares with partial edges, one matrix or a stack: the same bits as numpy's."""
    x = np.random.default_rng(0).integers(-100, 100, shape).astype(dtype)
    out = np.zeros((*shape[:-2], shape[-1], shape[-2]), dtype)
    host_copy.transpose_into(out, x)
    np.testing.assert_array_equal(out.view(np.uint8), np.ascontiguousarray(np.swapaxes(x, -1, -2)).view(np.uint8))


def test_transpose_into_reads_a_region_of_rows_and_runs_a_large_matrix_in_threads(path):
    """A region of a matrix (its rows strided) and a matrix large enough to be split over threads by
    row ranges (`TRANSPOSE_ROWS`)."""
    x = np.random.default_rng(1).integers(0, 2**16, (700, 3001), dtype=np.uint16)
    region = x[5:650, 17:2900]
    out = np.empty(region.shape[::-1], np.uint16)
    host_copy.transpose_into(out, region)
    np.testing.assert_array_equal(out, region.T)
    assert x.nbytes >= 4 << 20 and x.shape[0] > host_copy.TRANSPOSE_ROWS
    whole = np.empty(x.shape[::-1], np.uint16)
    host_copy.transpose_into(whole, x)
    np.testing.assert_array_equal(whole, x.T)


def test_transpose_into_names_an_output_that_does_not_fit():
    with pytest.raises(ValueError, match=r"out uint16\[4, 3\] \(C-contiguous\) cannot hold uint16\[4, 3\]"):
        host_copy.transpose_into(np.empty((4, 3), np.uint16), np.empty((4, 3), np.uint16))
    with pytest.raises(ValueError, match="cannot hold"):
        host_copy.transpose_into(np.empty((6, 4), np.uint16)[::2], np.empty((4, 3), np.uint16))


def _expected(codes: np.ndarray, tables: np.ndarray, block: int, origin: tuple[int, int]) -> np.ndarray:
    r = (origin[0] + np.arange(codes.shape[0]))[:, None] // block - origin[0] // block
    c = (origin[1] + np.arange(codes.shape[1]))[None] // block - origin[1] // block
    return tables[r, c, codes]


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("origin", [(0, 0), (100, 60), (128, 5)])
def test_take_blocks_into_looks_each_code_up_in_its_blocks_table(path, dtype, origin):
    """Blocks counted from the region's place in the weight (partial first and last blocks), into a
    row-major `out` and into a transposed view of one."""
    rng = np.random.default_rng(2)
    block, rows, cols = 16, 45, 37
    codes = rng.integers(0, 256, (200, 200), dtype=np.uint8)[:rows, :cols]  # strided rows
    across = (origin[1] + cols - 1) // block - origin[1] // block + 1
    down = (origin[0] + rows - 1) // block - origin[0] // block + 1
    tables = rng.standard_normal((down, across, 256)).astype(dtype)
    want = _expected(codes, tables, block, origin)
    out = np.zeros((rows, cols), dtype)
    host_copy.take_blocks_into(out, codes, tables, block, origin)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    transposed = np.zeros((cols, rows), dtype)
    host_copy.take_blocks_into(transposed.T, codes, tables, block, origin)
    np.testing.assert_array_equal(transposed.T, want)


@compiled
def test_the_compiled_lookup_releases_the_gil(monkeypatch):
    assert host_copy.releases_gil()
    monkeypatch.setenv("DSR1_CPU_KERNELS", "0")
    assert not host_copy.releases_gil()
