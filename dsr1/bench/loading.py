"""Loading throughput: `dsr1.load` of a release-layout FP8 checkpoint against the raw read bandwidth
of the same files, measured in the same run.

The checkpoint is written as the release is: one tensor per expert, every matmul weight in
float8 e4m3 with a float32 `weight_scale_inv` per 128x128 block, the rest in bf16, one shard per
layer. With `cold` caching, every file is synced and dropped from the page cache
(`posix_fadvise(DONTNEED)`) before each raw read and before each load, so both read from the disk
(or from whatever the disk caches below the kernel); `warm` reads the files once first and keeps
them cached, so both measure memory-speed reads and the loader's own work.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import re
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ..api import Model, load
from ..core.config import Config
from ..options import add_model_options, checkpoint_from_options, config_from_options, mesh_from_options
from ..weights.convert import convert
from ..weights.release import expected_tensors, fp8_scale_shape, quantize_fp8
from ..weights.safetensors_io import write_safetensors
from ..weights.store import CheckpointError, read_manifest
from ..weights.throughput import Throughput
from .bandwidth import device_description, with_final_load
from .compare_hf import _release_value
from .report import device_line

READ_BLOCK = 64 * 2**20  # large sequential reads: far above readahead, far below memory
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _shard_of(name: str) -> str:
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return f"layer-{int(layer.group(1)):04d}" if layer else "globals"


def write_fp8_checkpoint(folder: Path, cfg: Config, seed: int = 0) -> Path:
    """A random checkpoint in the release layout and precision (FP8 blocks with scales, the rest
    bf16), one shard per layer plus one for the global weights, with its index and `config.json`.
    Written tensor by tensor; each tensor depends on `seed` and its name only."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    expected = expected_tensors(cfg)
    shards: dict[str, dict[str, tuple[tuple[int, ...], np.dtype]]] = {}
    for name, e in sorted(expected.items()):
        layout = shards.setdefault(_shard_of(name), {})
        layout[name] = (e.shape, FP8 if e.fp8_in_release else BF16)
        if e.fp8_in_release:
            layout[name + "_scale_inv"] = (fp8_scale_shape(e.shape), np.dtype(np.float32))
    last: dict[str, np.ndarray] = {}  # the scale of the FP8 weight just written comes next

    def value(name: str) -> np.ndarray:
        if name in last:
            return last.pop(name)
        shape = expected[name].shape
        w = _release_value(name, shape, np.random.default_rng([seed, zlib.crc32(name.encode())]))
        if not expected[name].fp8_in_release:
            return w
        q, last[name + "_scale_inv"] = quantize_fp8(w)
        return q

    weight_map = {}
    for i, (shard, layout) in enumerate(sorted(shards.items())):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, layout, value)
        weight_map.update({n: file for n in layout})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    quantization = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "torch_dtype": "bfloat16",
                                                    "quantization_config": quantization}, indent=1))
    return folder


def checkpoint_files(folder: Path) -> list[Path]:
    """Every file a load of `folder` may read (shards, or a converted folder's unit files)."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def drop_page_cache(files: list[Path]) -> None:
    """Write back and evict the files' cached pages, so the next read goes to the disk."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(files: list[Path]) -> Throughput:
    """Read every file fully with large sequential reads into one reused buffer."""
    buffer = bytearray(READ_BLOCK)
    total = 0
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return Throughput(total, time.perf_counter() - start)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def reported_throughput() -> Iterator[list[Throughput]]:
    """Collect the `Throughput` each `dsr1.load` inside the block logs (logger `dsr1.weights`)."""
    logger = logging.getLogger("dsr1.weights")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    found: list[Throughput] = []
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        found += [r.throughput for r in handler.records if hasattr(r, "throughput")]


def timed_load(folder: Path, **kwargs: Any) -> tuple[Model, Throughput, float]:
    """`dsr1.load(folder, **kwargs)` until its weights are ready: the model, what the loader reported
    (the bytes it read) and the wall seconds of the whole call."""
    start = time.perf_counter()
    with reported_throughput() as reported:
        model = load(folder, progress=False, **kwargs)
        jax.block_until_ready(model.params)
    return model, reported[0], time.perf_counter() - start


def load_row(repeat: int, read: Throughput, loaded: Throughput, wall: float) -> dict[str, Any]:
    """One repeat: raw read, then load, of the same files."""
    return {"repeat": repeat, "read_gb": read.bytes / 1e9, "read_s": read.seconds, "read_gbs": read.gbps,
            "load_gb": loaded.bytes / 1e9, "load_s": wall, "load_gbs": loaded.bytes / wall / 1e9,
            "ratio": loaded.bytes / wall / read.gbps / 1e9}


