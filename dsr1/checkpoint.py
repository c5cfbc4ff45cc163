"""Loading a HF checkpoint folder in the DeepSeek *release layout* straight into sharded weights.

Release layout: one tensor per expert (`model.layers.L.mlp.experts.E.gate_proj.weight`), linear
weights `[out, in]`, optionally float8 e4m3 with a `weight_scale_inv` per 128x128 block.

Loading streams layer by layer: every device shard is built by `jax.make_array_from_callback`
from memory-mapped tensors, reading only the experts and rows that shard holds (on several hosts
each process reads only its own devices' slices), then written into the stacked weight in place.
Host memory follows the largest single device shard of one layer, never the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from .config import Config
from .params import STACKS, Params, is_spec, param_specs, resolved_dtype, shardings, stack_layers
from .safetensors_io import CheckpointError, TensorInfo, read_header, read_tensor

FP8_BLOCK = 128
INDEX_FILE = "model.safetensors.index.json"


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
        "wk_b": Source(pre + "self_attn.kv_b_proj.weight", kv_b_shape, lambda w: w.reshape(h, nope + v, r)[:, :nope]),
        "wv_b": Source(pre + "self_attn.kv_b_proj.weight", kv_b_shape, lambda w: w.reshape(h, nope + v, r)[:, nope:]),
        "o": Source(pre + "self_attn.o_proj.weight", (d, h * v), _transposed),
    }
    if cfg.q_lora_rank is None:
        sources["q"] = Source(pre + "self_attn.q_proj.weight", (h * cfg.qk_head_dim, d), _transposed)
    else:
        q = cfg.q_lora_rank
        sources["q_a"] = Source(pre + "self_attn.q_a_proj.weight", (q, d), _transposed)
        sources["q_a_norm"] = Source(pre + "self_attn.q_a_layernorm.weight", (q,), _same)
        sources["q_b"] = Source(pre + "self_attn.q_b_proj.weight", (h * cfg.qk_head_dim, q), _transposed)
    return sources


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


def weight_sources(cfg: Config) -> dict[str, Any]:
    """A pytree shaped like `param_specs(cfg)` whose leaves say which checkpoint tensor feeds them."""
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
    return sources


def expected_tensors(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model reads, with its HF shape (MTP layers not included)."""
    out: dict[str, tuple[int, ...]] = {}
    for path, src in jax.tree_util.tree_flatten_with_path(weight_sources(cfg), is_leaf=_is_source)[0]:
        layers = stack_layers(cfg, path[0].key) if len(path) > 1 else range(1)
        for layer in layers:
            experts = range(cfg.n_routed_experts) if src.per_expert else range(1)
            for e in experts:
                out[src.name.format(layer=layer, expert=e)] = src.hf_shape
    return out


def _is_source(x: Any) -> bool:
    return isinstance(x, Source)


