"""`python -m dsr1 convert`: a HF release checkpoint to dsr1's format, or `--check` one.

    python -m dsr1 convert --hf DeepSeek-R1/ --out r1-int8/ --quant int8
    python -m dsr1 convert --hf DeepSeek-R1/ --out r1-bf16/                # no quantization, bfloat16
    python -m dsr1 convert --check --hf DeepSeek-R1/                       # names, shapes and dtypes
    python -m dsr1 convert --check --hf DeepSeek-V3.2/model.safetensors.index.json  # the index alone: names

Conversion streams one unit at a time (the global weights, then each layer, then the MTP module),
and within a layer one expert at a time, so peak host memory follows the largest layer, not the
model. It writes into `OUT.partial/`; an interrupted run started again with the same arguments
resumes after the last finished layer. `OUT` appears (or is replaced) only when everything is
written, so a failed run never leaves something `dsr1.load` would accept.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from ..core.config import Config
from ..core.params import ArrayInfo, is_spec, loading_units, param_specs, resolved_dtype, unit_specs
from ..core.quant import Int8Weight, check_quant, quantize
from . import store
from .release import (
    INDEX_FILE,
    CheckpointIndex,
    check_tensors,
    has_mtp_layer,
    read_region,
    tensor_bytes,
    unit_sources,
    unit_tensors,
    validate,
)
from .safetensors_io import CheckpointError
from .throughput import Throughput, path_bytes, rate

SETTINGS = "convert.json"  # in OUT.partial: the arguments a resumed run must share
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
log = logging.getLogger("dsr1.weights")


class ConversionError(RuntimeError):
    """Conversion failed; the message names the unit, its tensors and the path at fault."""


@dataclasses.dataclass(frozen=True)
class ConversionStats:
    """What one run of the converter moved: `read` (the release tensors' bytes, FP8 scales included)
    and `written` (the unit files), both over the run's wall seconds. Units finished by
    an earlier, interrupted run are neither read nor written again, so they do not count."""

    read: Throughput
    written: Throughput

    def __str__(self) -> str:
        return f"read {self.read}, wrote {self.written}"


def _is_weight(x: Any) -> bool:
    return is_spec(x) or isinstance(x, Int8Weight)


def _host_weight(index: CheckpointIndex, spec: ArrayInfo, target: Any, src, layer: int, dtype: Any) -> Any:
    """One weight of one layer as numpy in the target precision, read (and quantized) expert by expert."""
    def convert(w: np.ndarray) -> Any:
        if isinstance(target, Int8Weight):
            return quantize(w, target.input_axes)
        return w.astype(resolved_dtype(target, dtype))

    full = tuple(slice(None) for _ in spec.shape)
    if not src.per_expert:
        return convert(read_region(index, src, spec.shape, layer, full, np.float32))
    out = None
    for e in range(spec.shape[0]):
        part = convert(read_region(index, src, spec.shape, layer, (slice(e, e + 1), *full[1:]), np.float32))
        if out is None:
            out = jax.tree.map(lambda p: np.empty((spec.shape[0], *p.shape[1:]), p.dtype), part)
        jax.tree.map(lambda o, p: o.__setitem__(slice(e, e + 1), p), out, part)
    if isinstance(target, Int8Weight):
        return Int8Weight(out.q, out.scale, target.input_axes)
    return out


def _unit_tree(index: CheckpointIndex, cfg: Config, unit: str, layer: int | None, quant: str | None,
               dtype: Any) -> Any:
    target = unit_specs(param_specs(cfg, quant, mtp=True), unit)
    targets = jax.tree.leaves(target, is_leaf=_is_weight)
    weights = [_host_weight(index, spec, t, src, 0 if layer is None else layer, dtype)
               for (spec, src), t in zip(unit_sources(cfg, unit, mtp=True), targets)]
    return jax.tree.unflatten(jax.tree.structure(target, is_leaf=_is_weight), weights)


def _release_memory() -> None:
    """Hand freed layer buffers back to the OS. Without this, glibc keeps them in its arenas and the
    resident size creeps up layer after layer, although nothing is retained."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _prepare_partial(partial: Path, settings: dict[str, Any]) -> None:
    if partial.exists():
        try:
            previous = store.read_json_file(partial / SETTINGS)
        except CheckpointError:
            previous = None
        if previous == settings:
            return
        print(f"{partial}: left by a run with other arguments; starting over", file=sys.stderr)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    store.write_json(partial / SETTINGS, settings)


def _replace(out: Path, partial: Path) -> None:
    """Swap the finished folder into place; an earlier conversion at `out` is removed only after."""
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(partial, out)
    if old.exists():
        shutil.rmtree(old)


def convert(hf: str | Path, out: str | Path, *, quant: str | None = None, dtype: str = "bfloat16",
            mtp: bool = True, progress: bool = True) -> Path:
    """Convert the HF checkpoint folder `hf` to `out` (a safetensors file per unit in our layout, see
    `store`). `quant="int8"` stores the matmul weights as int8 with per-output-channel scales; every
    other weight (all of them with `quant=None`) is stored in `dtype`.

    Throughput: the progress bar shows the bytes read and GB/s read and written as it goes; at the
    end the logger `dsr1.weights` logs (INFO) a `ConversionStats` as the record's `conversion`
    attribute (see `convert_with_stats` to get it returned)."""
    return convert_with_stats(hf, out, quant=quant, dtype=dtype, mtp=mtp, progress=progress)[0]


def convert_with_stats(hf: str | Path, out: str | Path, *, quant: str | None = None, dtype: str = "bfloat16",
                       mtp: bool = True, progress: bool = True) -> tuple[Path, ConversionStats]:
    """`convert`, returning the output folder and the bytes read and written per second."""
    start = time.perf_counter()
    hf, out = Path(hf), Path(out)
    quant = check_quant(quant)
    cfg = Config.from_hf(hf)
    if out.exists() and not store.is_converted(out):
        raise ConversionError(f"--out {out} exists and is not a dsr1 checkpoint; refusing to replace it")
    index = CheckpointIndex.open(hf)
    if mtp and cfg.num_nextn_predict_layers and not has_mtp_layer(index, cfg):
        log.warning("%s holds no MTP layer (model.layers.%d.*): converting without the MTP module", hf,
                    cfg.num_hidden_layers)
    mtp = mtp and has_mtp_layer(index, cfg)
    validate(index, cfg, mtp=mtp)
    partial = out.with_name(out.name + ".partial")
    settings = {"hf": str(hf.resolve()), "quant": quant, "dtype": dtype, "mtp": mtp}
    _prepare_partial(partial, settings)

    units = loading_units(cfg, param_specs(cfg, mtp=mtp))
    sizes = [tensor_bytes(index, unit_tensors(index, cfg, *u)) for u in units]
    read = written = 0
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"converting {hf.name}", disable=not progress) as bar:
        for i, ((unit, layer), size) in enumerate(zip(units, sizes)):
            dest = partial / store.unit_file(unit, layer)
            seconds = time.perf_counter() - start
            bar.set_postfix_str(f"unit {i + 1}/{len(units)} {store.unit_file(unit, layer)}, "
                                f"read {rate(read, seconds)}, write {rate(written, seconds)}")
            if not dest.exists():  # finished by an earlier, interrupted run
                if i + 1 < len(units):  # the disk reads the next unit while this one is converted
                    index.prefetch(unit_tensors(index, cfg, *units[i + 1]))
                tree = _unit_tree(index, cfg, unit, layer, quant, dtype)
                try:
                    store.save_unit(dest, tree)
                except OSError as e:
                    tensors = unit_tensors(index, cfg, unit, layer)
                    raise ConversionError(f"writing {dest} ({len(tensors)} tensors, e.g. {tensors[0]!r}) failed: {e}; "
                                          f"run again with the same arguments to resume") from e
                del tree
                _release_memory()
                read, written = read + size, written + path_bytes([dest])
            bar.update(size)
    try:
        shutil.copyfile(hf / "config.json", partial / "config.json")
        for name in TOKENIZER_FILES:  # the converted model keeps the release's tokenizer (Model.tokenizer)
            if (hf / name).is_file():
                shutil.copyfile(hf / name, partial / name)
        manifest = {"format": store.FORMAT, "version": store.VERSION, "quant": quant, "dtype": dtype, "mtp": mtp,
                    "units": [store.unit_file(*u) for u in units]}
        store.write_json(partial / store.MANIFEST, manifest)
        (partial / SETTINGS).unlink()
        _replace(out, partial)
    except OSError as e:
        raise ConversionError(f"finishing {out} failed: {e}; run again with the same arguments to resume") from e
    seconds = time.perf_counter() - start
    stats = ConversionStats(Throughput(read, seconds), Throughput(written, seconds))
    log.info("converted %s to %s: %s", hf, out, stats, extra={"conversion": stats})
    return out, stats