def bench_load(folder: Path, repeats: int, cache: str, log: Any = print, **load_kwargs: Any) -> list[dict[str, Any]]:
    """Alternate a raw read of the folder's files and a `dsr1.load` of it, `repeats` times."""
    files = checkpoint_files(folder)
    if cache == "warm":
        read_bandwidth(files)
    rows = []
    for i in range(repeats):
        if cache == "cold":
            drop_page_cache(files)
        read = read_bandwidth(files)
        if cache == "cold":
            drop_page_cache(files)
        model, loaded, wall = timed_load(folder, **load_kwargs)
        del model
        rows.append(load_row(i + 1, read, loaded, wall))
        log(f"[{i + 1}/{repeats}] read {read.gbps:.2f} GB/s, load {rows[-1]['load_gbs']:.2f} GB/s "
            f"({rows[-1]['ratio']:.2f}x)")
    return rows


def profile_load(folder: Path, top: int, **load_kwargs: Any) -> str:
    """The `top` functions of one (warm) load by cumulative time, as cProfile prints them."""
    profiler = cProfile.Profile()
    profiler.runcall(timed_load, folder, **load_kwargs)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def load_table(rows: list[dict[str, Any]]) -> str:
    """The repeats as a Markdown table."""
    lines = ["| repeat | read GB | read GB/s | load s | load GB/s | load / read |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['repeat']} | {r['read_gb']:.3f} | {r['read_gbs']:.2f} | {r['load_s']:.2f} | {r['load_gbs']:.2f} "
              f"| {r['ratio']:.2f}x |" for r in rows]
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The `load` command's flags."""
    add_model_options(p, default_preset="bench")
    p.add_argument("--keep", metavar="DIR", help="write the random checkpoint to DIR and keep it (reused when DIR "
                   "already holds one); default: a temporary folder")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold",
                   help="cold: drop the files from the page cache before each read and each load; warm: keep them "
                        "cached (default: cold)")
    p.add_argument("--repeats", type=int, default=3, help="read-then-load rounds (default: 3)")
    p.add_argument("--converted", action="store_true",
                   help="also convert the checkpoint (`dsr1.convert`, dsr1's layout, same --dtype and --quant; "
                        "next to --keep's folder, reused when there) and measure its loads the same way")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one more load and print its N most expensive functions (default: 0, off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The `load` command: write (or take) a checkpoint, then alternate raw reads and loads of it."""
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    dev = device_description()
    load_kwargs = {"mesh": mesh_from_options(args), "dtype": args.dtype, "quant": args.quant}
    with tempfile.TemporaryDirectory(prefix="dsr1-load-") as tmp:
        path = checkpoint_from_options(args)  # also refuses --layers with --model
        if path and args.converted:
            raise SystemExit("--converted converts the random checkpoint this command writes; convert a real folder "
                             "with `python -m dsr1 convert` and pass the result to --model")
        if path:
            folder, name = Path(path), path
        else:
            cfg, name = config_from_options(args)
            folder = Path(args.keep or Path(tmp) / "checkpoint")
            if not (folder / "config.json").exists():
                _log(f"writing a random {name} checkpoint (release layout, FP8 blocks) to {folder} ...")
                write_fp8_checkpoint(folder, cfg, seed=args.seed)
        measured = _measure(folder, args, load_kwargs)
        converted = _measure(_converted(folder, args), args, load_kwargs) if args.converted else None
        profile = profile_load(folder, args.profile, **load_kwargs) if args.profile else None
    dev = with_final_load(dev)
    print(device_line(dev))
    print(f"checkpoint: {name}, {measured['files']} files; load as {args.dtype}{' int8' if args.quant else ''}; "
          f"{args.cache} page cache (see docs/benchmarks.md)\n")
    _print_measured(measured)
    if converted:
        print(f"\nconverted ({converted['files']} files):\n")
        _print_measured(converted)
    if profile:
        print("\n" + profile)
    return {"command": "load", "device": dev, "model": name, "dtype": args.dtype, "quant": args.quant,
            "cache": args.cache, **measured, "converted": converted, "profile": profile}


def _measure(folder: Path, args: argparse.Namespace, load_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The read-then-load rounds of one folder: its files, the rows and the best ratio."""
    files = checkpoint_files(folder)
    _log(f"{folder}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e9:.3f} GB; {args.cache} page cache")
    rows = bench_load(folder, args.repeats, args.cache, log=_log, **load_kwargs)
    return {"folder": str(folder), "files": len(files), "rows": rows,
            "best_ratio": max(r["ratio"] for r in rows)}


def _print_measured(measured: dict[str, Any]) -> None:
    best = max(measured["rows"], key=lambda r: r["ratio"])
    print(load_table(measured["rows"]))
    print(f"\nbest: load {best['load_gbs']:.2f} GB/s = {best['ratio']:.2f}x the raw read of the same files")


def _converted(folder: Path, args: argparse.Namespace) -> Path:
    """`folder` converted next to itself (`dsr1.convert`, same dtype and quant), reusing a finished conversion."""
    out = folder.with_name(folder.name + "-converted")
    try:
        read_manifest(out)  # finished, and of this version's format
    except CheckpointError:  # absent, unfinished, or an older format: converted (again)
        _log(f"converting to {out} ...")
        convert(folder, out, quant=args.quant, dtype=args.dtype, progress=False)
    return out