# ---- the checkpoint folder ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a safetensors checkpoint folder, from the index file or the shards' headers."""

    folder: Path
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, folder: str | Path) -> CheckpointIndex:
        folder = Path(folder)
        index_file = folder / INDEX_FILE
        if index_file.exists():
            try:
                weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_file}: not a valid safetensors index ({e!r})") from None
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
        return cls(folder, tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: checkpoint has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        """The tensor in float32-compatible form; FP8 weights are dequantized per 128x128 block."""
        info = self.info(name)
        w = read_tensor(info)
        if info.dtype.startswith("F8"):
            scale = read_tensor(self.info(name + "_scale_inv"))
            return dequantize_fp8(w, scale, name)
        return w


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, name: str = "weight") -> np.ndarray:
    """`W = fp8 * scale_inv` blockwise over 128x128 blocks (edge blocks are partial)."""
    rows, cols = w.shape
    want = (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    if scale_inv.shape != want:
        raise CheckpointError(f"{name}_scale_inv: shape {list(scale_inv.shape)}, expected {list(want)} for "
                              f"{FP8_BLOCK}x{FP8_BLOCK} blocks of a {rows}x{cols} weight")
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return w.astype(np.float32) * full


def validate(index: CheckpointIndex, cfg: Config) -> None:
    """Check, without reading weights, that every tensor the model needs is there with its shape."""
    problems = []
    for name, shape in expected_tensors(cfg).items():
        info = index.tensors.get(name)
        if info is None:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif info.shape != shape:
            problems.append(f"tensor {name!r} in {info.file.name} has shape {list(info.shape)}, "
                            f"config predicts {list(shape)}")
        elif info.dtype.startswith("F8") and name + "_scale_inv" not in index.tensors:
            problems.append(f"FP8 tensor {name!r} in {info.file.name} has no {name}_scale_inv")
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError(f"{index.folder}: checkpoint does not match its config:\n  "
                              + "\n  ".join(problems[:10]) + more)


# ---- streaming into shardings -------------------------------------------------------------------

def _read_layer_slice(index: CheckpointIndex, src: Source, spec_shape: tuple[int, ...], layer: int,
                      region: tuple[slice, ...], dtype: np.dtype) -> np.ndarray:
    """The part `region` of one layer's weight in our layout, reading only the experts it covers."""
    def ours(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return src.to_ours(index.read(name)).reshape(shape)

    if src.per_expert:
        experts = range(spec_shape[0])[region[0]]
        parts = [ours(src.name.format(layer=layer, expert=e), spec_shape[1:])[region[1:]] for e in experts]
        return np.stack(parts).astype(dtype)
    return np.asarray(ours(src.name.format(layer=layer), spec_shape)[region]).astype(dtype)


def _load_array(index: CheckpointIndex, src: Source, shape: tuple[int, ...], sharding: NamedSharding,
                layer: int, dtype: np.dtype) -> jax.Array:
    # Devices that hold the same region (replicas along another mesh axis) share one read.
    regions: dict[tuple, np.ndarray] = {}

    def read(region: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in region)
        if key not in regions:
            regions[key] = _read_layer_slice(index, src, shape, layer, region, dtype)
        return regions[key]

    return jax.make_array_from_callback(shape, sharding, read)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    """Write one layer into a stacked weight in place (the old buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), i, 0)


def _load_stack(index: CheckpointIndex, cfg: Config, stack: str, mesh: Mesh, dtype: Any, bar: tqdm) -> Any:
    """One stack of layers: each stacked weight is allocated in its sharding, then filled layer by layer."""
    specs = param_specs(cfg)[stack]
    leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    sources = jax.tree.leaves(weight_sources(cfg)[stack], is_leaf=_is_source)
    out_shardings = jax.tree.leaves(shardings(cfg, mesh)[stack])
    stacked = [jax.jit(functools.partial(jnp.zeros, s.shape, resolved_dtype(s, dtype)), out_shardings=sh)()
               for s, sh in zip(leaves, out_shardings)]
    for i, layer in enumerate(stack_layers(cfg, stack)):
        for j, (s, src, sh) in enumerate(zip(leaves, sources, out_shardings)):
            layer_sharding = NamedSharding(mesh, P(*sh.spec[1:]))  # the stacked sharding minus "layers"
            part = _load_array(index, src, s.shape[1:], layer_sharding, layer, resolved_dtype(s, dtype))
            stacked[j] = _set_layer(stacked[j], part, np.int32(i))
        bar.update(1)
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), stacked)


def load_params(folder: str | Path, cfg: Config, mesh: Mesh, dtype: Any, *, progress: bool = True) -> Params:
    """Stream a release-layout checkpoint folder into sharded weights of `dtype`."""
    index = CheckpointIndex.open(folder)
    validate(index, cfg)
    specs, sources, out_shardings = param_specs(cfg), weight_sources(cfg), shardings(cfg, mesh)
    params: dict[str, Any] = {
        key: _load_array(index, sources[key], specs[key].shape, out_shardings[key], 0,
                         resolved_dtype(specs[key], dtype))
        for key in ("embed", "final_norm", "lm_head")
    }
    stacks = [k for k in STACKS if k in specs]
    total = sum(len(stack_layers(cfg, k)) for k in stacks)
    with tqdm(total=total, desc=f"loading {Path(folder).name}", unit="layer", disable=not progress) as bar:
        for stack in stacks:
            params[stack] = _load_stack(index, cfg, stack, mesh, dtype, bar)
    return params
