"""The HF checkpoint in the DeepSeek *release layout*: which tensor feeds which weight, and reading.

Release layout: one tensor per expert (`model.layers.L.mlp.experts.E.gate_proj.weight`), linear
weights `[out, in]`, float8 e4m3 with a `weight_scale_inv` per 128x128 block (edge blocks
partial) for every matmul weight but the MTP projection and heads (and V3.2's indexer
`weights_proj`), and the MTP module stored as layer `num_hidden_layers`.

What transformers' `save_pretrained` writes for `deepseek_v3` and `deepseek_v32` is this layout
without the MTP layer (transformers has no MTP module); with `save_original_format=False` its routed
experts are fused, one `mlp.experts.gate_up_proj [E, 2f, d]` and `mlp.experts.down_proj [E, d, f]`
per layer. `CheckpointIndex` reads those as the per-expert tensors they hold (`per_expert_view`).

`read_region_into` writes any region of one layer's weight in our layout into a host buffer,
reading only the experts it covers from memory-mapped shards: the loader asks it for each device
region (`read_region` returns a new array: the converter's form). For accelerators the loader reads
FP8 routed experts as stored instead (`Fp8Experts`, `read_stored_into`) and the
devices dequantize them (`dequantize_experts`).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..core.config import Config
from ..core.params import ArrayInfo, float_specs, is_spec, loading_units, unit_specs
from ..host import copy as host_copy
from .safetensors_io import DTYPES, CheckpointError, ReadLog, TensorInfo, map_file, prefetch, read_header, read_tensor

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Every e4m3 byte's value: a table lookup, cheaper than ml_dtypes' element-wise cast.
FP8_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
FP8_VALUES.flags.writeable = False
INDEX_FILE = "model.safetensors.index.json"
OPEN_MAPS = 2  # shards kept mapped: the loader and converter go layer by layer, a layer in a shard or two
FLOAT_DTYPES = ("F32", "F16", "BF16")
FP8_DTYPES = ("F8_E4M3",)
# Tensors some releases carry that no model reads: RoPE frequency buffers (Kimi-K2 saves one per
# layer; HF transformers recomputes them and ignores the saved ones). Not "unexpected" for --check.
IGNORED_TENSORS = (".rotary_emb.inv_freq",)
# transformers' fused routed experts (`save_pretrained(save_original_format=False)`): per layer, the
# release tensors each holds, in the order its rows hold them.
FUSED_EXPERTS = {".mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), ".mlp.experts.down_proj": ("down_proj",)}


# ---- where each weight comes from ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    """How one of our weights (one layer's slice, for stacked ones) is read from the checkpoint.

    `name` is the HF tensor name (with `{layer}` and `{expert}` placeholders), `hf_shape` its shape,
    `to_ours` turns the HF tensor into our layout (before the final reshape to our shape).
    """

    name: str
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    per_expert: bool = False
    # The tensor's rows come in blocks of this many per head (`kv_b_proj`: each head's nope rows,
    # then its value rows); `to_ours` takes any run of whole heads. None: `to_ours` is `_same` or
    # `_transposed` (then a reshape to our shape) and maps regions axis by axis (`tensor_region`).
    rows_per_head: int | None = None


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _transposed(w: np.ndarray) -> np.ndarray:
    return w.T


def _attention_sources(cfg: Config) -> dict[str, Source]:
    d, h, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    kv_b_shape = (h * (nope + v), r)
    pre = "model.layers.{layer}."
    sources = {
        "attn_norm": Source(pre + "input_layernorm.weight", (d,), _same),
        "mlp_norm": Source(pre + "post_attention_layernorm.weight", (d,), _same),
        "kv_a": Source(pre + "self_attn.kv_a_proj_with_mqa.weight", (r + rope, d), _transposed),
        "kv_a_norm": Source(pre + "self_attn.kv_a_layernorm.weight", (r,), _same),
        "wk_b": Source(pre + "self_attn.kv_b_proj.weight", kv_b_shape,
                       lambda w: w.reshape(-1, nope + v, w.shape[-1])[:, :nope], rows_per_head=nope + v),
        "wv_b": Source(pre + "self_attn.kv_b_proj.weight", kv_b_shape,
                       lambda w: w.reshape(-1, nope + v, w.shape[-1])[:, nope:], rows_per_head=nope + v),
        "o": Source(pre + "self_attn.o_proj.weight", (d, h * v), _transposed),
    }
    if cfg.q_lora_rank is None:
        sources["q"] = Source(pre + "self_attn.q_proj.weight", (h * cfg.qk_head_dim, d), _transposed)
    else:
        q = cfg.q_lora_rank
        sources["q_a"] = Source(pre + "self_attn.q_a_proj.weight", (q, d), _transposed)
        sources["q_a_norm"] = Source(pre + "self_attn.q_a_layernorm.weight", (q,), _same)
        sources["q_b"] = Source(pre + "self_attn.q_b_proj.weight", (h * cfg.qk_head_dim, q), _transposed)
    if cfg.sparse_attention:
        sources["indexer"] = _indexer_sources(cfg)
    return sources


def _indexer_sources(cfg: Config) -> dict[str, Source]:
    """V3.2's indexer tensors (the release's names, which transformers' `deepseek_v32` keeps)."""
    d, hi, di, pre = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, "model.layers.{layer}.self_attn.indexer."
    return {
        "wq_b": Source(pre + "wq_b.weight", (hi * di, cfg.q_lora_rank), _transposed),
        "wk": Source(pre + "wk.weight", (di, d), _transposed),
        "k_norm": Source(pre + "k_norm.weight", (di,), _same),
        "k_norm_bias": Source(pre + "k_norm.bias", (di,), _same),
        "weights_proj": Source(pre + "weights_proj.weight", (hi, d), _transposed),
    }


def _mlp_sources(prefix: str, d: int, f: int, per_expert: bool = False) -> dict[str, Source]:
    return {
        "gate": Source(prefix + "gate_proj.weight", (f, d), _transposed, per_expert),
        "up": Source(prefix + "up_proj.weight", (f, d), _transposed, per_expert),
        "down": Source(prefix + "down_proj.weight", (d, f), _transposed, per_expert),
    }


def _moe_sources(cfg: Config) -> dict[str, Any]:
    d, e, pre = cfg.hidden_size, cfg.n_routed_experts, "model.layers.{layer}.mlp."
    sources: dict[str, Any] = {
        "router": Source(pre + "gate.weight", (e, d), _transposed),
        "router_bias": Source(pre + "gate.e_score_correction_bias", (e,), _same),
        **_mlp_sources(pre + "experts.{expert}.", d, cfg.moe_intermediate_size, per_expert=True),
    }
    if cfg.n_shared_experts:
        sources["shared"] = _mlp_sources(pre + "shared_experts.", d, cfg.shared_intermediate_size)
    return sources


def _mtp_sources(cfg: Config) -> dict[str, Any]:
    d, v, pre = cfg.hidden_size, cfg.vocab_size, "model.layers.{layer}."
    return {
        "embed": Source(pre + "embed_tokens.weight", (v, d), _same),
        "enorm": Source(pre + "enorm.weight", (d,), _same),
        "hnorm": Source(pre + "hnorm.weight", (d,), _same),
        "eh_proj": Source(pre + "eh_proj.weight", (d, 2 * d), _transposed),
        "block": {**_attention_sources(cfg), "moe": _moe_sources(cfg)},
        "head_norm": Source(pre + "shared_head.norm.weight", (d,), _same),
        "head": Source(pre + "shared_head.head.weight", (v, d), _transposed),
    }


def weight_sources(cfg: Config, *, mtp: bool = False) -> dict[str, Any]:
    """A pytree shaped like `float_specs(cfg)` whose leaves say which checkpoint tensor feeds them."""
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    sources: dict[str, Any] = {
        "embed": Source("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), _same),
        "final_norm": Source("model.norm.weight", (cfg.hidden_size,), _same),
        "lm_head": Source(head, (cfg.vocab_size, cfg.hidden_size), _transposed),
    }
    if cfg.num_dense_layers:
        sources["dense_layers"] = {**_attention_sources(cfg),
                                   "mlp": _mlp_sources("model.layers.{layer}.mlp.", cfg.hidden_size,
                                                       cfg.intermediate_size)}
    if cfg.num_moe_layers:
        sources["moe_layers"] = {**_attention_sources(cfg), "moe": _moe_sources(cfg)}
    if mtp and cfg.num_nextn_predict_layers:
        sources["mtp"] = _mtp_sources(cfg)
    return sources


def is_source(x: Any) -> bool:
    return isinstance(x, Source)


def unit_sources(cfg: Config, unit: str, *, mtp: bool = False) -> list[tuple[ArrayInfo, Source]]:
    """(declaration, source) pairs of one loading unit: "globals" or a stack (declarations per layer)."""
    specs, sources = float_specs(cfg, mtp=mtp), weight_sources(cfg, mtp=mtp)
    declared = unit_specs(specs, unit)
    fed_by = {k: sources[k] for k in declared} if unit == "globals" else sources[unit]
    return list(zip(jax.tree.leaves(declared, is_leaf=is_spec), jax.tree.leaves(fed_by, is_leaf=is_source)))


def unit_tensors(index: CheckpointIndex, cfg: Config, unit: str, layer: int | None) -> list[str]:
    """The checkpoint tensors one loading unit reads, each named once, in the order it reads them
    (each FP8 weight followed by its scales: `safetensors_io.prefetch` asks for them so)."""
    names = []
    for _, src in unit_sources(cfg, unit, mtp=True):
        experts = range(cfg.n_routed_experts) if src.per_expert else range(1)
        names += [src.name.format(layer=layer, expert=e) for e in experts]
    names = list(dict.fromkeys(names))  # kv_b_proj feeds two weights
    return [m for n in names for m in (n, n + "_scale_inv") if m == n or m in index.tensors]


def tensor_regions(src: Source, shape: tuple[int, ...], layer: int, region: tuple[slice, ...]
                   ) -> list[tuple[str, tuple[slice, ...] | None]]:
    """The checkpoint tensors `region` of one layer's weight (`shape`, our layout) is read from, each
    with the region of it that is read (None: all of it). FP8 scales not included."""
    region = _whole(region, shape)
    if src.per_expert:
        inner = tensor_region(src, shape[1:], region[1:])
        return [(src.name.format(layer=layer, expert=e), inner) for e in range(shape[0])[region[0]]]
    return [(src.name.format(layer=layer), tensor_region(src, shape, region))]


def tensor_region(src: Source, shape: tuple[int, ...], region: tuple[slice, ...]) -> tuple[slice, ...] | None:
    """The box of `src`'s tensor that holds `region` of our weight (one layer, one expert, `shape`),
    or None where the region is not one box of it (then the whole tensor is read)."""
    region = _whole(region, shape)
    if src.rows_per_head is not None:  # whole heads' rows; our last axis is the tensor's columns
        heads = range(shape[0])[region[0]]
        return slice(heads.start * src.rows_per_head, heads.stop * src.rows_per_head), region[-1]
    if src.to_ours is _same:
        return region if shape == src.hf_shape else None
    if src.to_ours is _transposed and len(src.hf_shape) == 2:
        rows, cols = src.hf_shape  # ours is the transpose reshaped: leading axes flatten to its columns
        split = next((k for k in range(len(shape) + 1) if math.prod(shape[:k]) == cols), None)
        if split is None:
            return None
        along_cols, along_rows = _flat_slice(shape[:split], region[:split]), _flat_slice(shape[split:], region[split:])
        return None if along_cols is None or along_rows is None else (along_rows, along_cols)
    return None


def _whole(region: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`region` with a slice per axis, steps of 1 and bounds resolved."""
    region = tuple(region) + (slice(None),) * (len(shape) - len(region))
    bounds = [r.indices(n) for r, n in zip(region, shape)]
    if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"region {region} has a step")
    return tuple(slice(a, max(a, b)) for a, b, _ in bounds)


def _flat_slice(shape: tuple[int, ...], region: tuple[slice, ...]) -> slice | None:
    """The flat index range `region` covers in a C-ordered array of `shape` when it is one range:
    every axis after the first partly selected one whole, every axis before it one index."""
    flat = np.ravel_multi_index
    if not shape:
        return slice(0, 1)
    partial = [i for i, (r, n) in enumerate(zip(region, shape)) if (r.start, r.stop) != (0, n)]
    if partial and any(r.stop - r.start != 1 for r in region[:partial[0]]):
        return None
    if partial and any((r.start, r.stop) != (0, n) for r, n in zip(region[partial[0] + 1:], shape[partial[0] + 1:])):
        return None
    if any(r.stop <= r.start for r in region):
        return slice(0, 0)
    first = flat(tuple(r.start for r in region), shape)
    return slice(int(first), int(flat(tuple(r.stop - 1 for r in region), shape)) + 1)


def fp8_scale_region(region: tuple[slice, ...]) -> tuple[slice, slice]:
    """The block scales `region` of a 2-D FP8 weight needs (its 128x128 blocks, edge blocks partial)."""
    (r0, r1), (c0, c1) = ((r.start, r.stop) for r in region)
    return slice(r0 // FP8_BLOCK, -(-r1 // FP8_BLOCK)), slice(c0 // FP8_BLOCK, -(-c1 // FP8_BLOCK))


def tensor_bytes(index: CheckpointIndex, names: list[str]) -> int:
    """Bytes the named tensors occupy in their shards."""
    return sum(index.tensors[n].end - index.tensors[n].begin for n in names)


@dataclasses.dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    # The release stores exactly the int8-quantizable matmul weights in FP8 with a weight_scale_inv
    # (not the router, lm_head, or the MTP projection and head).
    fp8_in_release: bool


def expected_tensors(cfg: Config, *, mtp: bool = False) -> dict[str, Expected]:
    """Every checkpoint tensor the model reads (scales excluded), with its HF shape."""
    out: dict[str, Expected] = {}
    for unit, layer in loading_units(cfg, float_specs(cfg, mtp=mtp)):
        for spec, src in unit_sources(cfg, unit, mtp=mtp):
            experts = range(cfg.n_routed_experts) if src.per_expert else range(1)
            for e in experts:
                out[src.name.format(layer=layer, expert=e)] = Expected(src.hf_shape, spec.input_axes is not None)
    return out


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK)


# ---- the checkpoint folder ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a safetensors checkpoint, from its shards' headers (or, for `--check`, from an
    index file that lists shapes and dtypes, such as `model.safetensors.index-with-shapes.json.gz`)."""

    folder: Path
    tensors: dict[str, TensorInfo]
    # The shards in use, each mapped once (mapping per tensor costs more than reading a small one);
    # only the last OPEN_MAPS stay mapped: a mapped file's pages count in the process's memory.
    maps: dict[Path, np.ndarray] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    maps_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False, repr=False)
    log: ReadLog = dataclasses.field(default_factory=ReadLog, compare=False, repr=False)  # what was read
    # False for `from_weight_map`: the names alone (shapes and dtypes unknown, nothing readable).
    shapes_known: bool = True

    @classmethod
    def open(cls, folder: str | Path) -> CheckpointIndex:
        folder = Path(folder)
        index_file = folder / INDEX_FILE
        if index_file.exists():
            weight_map = _read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_file}: not a safetensors index (no weight_map)")
            files = sorted({folder / f for f in weight_map.values()})
        else:
            weight_map = {}
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX_FILE}")
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file} and {file}")
                tensors[name] = info
        for name, file in weight_map.items():
            if name not in tensors or tensors[name].file.name != Path(file).name:
                raise CheckpointError(f"{index_file}: maps tensor {name!r} to {file}, which does not hold it")
        return cls(folder, per_expert_view(tensors))

    @classmethod
    def from_shape_index(cls, index_file: str | Path) -> CheckpointIndex:
        """An index listing `{name: {shape, dtype, file}}` (plain or gzipped JSON): no weights needed."""
        index_file = Path(index_file)
        raw = _read_json(index_file)
        tensors = {}
        for name, meta in raw.items():
            try:
                tensors[name] = TensorInfo(name, index_file.parent / meta["file"], meta["dtype"], tuple(meta["shape"]),
                                           -1, -1)
            except (KeyError, TypeError):
                raise CheckpointError(f"{index_file}: entry {name!r} lacks shape/dtype/file") from None
        return cls(index_file.parent, per_expert_view(tensors))

    @classmethod
    def from_weight_map(cls, index_file: str | Path) -> CheckpointIndex:
        """The tensors a release's `model.safetensors.index.json` names, without its shards: for
        `--check` of the names alone (the index a release publishes lists no shapes)."""
        index_file = Path(index_file)
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_file}: not a safetensors index (no weight_map)")
        tensors = {name: TensorInfo(name, index_file.parent / str(file), "", (), -1, -1)
                   for name, file in weight_map.items()}
        return cls(index_file.parent, tensors, shapes_known=False)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: checkpoint has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor (or `region` of it), memory-mapped; FP8 weights come back dequantized per
        128x128 block (float32), only the blocks of `region` read."""
        info = self.info(name)
        region = _whole(() if region is None else region, info.shape)
        w = self.mapped(info, region)
        if info.dtype in FP8_DTYPES and len(info.shape) == 2:
            scale = self.mapped(self.info(name + "_scale_inv"), fp8_scale_region(region))
            out = np.empty(_region_shape(info.shape, region), np.float32)
            dequantize_fp8_into(out, w, scale, region, f"{info.file.name}: {name}")
            return out
        return w[region]

    def mapped(self, info: TensorInfo, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """The whole tensor memory-mapped (no bytes read yet), `region` of it logged as read (None: all
        of it): the caller reads that region only."""
        self.log.add(info, _whole(() if region is None else region, info.shape))
        return self._map(info)

    def _map(self, info: TensorInfo) -> np.ndarray:
        with self.maps_lock:  # experts are read in threads (`read_region_into`)
            data = self.maps.pop(info.file, None)
            data = self.maps[info.file] = map_file(info.file) if data is None else data  # the most recent last
            while len(self.maps) > OPEN_MAPS:
                self.maps.pop(next(iter(self.maps)))
        return read_tensor(info, data)

    def prefetch(self, names: list[str]) -> None:
        """Start reading these tensors in the background (see `safetensors_io.prefetch`)."""
        prefetch([self.tensors[n] for n in names if n in self.tensors])


def per_expert_view(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """`tensors` with transformers' fused routed experts (`FUSED_EXPERTS`) replaced by the release's
    per-expert tensors they hold: `experts.E.gate_proj.weight` is rows `[0, f)` of `gate_up_proj[E]`,
    `up_proj` rows `[f, 2f)`, `down_proj` is `down_proj[E]`, and likewise their FP8 block scales
    (`gate_up_proj_scale_inv`). Each is one run of bytes of its file, so it is read, prefetched and
    logged as a release tensor is."""
    out: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        parts = {name: info}
        for fused, held in FUSED_EXPERTS.items():
            if name.endswith(fused):
                parts = _fused_parts(name[:-len(fused)], info, held, ".weight")
            elif name.endswith(fused + "_scale_inv"):
                _check_scales_split(info, tensors.get(name[:-len("_scale_inv")]), len(held))
                parts = _fused_parts(name[:-len(fused + "_scale_inv")], info, held, ".weight_scale_inv")
        for part, part_info in parts.items():
            if part in out:
                raise CheckpointError(f"tensor {part!r} is held twice: in {out[part].file.name} and in "
                                      f"{info.file.name} (as {name!r})")
            out[part] = part_info
    return out


def _check_scales_split(scales: TensorInfo, weight: TensorInfo | None, parts: int) -> None:
    """Fused FP8 experts' block scales split into each part's only where no 128-row block holds the
    rows of two parts (gate and up: f a multiple of 128)."""
    rows = None if weight is None or len(weight.shape) != 3 else weight.shape[1] // parts
    if rows is None or (parts > 1 and rows % FP8_BLOCK):
        raise CheckpointError(f"{scales.file.name}: {scales.name!r} cannot be split per expert: its weight "
                              f"{'is missing' if rows is None else f'has {rows} rows per part'}, and each "
                              f"part needs whole {FP8_BLOCK}-row blocks of scales; save the model with "
                              f"save_pretrained(save_original_format=True)")


def _fused_parts(layer: str, info: TensorInfo, parts: tuple[str, ...], suffix: str) -> dict[str, TensorInfo]:
    """The per-expert tensors `layer.mlp.experts.E.{part}{suffix}` of one fused tensor `[E, rows, cols]`
    whose rows hold `parts` one after another."""
    if len(info.shape) != 3 or info.shape[1] % len(parts):
        raise CheckpointError(f"{info.file.name}: fused expert tensor {info.name!r} has shape {list(info.shape)}, "
                              f"expected [experts, {' + '.join(['rows'] * len(parts))}, columns]")
    experts, rows, cols = info.shape[0], info.shape[1] // len(parts), info.shape[2]
    size = rows * cols * DTYPES[info.dtype].itemsize
    out = {}
    for e in range(experts):
        for k, part in enumerate(parts):
            begin = info.begin + (e * len(parts) + k) * size if info.begin >= 0 else info.begin  # -1: a listing
            name = f"{layer}.mlp.experts.{e}.{part}{suffix}"
            out[name] = dataclasses.replace(info, name=name, shape=(rows, cols), begin=begin,
                                            end=begin + size if info.begin >= 0 else info.end)
    return out


def _read_json(file: Path) -> dict:
    try:
        opener = gzip.open if file.suffix == ".gz" else open
        with opener(file, "rt") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, name: str = "weight") -> np.ndarray:
    """`W = fp8 * scale_inv` blockwise over 128x128 blocks (edge blocks are partial)."""
    out = np.empty(w.shape, np.float32)
    dequantize_fp8_into(out, w, scale_inv, (slice(None), slice(None)), name)
    return out


def dequantize_fp8_into(out: np.ndarray, w: np.ndarray, scale_inv: np.ndarray, region: tuple[slice, slice],
                        name: str = "weight") -> None:
    """Write `(fp8 * scale_inv)[region]` into `out` (any dtype, any strides: a transposed view
    writes the transpose), one 128x128 block at a time. Each block is a lookup in the 256 values of
    its scaled e4m3 table, computed in float32 and cast once: the same numbers as multiplying in
    float32 then casting, in one pass and with no full-size intermediate."""
    rows, cols = w.shape
    want = fp8_scale_shape(w.shape)
    if scale_inv.shape != want:
        raise CheckpointError(f"{name}_scale_inv: shape {list(scale_inv.shape)}, expected {list(want)} for "
                              f"{FP8_BLOCK}x{FP8_BLOCK} blocks of a {rows}x{cols} weight")
    (r0, r1, step_r), (c0, c1, step_c) = region[0].indices(rows), region[1].indices(cols)
    if (step_r, step_c) != (1, 1) or out.shape != (max(r1 - r0, 0), max(c1 - c0, 0)):
        raise ValueError(f"{name}: region {region} of a {rows}x{cols} weight does not fit an output of {out.shape}")
    i0, i1, j0, j1 = r0 // FP8_BLOCK, -(-r1 // FP8_BLOCK), c0 // FP8_BLOCK, -(-c1 // FP8_BLOCK)
    # The region's tables in one numpy call, not one per block (4.5 -> 4.1 ns per value).
    tables = (FP8_VALUES * scale_inv[i0:i1, j0:j1].astype(np.float32)[..., None]).astype(out.dtype)
    host_copy.take_blocks_into(out, w.view(np.uint8)[r0:r1, c0:c1], tables, FP8_BLOCK, (r0, c0))


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The release's FP8 encoding of a 2-D weight: e4m3 values and a float32 `scale_inv` per
    128x128 block (edge blocks partial), chosen so each block's largest magnitude maps to 448.
    The inverse of `dequantize_fp8`, up to e4m3 rounding."""
    rows, cols = w.shape
    nr, nc = fp8_scale_shape(w.shape)
    padded = np.zeros((nr * FP8_BLOCK, nc * FP8_BLOCK), np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(nr, FP8_BLOCK, nc, FP8_BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = (blocks / scale_inv[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].copy(), scale_inv


def check_tensors(index: CheckpointIndex, cfg: Config, *, mtp: bool = False, strict: bool = False) -> list[str]:
    """Problems found comparing the checkpoint's tensors with what `cfg` predicts, without reading
    weights: missing tensors, wrong shapes or dtypes, FP8 weights without (right-shaped) scales, and
    with `strict`, tensors nothing reads. With `mtp`, a checkpoint without the MTP layer is one
    problem (the main model is still checked); an index of names alone (`from_weight_map`) is
    checked for its names."""
    problems, used = [], set()
    if mtp and not has_mtp_layer(index, cfg):
        problems.append(f"no MTP layer: config.json has num_nextn_predict_layers={cfg.num_nextn_predict_layers} but "
                        f"no tensor is named 'model.layers.{cfg.num_hidden_layers}.*' (transformers' save_pretrained "
                        f"leaves it out); load without the MTP module (mtp=False)")
        mtp = False  # the main model is still checked
    for name, want in expected_tensors(cfg, mtp=mtp).items():
        info = index.tensors.get(name)
        used.add(name)
        if info is None or info.shape != want.shape:
            used.add(name + "_scale_inv")  # its scale belongs to the problem reported for the weight
        if info is None:
            problems.append(f"missing tensor {name!r} (expected shape {list(want.shape)})")
            continue
        if not index.shapes_known:
            used.add(name + "_scale_inv")
            continue
        where = f"tensor {name!r} in {info.file.name}"
        if info.shape != want.shape:
            problems.append(f"{where} has shape {list(info.shape)}, config predicts {list(want.shape)}")
        elif info.dtype in FP8_DTYPES and want.fp8_in_release:
            scale = index.tensors.get(name + "_scale_inv")
            used.add(name + "_scale_inv")
            if scale is None:
                problems.append(f"FP8 {where} has no {name}_scale_inv")
            elif scale.shape != fp8_scale_shape(want.shape) or scale.dtype != "F32":
                problems.append(f"{name}_scale_inv in {scale.file.name} is {scale.dtype}{list(scale.shape)}, "
                                f"expected F32{list(fp8_scale_shape(want.shape))}")
        elif info.dtype not in FLOAT_DTYPES:
            problems.append(f"{where} has dtype {info.dtype}, expected one of {FLOAT_DTYPES}"
                            + (" or FP8 with a scale" if want.fp8_in_release else ""))
    if strict:
        problems += [f"unexpected tensor {name!r} in {index.tensors[name].file.name}"
                     for name in sorted(set(index.tensors) - used) if not name.endswith(IGNORED_TENSORS)]
    return problems


def has_mtp_layer(index: CheckpointIndex, cfg: Config) -> bool:
    """Whether the checkpoint holds the MTP layer `cfg` declares (any tensor of layer
    `num_hidden_layers`): the release does, what transformers' `save_pretrained` writes does not."""
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return cfg.num_nextn_predict_layers > 0 and any(name.startswith(prefix) for name in index.tensors)


def validate(index: CheckpointIndex, cfg: Config, *, mtp: bool = False, strict: bool = False) -> None:
    """Raise a CheckpointError listing what `check_tensors` found, if anything."""
    problems = check_tensors(index, cfg, mtp=mtp, strict=strict)
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError(f"{index.folder}: checkpoint does not match its config ({len(problems)} problems):\n  "
                              + "\n  ".join(problems[:10]) + more)


def read_region(index: CheckpointIndex, src: Source, shape: tuple[int, ...], layer: int,
                region: tuple[slice, ...], dtype: Any) -> np.ndarray:
    """The part `region` of one layer's weight in our layout, reading only the experts it covers."""
    out = np.empty(_region_shape(shape, region), dtype)
    read_region_into(index, src, shape, layer, region, out)
    return out


def read_region_into(index: CheckpointIndex, src: Source, shape: tuple[int, ...], layer: int,
                     region: tuple[slice, ...], out: np.ndarray) -> None:
    """Write the part `region` of one layer's weight, in our layout and `out`'s dtype, into `out`,
    expert by expert, each straight into its slot: in threads where the FP8 lookup is compiled
    (`host_copy.releases_gil`; numpy's `np.take` holds the GIL, so threads would only contend)."""
    region = _whole(region, shape)
    if not src.per_expert:
        _read_into(out, index, src, src.name.format(layer=layer), shape, region)
        return

    def one(i: int, expert: int) -> None:
        _read_into(out[i], index, src, src.name.format(layer=layer, expert=expert), shape[1:], region[1:])

    experts = list(enumerate(range(shape[0])[region[0]]))
    if host_copy.releases_gil() and len(experts) > 1:
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(one, *zip(*experts)))
    else:
        for i, expert in experts:
            one(i, expert)


def _read_into(out: np.ndarray, index: CheckpointIndex, src: Source, name: str, shape: tuple[int, ...],
               region: tuple[slice, ...]) -> None:
    """Write `region` of one tensor, in our layout and `out`'s dtype, into `out`."""
    info = index.info(name)
    region = _whole(region, shape)
    box = tensor_region(src, shape, region)
    if box is None:  # not one box of the tensor: read it whole
        out[...] = src.to_ours(index.read(name)).reshape(shape)[region]
    elif src.rows_per_head is not None:  # the rows of the region's heads
        out[...] = src.to_ours(index.read(name, box))[:, region[1]]
    elif src.to_ours is _transposed and len(shape) == 2 and info.dtype in FP8_DTYPES:
        # every expert: dequantize, transpose and cast in one pass, into `out`
        stored, scale = index.mapped(info, box), index.mapped(index.info(name + "_scale_inv"), fp8_scale_region(box))
        dequantize_fp8_into(out.T, stored, scale, box, f"{info.file.name}: {name}")
    elif src.to_ours is _transposed and len(shape) == 2 and DTYPES[info.dtype] == out.dtype:
        # an output head: a blocked transpose, far faster than numpy's copy of a view
        host_copy.transpose_into(out, index.mapped(info, box)[box])
    elif src.to_ours is _transposed:
        out[...] = index.read(name, box).T.reshape(out.shape)
    else:
        out[...] = index.read(name, box)


# ---- routed experts dequantized on the devices -------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Experts:
    """One layer's routed-expert weight as the release stores it, to be dequantized on its devices
    (`dequantize_experts`): e4m3 `codes` `[E, out, in]` (uint8, the release layout) and a float32
    `scale_inv` per 128x128 block `[E, ceil(out/128), ceil(in/128)]`. On an accelerator this moves
    1 byte per value to the device instead of 2 and leaves the host only copying bytes: the host's
    table lookup is bound by one core's speed."""

    codes: Any
    scale_inv: Any


def is_fp8_experts(x: Any) -> bool:
    return isinstance(x, Fp8Experts)


def dequantize_experts(w: Fp8Experts) -> jax.Array:
    """`[E, in, out]` float32 values of `w` (dsr1's layout): each e4m3 value times its block's
    `scale_inv` in float32, the numbers `dequantize_fp8_into` computes on the host."""
    _, rows, cols = w.codes.shape
    values = jax.lax.bitcast_convert_type(w.codes, jnp.float8_e4m3fn).astype(jnp.float32)
    scale = jnp.repeat(jnp.repeat(w.scale_inv, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)[:, :rows, :cols]
    return jnp.swapaxes(values * scale, 1, 2)


def stored_experts(index: CheckpointIndex, src: Source, layer: int, n_experts: int) -> bool:
    """Whether `src` (one weight of one layer) is routed experts stored in FP8, all of them: the
    weights `read_stored_into` reads as stored."""
    return src.per_expert and src.to_ours is _transposed and all(
        index.info(src.name.format(layer=layer, expert=e)).dtype in FP8_DTYPES for e in range(n_experts))


def read_stored_into(index: CheckpointIndex, src: Source, suffix: str, layer: int, n_experts: int,
                     region: tuple[slice, ...], out: np.ndarray) -> None:
    """Write `region` of one layer's expert tensors as stored into `out`, expert by expert, a copy of
    bytes: `suffix` "" reads the e4m3 codes `[E, out, in]` (the release layout; `out` uint8),
    "_scale_inv" their block scales `[E, ceil(out/128), ceil(in/128)]` (float32)."""
    for i, expert in enumerate(range(n_experts)[region[0]]):
        name = src.name.format(layer=layer, expert=expert) + suffix
        out[i] = index.mapped(index.info(name), region[1:]).view(out.dtype)[region[1], region[2]]


def _region_shape(shape: tuple[int, ...], region: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(n)[r]) for n, r in zip(shape, region)) + shape[len(region):]