def check(path: str | Path, config: str | Path | None = None) -> list[str]:
    """Validate a checkpoint folder or index file against its config without reading weights:
    every tensor mapped, every shape as the config predicts, nothing missing or extra. The MTP
    layer is checked where the checkpoint holds it (`has_mtp_layer`)."""
    index, cfg = _checked(path, config)
    return check_tensors(index, cfg, mtp=has_mtp_layer(index, cfg), strict=True)


def _checked(path: str | Path, config: str | Path | None) -> tuple[CheckpointIndex, Config]:
    """The tensors `--check` compares (a folder's, or an index file's listing) and their config."""
    path = Path(path)
    if path.is_dir():
        index = CheckpointIndex.open(path)
    elif path.name.endswith((".json", ".json.gz")) and not path.name.startswith(INDEX_FILE):
        index = CheckpointIndex.from_shape_index(path)
    elif path.name == INDEX_FILE and not any(path.parent.glob("*.safetensors")):
        index = CheckpointIndex.from_weight_map(path)  # the release's index alone: its names
    else:
        index = CheckpointIndex.open(path.parent)
    return index, Config.from_hf(config or (path if path.is_dir() else path.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsr1 convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap, ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The converter's flags (also the `convert` subcommand of `python -m dsr1`)."""
    ap.add_argument("--hf", required=True, metavar="DIR_OR_INDEX",
                    help="HF checkpoint folder (release layout); with --check also an index file: a listing of "
                         "shapes and dtypes, or a model.safetensors.index.json without its shards (names only)")
    ap.add_argument("--out", metavar="DIR", help="output folder (written as DIR.partial, then renamed)")
    ap.add_argument("--quant", choices=["none", "int8"], default="none",
                    help="int8: matmul weights as int8 with per-output-channel scales; none: no quantization "
                         "(default)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="dtype of every weight that is not quantized (default: bfloat16)")
    ap.add_argument("--no-mtp", action="store_true", help="leave out the multi-token-prediction module")
    ap.add_argument("--check", action="store_true", help="only validate --hf against its config, reading no weights")
    ap.add_argument("--config", help="config.json for --check (default: next to --hf)")


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Convert or check as the parsed flags say; errors are printed, naming the file or tensor."""
    try:
        if args.check:
            index, cfg = _checked(args.hf, args.config)
            problems = check_tensors(index, cfg, mtp=has_mtp_layer(index, cfg), strict=True)
            for p in problems:
                print(p)
            if cfg.num_nextn_predict_layers and not has_mtp_layer(index, cfg):
                print(f"(no MTP layer model.layers.{cfg.num_hidden_layers}.*: checked the model without it)")
            if not index.shapes_known:
                print(f"(names only: no shards beside {args.hf}, so shapes and dtypes were not checked)")
            print(f"{args.hf}: {'OK' if not problems else f'{len(problems)} problems'}")
            return 1 if problems else 0
        if not args.out:
            ap.error("--out is required unless --check")
        out, stats = convert_with_stats(args.hf, args.out, quant=None if args.quant == "none" else args.quant,
                                        dtype=args.dtype, mtp=not args.no_mtp)
        print(f"wrote {out}: {stats}")
        return 0
    except (CheckpointError, ConversionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

