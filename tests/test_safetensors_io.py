"""The streaming safetensors writer: what it writes reads back bit for bit (with dsr1's reader and
with the `safetensors` library), and a failure leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsr1 import CheckpointError
from dsr1.weights.safetensors_io import (
    ReadLog,
    TensorInfo,
    map_file,
    merged_ranges,
    page_ranges,
    read_header,
    read_into,
    read_tensor,
    region_runs,
    write_safetensors,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((3, 5)).astype(BF16),
        "b.bias": rng.standard_normal(7).astype(np.float32),
        "c.fp8": rng.standard_normal((2, 4)).astype(ml_dtypes.float8_e4m3fn),
        "d.empty": np.zeros((0, 3), np.int32),
        "e.odd": np.arange(3, dtype=np.int8),  # 3 bytes: later offsets are not aligned
    }


def test_round_trip(tmp_path):
    tensors = arrays()
    produced = []

    def value(name: str) -> np.ndarray:
        produced.append(name)
        return tensors[name]

    file = write_safetensors(tmp_path / "x.safetensors", {n: (a.shape, a.dtype) for n, a in tensors.items()}, value)
    assert produced == list(tensors)  # each tensor produced once, in order, when written
    header = read_header(file)
    assert list(header) == list(tensors)
    for name, expected in tensors.items():
        got = read_tensor(header[name])
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    assert list(tmp_path.iterdir()) == [file]


def test_the_safetensors_library_reads_it(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {n: a for n, a in arrays().items() if a.dtype in (np.float32, np.int32, np.int8)}
    file = write_safetensors(tmp_path / "x.safetensors", {n: (a.shape, a.dtype) for n, a in tensors.items()},
                             tensors.__getitem__)
    loaded = safetensors_numpy.load_file(str(file))
    assert set(loaded) == set(tensors)
    for name, expected in tensors.items():
        np.testing.assert_array_equal(loaded[name], expected)


def test_a_wrong_shape_leaves_no_file(tmp_path):
    layout = {"w": ((2, 2), np.dtype(np.float32))}
    with pytest.raises(CheckpointError, match=r"x.safetensors: tensor 'w' has shape \[3\], the layout says \[2, 2\]"):
        write_safetensors(tmp_path / "x.safetensors", layout, lambda name: np.zeros(3, np.float32))
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_dtype_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="complex64 has no safetensors equivalent"):
        write_safetensors(tmp_path / "x.safetensors", {"w": ((1,), np.dtype(np.complex64))}, lambda n: None)


@pytest.mark.parametrize("region", [
    (slice(None), slice(None), slice(None)),  # whole: one read from the file
    (slice(1, 3), slice(None), slice(None)),  # leading rows: one run
    (slice(2, 3), slice(1, 3), slice(None)),  # one index, then rows: one run
    (slice(None), slice(None), slice(2, 5)),  # a column range: strided, from the memory map
    (slice(0, 2), slice(1, 2), slice(None)),  # rows of a middle axis of two blocks: strided
    (slice(1, 1), slice(None), slice(None)),  # empty
])
def test_read_into_writes_any_region(tmp_path, region):
    w = np.random.default_rng(1).standard_normal((4, 3, 6)).astype(BF16)
    file = write_safetensors(tmp_path / "r.safetensors", {"w": (w.shape, w.dtype)}, lambda name: w)
    info = read_header(file)["w"]
    for dtype in (BF16, np.float32):  # the stored dtype (read straight in), or cast on the way
        out = np.full(w[region].shape, 7, dtype)
        read_into(info, region, out, map_file(file))
        np.testing.assert_array_equal(out, w[region].astype(dtype))


def test_read_into_names_a_truncated_file(tmp_path):
    w = np.arange(64, dtype=np.float32)
    file = write_safetensors(tmp_path / "t.safetensors", {"w": (w.shape, w.dtype)}, lambda name: w)
    info = read_header(file)["w"]
    with open(file, "r+b") as f:  # cut after the header was read
        f.truncate(info.end - 16)
    with pytest.raises(CheckpointError, match=r"t\.safetensors: truncated while reading tensor 'w'"):
        read_into(info, (slice(None),), np.empty(64, np.float32))


def test_prefetch_asks_for_ranges_in_the_order_given(tmp_path, monkeypatch):
    """The disk is asked for the tensors in reading order, not file order; ranges that continue one
    another become one request."""
    import os

    from dsr1.weights.safetensors_io import prefetch

    path = tmp_path / "x.safetensors"
    write_safetensors(path, {name: ((256,), np.float32) for name in "abcd"}, lambda name: np.zeros(256, np.float32))
    infos = read_header(path)
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, begin, size, advice: asked.append((begin, begin + size)),
                        raising=False)
    prefetch([infos["d"], infos["a"], infos["b"], infos["c"]])
    d, a, c = infos["d"], infos["a"], infos["c"]
    assert asked == [(d.begin, d.end), (a.begin, c.end)]


def test_region_runs_are_the_byte_runs_of_the_region():
    info = TensorInfo("w", Path("x"), "F32", (4, 6), 100, 100 + 4 * 6 * 4)
    np.testing.assert_array_equal(region_runs(info, (slice(1, 3), slice(2, 4))),
                                  [[100 + 8 * 4, 100 + 10 * 4], [100 + 14 * 4, 100 + 16 * 4]])
    np.testing.assert_array_equal(region_runs(info, (slice(1, 3),)), [[124, 172]])  # whole rows: one run
    np.testing.assert_array_equal(region_runs(info, ()), [[100, 196]])
    assert region_runs(info, (slice(2, 2),)).shape == (0, 2)
    np.testing.assert_array_equal(merged_ranges(np.array([[10, 20], [0, 5], [5, 8], [15, 30]])), [[0, 8], [10, 30]])
    np.testing.assert_array_equal(page_ranges(np.array([[10, 20], [4100, 4200]]), 4096), [[0, 8192]])
    log = ReadLog([(info, (slice(0, 2),)), (info, (slice(1, 3),)), (info, (slice(None), slice(0, 1)))])
    assert log.bytes() == 3 * 24 + 4  # rows 0-2 once, and row 3's first element
