"""Reading safetensors shards by memory map, with errors that name the file and tensor, and
writing them one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
`{dtype, shape, data_offsets}`, then the raw bytes. Reading through `numpy.memmap` lets a loader
touch only the tensors (and rows) it needs; FP8 and bf16 come from `ml_dtypes`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
MAX_HEADER_BYTES = 100 * 2**20
READ_CHUNK = 64 * 2**20  # bytes per read call: far above readahead, far below memory
PAGE_BYTES = 4096  # the page cache reads whole pages: any byte of one reads it all


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked, naming the file and tensor at fault."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor's description in one shard, checked against the file's real size."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            header_len = int.from_bytes(raw_len, "little")
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{file}: corrupt or truncated safetensors header "
                                      f"(claims {header_len} bytes, file has {size})")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing checkpoint shard") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    data_start = 8 + header_len
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(f"{file}: tensor {name!r} holds {end - begin} bytes, but {dtype}{list(shape)} "
                                  f"needs {expected}")
        if data_start + end > size:
            raise CheckpointError(f"{file}: truncated: tensor {name!r} ends at byte {data_start + end}, "
                                  f"file has {size}")
        tensors[name] = TensorInfo(name, file, dtype, shape, data_start + begin, data_start + end)
    return tensors


def map_file(file: Path) -> np.ndarray:
    """A whole shard as a read-only memory-mapped byte array, for `read_tensor(info, data)`. A plain
    ndarray over the map (which it keeps open): slicing a `np.memmap` costs a Python call per slice
    (~15% of dequantizing FP8 experts block by block)."""
    return np.memmap(file, dtype=np.uint8, mode="r").view(np.ndarray)


def read_tensor(info: TensorInfo, data: np.ndarray | None = None) -> np.ndarray:
    """The tensor as a read-only memory-mapped numpy array (no bytes are read until used): a view
    into `data` (its file from `map_file`, mapped once for all its tensors) or a map of its own."""
    dtype = DTYPES[info.dtype]
    if info.end == info.begin:
        return np.zeros(info.shape, dtype)
    if data is None:
        return np.memmap(info.file, dtype=dtype, mode="r", offset=info.begin, shape=info.shape)
    return data[info.begin:info.end].view(dtype).reshape(info.shape)


def read_into(info: TensorInfo, region: tuple[slice, ...], out: np.ndarray, data: np.ndarray | None = None,
              log: ReadLog | None = None) -> None:
    """Write `region` of the tensor into `out` (the region's shape). Where the region's bytes are one
    run of the file and `out` is a C-contiguous array of the tensor's dtype, they are read from the
    file straight into `out`: one copy, at the file's read speed (a copy out of the memory map runs
    at a fraction of it, its pages faulted in one by one). Otherwise they are copied (and cast to
    `out`'s dtype) from the memory map (`data`, as for `read_tensor`). `log` records the region read."""
    if log is not None:
        log.add(info, region)
    run = _byte_run(info.shape, region, DTYPES[info.dtype].itemsize)
    if run is not None and out.dtype == DTYPES[info.dtype] and out.flags.c_contiguous:
        _read_bytes(info, info.begin + run[0], out.reshape(-1).view(np.uint8))
    else:
        out[...] = read_tensor(info, data)[region]


def _byte_run(shape: tuple[int, ...], region: tuple[slice, ...], itemsize: int) -> tuple[int, int] | None:
    """(offset, size) in bytes of `region` of a C-ordered array when its bytes are one run, else None:
    every axis after the last partly selected one whole, every axis before it one index."""
    bounds = [s.indices(n) for s, n in zip(region, shape)] + [(0, n, 1) for n in shape[len(region):]]
    if any(step != 1 for _, _, step in bounds):
        return None
    strides = [itemsize * int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    partial = [i for i, (a, b, _) in enumerate(bounds) if (a, b) != (0, shape[i])]
    if not partial:
        return 0, itemsize * int(np.prod(shape, dtype=np.int64))
    last = partial[-1]
    if any(b - a != 1 for a, b, _ in bounds[:last]):
        return None
    offset = sum(a * stride for (a, _, _), stride in zip(bounds, strides))
    return offset, max(bounds[last][1] - bounds[last][0], 0) * strides[last]


def _read_bytes(info: TensorInfo, offset: int, out: np.ndarray) -> None:
    view = memoryview(out)
    with open(info.file, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + READ_CHUNK])
            if not n:
                raise CheckpointError(f"{info.file}: truncated while reading tensor {info.name!r}")
            done += n


def region_runs(info: TensorInfo, region: tuple[slice, ...]) -> np.ndarray:
    """The file's byte ranges holding `region` of the tensor: an `[n, 2]` array of absolute
    `[begin, end)` offsets in file order, runs that continue one another joined. A region that splits
    an inner axis (the columns of a row-major matrix) is one run per row it covers."""
    itemsize = DTYPES[info.dtype].itemsize
    shape = info.shape
    bounds = [s.indices(n) for s, n in zip(region, shape)] + [(0, n, 1) for n in shape[len(region):]]
    if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"{info.name}: region {region} has a step")
    if any(b <= a for a, b, _ in bounds):
        return np.zeros((0, 2), np.int64)
    strides = [itemsize * int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    partial = [i for i, (a, b, _) in enumerate(bounds) if (a, b) != (0, shape[i])]
    last = partial[-1] if partial else 0  # the axes after it are whole: each run spans them
    starts = np.array([info.begin + bounds[last][0] * strides[last]], np.int64)
    for (a, b, _), stride in zip(bounds[:last], strides[:last]):
        starts = (starts[:, None] + np.arange(a, b, dtype=np.int64)[None, :] * stride).reshape(-1)
    length = (bounds[last][1] - bounds[last][0]) * strides[last]
    return merged_ranges(np.stack([starts, starts + length], axis=1))


def merged_ranges(ranges: np.ndarray) -> np.ndarray:
    """`[n, 2]` byte ranges sorted, those that overlap or touch joined into one."""
    if len(ranges) == 0:
        return np.zeros((0, 2), np.int64)
    ranges = ranges[np.argsort(ranges[:, 0], kind="stable")]
    ends = np.maximum.accumulate(ranges[:, 1])
    first = np.flatnonzero(np.r_[True, ranges[1:, 0] > ends[:-1]])
    last = np.r_[first[1:] - 1, len(ranges) - 1]
    return np.stack([ranges[first, 0], ends[last]], axis=1)


def page_ranges(ranges: np.ndarray, page: int = PAGE_BYTES) -> np.ndarray:
    """`ranges` widened to whole pages and merged: what the page cache reads from the disk for them."""
    if len(ranges) == 0:
        return np.zeros((0, 2), np.int64)
    return merged_ranges(np.stack([ranges[:, 0] // page * page, -(-ranges[:, 1] // page) * page], axis=1))


def ranges_bytes(ranges: np.ndarray) -> int:
    return int((ranges[:, 1] - ranges[:, 0]).sum()) if len(ranges) else 0


@dataclasses.dataclass(frozen=True)
class ReadLog:
    """The tensor regions a load read (each process its own), appended as they are read: what it
    asked the disk for. Held as regions, not byte runs (a column split is one run per row)."""

    regions: list[tuple[TensorInfo, tuple[slice, ...]]] = dataclasses.field(default_factory=list)

    def add(self, info: TensorInfo, region: tuple[slice, ...]) -> None:
        self.regions.append((info, tuple(region)))  # one list append: safe from the loader's threads

    def tensor_runs(self) -> Iterator[tuple[TensorInfo, np.ndarray]]:
        """Each tensor read, with its byte runs read (merged), one tensor at a time (tensors do not
        overlap; a column split's run per row is held for one tensor at a time)."""
        by_tensor: dict[tuple[Path, str], list[tuple[TensorInfo, tuple[slice, ...]]]] = {}
        for info, region in self.regions:
            by_tensor.setdefault((info.file, info.name), []).append((info, region))
        for reads in by_tensor.values():
            yield reads[0][0], merged_ranges(np.concatenate([region_runs(*r) for r in reads]))

    def bytes(self, page: int | None = None) -> int:
        """Distinct bytes read, over every file; with `page`, in whole pages of that size (what the
        page cache reads from the disk for them)."""
        return sum(ranges_bytes(runs if page is None else page_ranges(runs, page)) for _, runs in self.tensor_runs())


def advise(ranges: list[tuple[Path, int, int]]) -> None:
    """Ask the kernel to start reading these byte ranges of their files now, in the background, in
    the order given (see `prefetch`); ranges that continue one another are merged."""
    if not hasattr(os, "posix_fadvise"):  # not Linux: no hint to give
        return
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for file, begin, end in ranges:
        if end > begin:
            by_file.setdefault(file, []).append((begin, end))
    for file, spans in by_file.items():
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue  # a hint only: reading the tensor reports the problem
        try:
            for begin, end in _merged(spans):
                os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def prefetch(infos: list[TensorInfo]) -> None:
    """Ask the kernel to start reading these tensors' bytes now, in the background, so that reading
    them later finds them in the page cache. A file's ranges are asked for in the order given, so
    list them as they will be read: a layer's `down` experts are all read before its `gate` experts, and
    a release shard interleaves them (in file order, the first expert would wait for the whole layer).
    Ranges that continue one another are merged."""
    advise([(info.file, info.begin, info.end) for info in infos])


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` in their order, each one that starts within the previous joined to it."""
    out = [ranges[0]]
    for begin, end in ranges[1:]:
        if out[-1][0] <= begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def safetensors_dtype(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype (`BF16` for `ml_dtypes.bfloat16`)."""
    for name, known in DTYPES.items():
        if known == np.dtype(dtype):
            return name
    raise CheckpointError(f"dtype {np.dtype(dtype)} has no safetensors equivalent")


def write_safetensors(file: Path, layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                      value: Callable[[str], np.ndarray], metadata: Mapping[str, str] | None = None) -> Path:
    """Write one shard tensor by tensor: `layout` maps each name to its (shape, dtype), and
    `value(name)` produces that tensor only when it is written, so host memory holds one tensor at a
    time. The file appears under its name only once complete (written beside it, then renamed)."""
    file = Path(file)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (shape, dtype) in layout.items():
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": safetensors_dtype(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned
    tmp = file.with_name(f".{file.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name, (shape, dtype) in layout.items():
                array = np.asarray(value(name))
                if array.shape != tuple(shape):
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {list(array.shape)}, the layout "
                                          f"says {list(shape)}")
                f.write(np.ascontiguousarray(array, dtype=dtype).tobytes())
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return file
