"""Every weight declared once: shape, logical axes, initializer and which axes a matmul contracts.
Shardings, sharded random init and int8 variants are derived from these declarations, so no
weight is ever materialized on one device.

Layout: matrices are stored `[in, out]` (x @ W), per-head matrices keep the head axis explicit,
and layers are stacked on a leading axis (dense layers and MoE layers in two stacks) so the model
runs them under `jax.lax.scan`. The MTP module (layer `num_hidden_layers` of the release) is its
own subtree, loaded only on request.

V4 (`cfg.compressed_attention`) stacks its layers by attention kind and routing (`v4_stacks`): the
window-only, CSA and HCA layers hold different weights, and the hash-routed ones a `tid2eid` table in
place of the router's bias.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from .config import CSA_RATIO, Config
from .quant import Int8Weight, check_quant, quantize
from .sharding import DEFAULT_RULES, LogicalAxes, ShardingRules

Params = dict[str, Any]  # nested dicts of jax.Array / Int8Weight, same structure as param_specs()
STACKS = ("dense_layers", "moe_layers")  # the first_k_dense_replace dense layers, then the MoE layers


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """A weight's declaration. `dtype=None` means "the model's dtype" (router weights stay float32).
    `input_axes`: the axes a matmul contracts, for a weight that int8 may quantize (per layer)."""

    shape: tuple[int, ...]
    axes: LogicalAxes
    init: str  # "normal" (std 1/sqrt(fan_in)), "ones", "bias", "expert_ids" (distinct ids below fan_in)
    dtype: Any = None
    fan_in: int = 1
    input_axes: tuple[int, ...] | None = None


def _linear(shape: tuple[int, ...], axes: LogicalAxes, fan_in: int, input_axes: tuple[int, ...] = (0,),
            quantizable: bool = True) -> ArrayInfo:
    return ArrayInfo(shape, axes, "normal", fan_in=fan_in, input_axes=input_axes if quantizable else None)


def _norm(size: int) -> ArrayInfo:
    return ArrayInfo((size,), (None,), "ones")


def attention_specs(cfg: Config) -> dict[str, ArrayInfo]:
    d, h, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    specs = {
        "attn_norm": _norm(d),
        "kv_a": _linear((d, r + cfg.qk_rope_head_dim), ("embed", "kv_lora"), d),
        "kv_a_norm": _norm(r),
        # kv_b_proj split into W_UK and W_UV, stored [heads, out, latent] so decode can absorb them.
        "wk_b": _linear((h, cfg.qk_nope_head_dim, r), ("heads", "head_dim", "kv_lora"), r, input_axes=(2,)),
        "wv_b": _linear((h, cfg.v_head_dim, r), ("heads", "head_dim", "kv_lora"), r, input_axes=(2,)),
        "o": _linear((h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), h * cfg.v_head_dim, input_axes=(0, 1)),
        "mlp_norm": _norm(d),
    }
    if cfg.q_lora_rank is None:
        specs["q"] = _linear((d, h, cfg.qk_head_dim), ("embed", "heads", "head_dim"), d)
    else:
        q = cfg.q_lora_rank
        specs["q_a"] = _linear((d, q), ("embed", "q_lora"), d)
        specs["q_a_norm"] = _norm(q)
        specs["q_b"] = _linear((q, h, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"), q)
    if cfg.sparse_attention:
        specs["indexer"] = indexer_specs(cfg)
    return specs


def indexer_specs(cfg: Config) -> dict[str, ArrayInfo]:
    """V3.2's lightning indexer (`dsr1.core.sparse_attention`): queries from the query latent
    (`wq_b`), one key per token from the hidden state (`wk`, then a LayerNorm), per-head weights
    (`weights_proj`, unquantized float32 as the reference computes it). The index heads are not
    split over devices: a query's one selection sums over all of them, and replicated it is the same
    selection on every device without a collective."""
    d, q, hi, di = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    return {
        "wq_b": _linear((q, hi, di), ("q_lora", None, "head_dim"), q),
        "wk": _linear((d, di), ("embed", "head_dim"), d),
        "k_norm": ArrayInfo((di,), (None,), "ones", jnp.float32),
        "k_norm_bias": ArrayInfo((di,), (None,), "bias", jnp.float32),
        "weights_proj": ArrayInfo((d, hi), ("embed", None), "normal", jnp.float32, d),
    }


def mlp_specs(d: int, f: int) -> dict[str, ArrayInfo]:
    return {
        "gate": _linear((d, f), ("embed", "ffw"), d),
        "up": _linear((d, f), ("embed", "ffw"), d),
        "down": _linear((f, d), ("ffw", "embed"), f),
    }


def moe_specs(cfg: Config) -> dict[str, Any]:
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    specs: dict[str, Any] = {
        "router": ArrayInfo((d, e), ("embed", None), "normal", jnp.float32, d),
        "router_bias": ArrayInfo((e,), (None,), "bias", jnp.float32),
        "gate": _linear((e, d, f), ("experts", "embed", "expert_ffw"), d, input_axes=(1,)),
        "up": _linear((e, d, f), ("experts", "embed", "expert_ffw"), d, input_axes=(1,)),
        "down": _linear((e, f, d), ("experts", "expert_ffw", "embed"), f, input_axes=(1,)),
    }
    if cfg.n_shared_experts:
        specs["shared"] = mlp_specs(d, cfg.shared_intermediate_size)
    return specs


def mtp_specs(cfg: Config) -> dict[str, Any]:
    """One multi-token-prediction module: embeddings and head of its own, a projection, a MoE block."""
    d, v = cfg.hidden_size, cfg.vocab_size
    return {
        "embed": ArrayInfo((v, d), ("vocab", "embed"), "normal", fan_in=1),
        "enorm": _norm(d),
        "hnorm": _norm(d),
        "eh_proj": _linear((2 * d, d), ("embed", None), 2 * d, quantizable=False),  # bf16 in the release
        "block": {**attention_specs(cfg), "moe": moe_specs(cfg)},
        "head_norm": _norm(d),
        "head": _linear((d, v), ("embed", "vocab"), d, quantizable=False),
    }


def _stack(tree: dict[str, Any], n: int) -> dict[str, Any]:
    return jax.tree.map(lambda s: dataclasses.replace(s, shape=(n, *s.shape), axes=("layers", *s.axes)),
                        tree, is_leaf=is_spec)


def is_output_head(spec: ArrayInfo) -> bool:
    """Whether the weight maps the hidden state to the vocabulary (the lm_head, an MTP module's head)."""
    return spec.axes[-2:] == ("embed", "vocab")


def multiplies_last_two_axes(spec: ArrayInfo) -> bool:
    """Whether products contract the weight's second-to-last axis and keep its last (`x @ W`, per layer
    or expert): the routed experts, the dense and shared MLPs, `q_a` and `kv_a`."""
    per_layer = len(spec.shape) - (spec.axes[0] == "layers")
    return spec.input_axes == (per_layer - 2,)


def float_specs(cfg: Config, *, mtp: bool = False) -> dict[str, Any]:
    """The declaration of every weight in full precision, as a pytree of ArrayInfo."""
    if cfg.compressed_attention:
        return v4_specs(cfg, mtp=mtp)
    specs: dict[str, Any] = {
        "embed": ArrayInfo((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), "normal", fan_in=1),
        "final_norm": _norm(cfg.hidden_size),
        "lm_head": _linear((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.hidden_size, quantizable=False),
    }
    if cfg.num_dense_layers:
        specs["dense_layers"] = _stack(
            {**attention_specs(cfg), "mlp": mlp_specs(cfg.hidden_size, cfg.intermediate_size)},
            cfg.num_dense_layers)
    if cfg.num_moe_layers:
        specs["moe_layers"] = _stack({**attention_specs(cfg), "moe": moe_specs(cfg)}, cfg.num_moe_layers)
    if mtp and cfg.num_nextn_predict_layers:
        specs["mtp"] = _stack(mtp_specs(cfg), cfg.num_nextn_predict_layers)
    return specs


def _int8_spec(s: ArrayInfo) -> Any:
    if s.input_axes is None:
        return s
    stacked = s.axes[:1] == ("layers",)  # input_axes count within one layer
    dropped = {a + stacked for a in s.input_axes}
    keep = [i for i in range(len(s.shape)) if i not in dropped]
    scale = ArrayInfo(tuple(s.shape[i] for i in keep), tuple(s.axes[i] for i in keep), "ones", jnp.float32)
    return Int8Weight(dataclasses.replace(s, dtype=jnp.int8), scale, s.input_axes)


def param_specs(cfg: Config, quant: str | None = None, *, mtp: bool = False) -> dict[str, Any]:
    """Every weight's declaration; with `quant="int8"` the matmul weights become `Int8Weight`s."""
    specs = float_specs(cfg, mtp=mtp)
    if check_quant(quant) == "int8":
        specs = jax.tree.map(_int8_spec, specs, is_leaf=is_spec)
    return specs


def per_layer(specs: Any) -> Any:
    """The declarations of one layer of a stack (the leading "layers" axis removed)."""
    return jax.tree.map(lambda s: dataclasses.replace(s, shape=s.shape[1:], axes=s.axes[1:]), specs, is_leaf=is_spec)


def global_specs(specs: dict[str, Any]) -> dict[str, Any]:
    """The weights outside the layer stacks (embeddings, final norm, lm_head): one loading unit."""
    return {k: v for k, v in specs.items() if k not in stack_names(specs)}


def stack_names(specs: dict[str, Any]) -> list[str]:
    """The layer stacks a declaration tree holds, in model order (dense, MoE, then MTP)."""
    return [k for k in (*STACKS, "mtp") if k in specs]


def unit_specs(specs: dict[str, Any], unit: str) -> Any:
    """The declarations of one loading unit: "globals", or one layer of a stack."""
    return global_specs(specs) if unit == "globals" else per_layer(specs[unit])


def loading_units(cfg: Config, specs: dict[str, Any]) -> list[tuple[str, int | None]]:
    """The units weights are read, converted and written in: the globals, then every layer of every
    stack, by release layer number."""
    return [("globals", None)] + [(s, layer) for s in stack_names(specs) for layer in stack_layers(cfg, s)]


def stack_layers(cfg: Config, stack: str) -> range:
    """The release's layer numbers (`model.layers.N`) held by a stack."""
    if stack == "mtp":
        return range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return range(cfg.num_dense_layers) if stack == STACKS[0] else range(cfg.num_dense_layers, cfg.num_hidden_layers)


def is_spec(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def resolved_dtype(spec: ArrayInfo, dtype: Any) -> jnp.dtype:
    return jnp.dtype(spec.dtype if spec.dtype is not None else dtype)


def spec_shardings(specs: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """NamedSharding of every declared weight, checking that each sharded dimension splits evenly."""
    def one(path, spec: ArrayInfo):
        rules.check_divisible(mesh, spec.shape, spec.axes, jax.tree_util.keystr(path))
        return rules.sharding(mesh, spec.axes)
    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)


def abstract_params(specs: Any, mesh: Mesh, rules: ShardingRules, dtype: Any) -> Any:
    """ShapeDtypeStructs with shardings: what a loader must produce."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, resolved_dtype(s, dtype), sharding=sh),
                        specs, spec_shardings(specs, mesh, rules), is_leaf=is_spec)


def quantize_like(specs: Any, weights: Any) -> Any:
    """Quantize the float `weights` wherever `specs` (a quantized declaration tree) holds an Int8Weight.
    Works on whole stacks or on one layer (`stacked` tells whether a leading layer axis is present)."""
    def one(spec, w):
        if not isinstance(spec, Int8Weight):
            return w
        stacked = spec.q.axes[:1] == ("layers",) and w.ndim == len(spec.q.shape)
        qw = quantize(w, tuple(a + stacked for a in spec.input_axes))
        return Int8Weight(qw.q, qw.scale, spec.input_axes)
    return jax.tree.map(one, specs, weights, is_leaf=lambda x: is_spec(x) or isinstance(x, Int8Weight))


# A larger weight is drawn in slices. XLA's temporaries for one draw come to ~32 bytes per value (random
# bits, counters, float32): five R1-shaped layers (53 GB of bf16) needed 258 GB of them on one device and
# 44 GB per device on 8; drawn in slices, and stacks layer by layer, 20 GB (int8: 26) and 4.1 GB.
RANDOM_CHUNK_ELEMENTS = 1 << 26


def _slicing(spec: ArrayInfo) -> tuple[int, int] | None:
    """(axis, rows): draw `spec` in slices of `rows` along `axis`, the first axis the default rules
    never split whose slices can hold at most `RANDOM_CHUNK_ELEMENTS`; None: in one piece. It depends
    on the declaration alone, so the values do not depend on the mesh or the rules."""
    size = math.prod(spec.shape)
    if size <= RANDOM_CHUNK_ELEMENTS:
        return None
    for axis, (n, name) in enumerate(zip(spec.shape, spec.axes)):
        per_row = size // n
        if n > 1 and DEFAULT_RULES.mesh_axis(name) is None and per_row <= RANDOM_CHUNK_ELEMENTS:
            return axis, max(r for r in range(1, n + 1) if n % r == 0 and r * per_row <= RANDOM_CHUNK_ELEMENTS)
    return None


def _draw(key: jax.Array, spec: ArrayInfo, dtype: Any, sharding: NamedSharding | None = None) -> jax.Array:
    """One weight's initial values as `spec.init` says (drawn in float32, cast to its dtype); a large
    one drawn slice by slice into its buffer (`_slicing`), placed by `sharding`."""
    dt = resolved_dtype(spec, dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, dt)
    if spec.init == "expert_ids":  # distinct experts per row, of `fan_in` experts
        draws = jax.random.uniform(key, (*spec.shape[:-1], spec.fan_in))
        return jnp.argsort(draws, axis=-1)[..., :spec.shape[-1]].astype(dt)
    std = 0.01 if spec.init == "bias" else spec.fan_in ** -0.5

    def normal(k: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    slicing = _slicing(spec)
    if slicing is None:
        return normal(key, spec.shape)
    axis, rows = slicing
    piece = (*spec.shape[:axis], rows, *spec.shape[axis + 1:])

    def put(i: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(w, normal(jax.random.fold_in(key, i), piece), i * rows, axis)

    buffer = jnp.zeros(spec.shape, dt)
    if sharding is not None:
        buffer = jax.lax.with_sharding_constraint(buffer, sharding)
    return jax.lax.fori_loop(0, spec.shape[axis] // rows, put, buffer)


def _weight_key(key: jax.Array, path) -> jax.Array:
    # Each weight's key depends only on its name, so values do not depend on the mesh.
    return jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))


def draw_weight(path, spec: ArrayInfo, key: jax.Array, dtype: Any) -> jax.Array:
    """One weight's initial values from the model's `key` (the weight's own key from its `path` in the
    declarations), outside any mesh: the float32 master weights training starts from."""
    return _draw(_weight_key(key, path), spec, dtype)


def _init_leaf(path, spec: ArrayInfo, target: Any, key: jax.Array, dtype: Any, mesh: Mesh,
               rules: ShardingRules) -> Any:
    """One weight drawn and, where its `target` declaration is int8, quantized. A stack larger than
    `RANDOM_CHUNK_ELEMENTS` is made one layer at a time, written in place into the stack: an int8 one
    never exists in full precision. A smaller one is drawn whole, as `draw_weight` draws it: a small
    model's `init_random` values are its training's master weights."""
    key = _weight_key(key, path)

    def make(k: jax.Array, spec: ArrayInfo, target: Any) -> Any:
        return quantize_like(target, _draw(k, spec, dtype, rules.sharding(mesh, spec.axes)))

    if spec.axes[:1] != ("layers",) or math.prod(spec.shape) <= RANDOM_CHUNK_ELEMENTS:
        return make(key, spec, target)
    one_layer = per_layer(spec), per_layer(target)

    def put(i: jax.Array, stack: Any) -> Any:
        layer = make(jax.random.fold_in(key, i), *one_layer)
        return jax.tree.map(lambda s, w: jax.lax.dynamic_update_index_in_dim(s, w, i, 0), stack, layer)

    zeros = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding),
                         abstract_params(target, mesh, rules, dtype))
    return jax.lax.fori_loop(0, spec.shape[0], put, zeros)


def random_params(key: jax.Array, *, cfg: Config, mesh: Mesh, rules: ShardingRules, dtype: jnp.dtype,
                  quant: str | None, mtp: bool = False) -> Params:
    """Random weights (std 1/sqrt(fan_in)) in their shardings, drawn from `key`: one program when
    jitted (`dsr1.programs.init_params`), with no host copy. `mtp=True` adds the MTP modules
    (`params["mtp"]`) when `cfg.num_nextn_predict_layers > 0`."""
    specs = param_specs(cfg, quant, mtp=mtp)
    params = jax.tree_util.tree_map_with_path(lambda p, s, t: _init_leaf(p, s, t, key, dtype, mesh, rules),
                                              float_specs(cfg, mtp=mtp), specs, is_leaf=is_spec)
    return jax.tree.map(jax.lax.with_sharding_constraint, params, spec_shardings(specs, mesh, rules))


def without_mtp(params: Params) -> Params:
    """The weights without the MTP modules (`params["mtp"]`): what a program that drafts nothing
    takes, so that it is the same program whether the model carries them or not."""
    return {k: v for k, v in params.items() if k != "mtp"}


PLACEMENT = ("replicas", "replica_counts")  # a redundant-expert placement's map (`dsr1.core.eplb`)


def split_placement(params: Params) -> tuple[dict, Params]:
    """(`params`' expert placement arrays, if any; the weights without them)."""
    moe = params.get("moe_layers", {}).get("moe", {})
    if "replicas" not in moe:
        return {}, params
    kept = {k: v for k, v in moe.items() if k not in PLACEMENT}
    return {k: moe[k] for k in PLACEMENT}, {**params, "moe_layers": {**params["moe_layers"], "moe": kept}}


def with_placement_arrays(params: Params, placement: dict) -> Params:
    """The inverse of `split_placement`."""
    if not placement:
        return params
    layers = params["moe_layers"]
    return {**params, "moe_layers": {**layers, "moe": {**layers["moe"], **placement}}}


# ---- DeepSeek-V4 ------------------------------------------------------------------------------------

V4_KINDS = ("window", "csa", "hca")  # attention kinds by compress ratio: 0, CSA_RATIO, any other


def attention_kind(cfg: Config, layer: int) -> str:
    """V4: the attention kind of release layer `layer` (layers past the model's are its MTP layers)."""
    ratio = cfg.compress_ratio(layer)
    return "window" if ratio == 0 else "csa" if ratio == CSA_RATIO else "hca"


def v4_stack_name(cfg: Config, layer: int) -> str:
    """The stack holding V4 layer `layer`: by attention kind, the hash-routed layers apart."""
    return f"{'hash_' if layer < cfg.num_hash_layers else ''}{attention_kind(cfg, layer)}_layers"


def v4_stacks(cfg: Config) -> dict[str, list[int]]:
    """V4's layer stacks in order of their first layer, each with the release layers it holds."""
    stacks: dict[str, list[int]] = {}
    for layer in range(cfg.num_hidden_layers):
        stacks.setdefault(v4_stack_name(cfg, layer), []).append(layer)
    return stacks


def hc_specs(cfg: Config, outputs: int) -> dict[str, ArrayInfo]:
    """One mHC mixing (`dsr1.core.hyper_connections`): `fn [hc * D, outputs]`, `base`, `scale` (float32)."""
    wide = cfg.hc_mult * cfg.hidden_size
    f32 = jnp.float32
    return {"fn": ArrayInfo((wide, outputs), ("embed", None), "normal", f32, wide),
            "base": ArrayInfo((outputs,), (None,), "bias", f32),
            "scale": ArrayInfo((3 if outputs > cfg.hc_mult else 1,), (None,), "ones", f32)}


def compressor_specs(cfg: Config, ratio: int, width: int) -> dict[str, ArrayInfo]:
    """A compressor of `ratio` tokens into entries of `width` (CSA's overlap doubles its projections):
    `wkv`, `wgate` (float32 as the official code computes them), `ape [ratio, .]`, the entries' norm."""
    d, out = cfg.hidden_size, width * (2 if ratio == CSA_RATIO else 1)
    f32 = jnp.float32
    return {"wkv": ArrayInfo((d, out), ("embed", None), "normal", f32, d),
            "wgate": ArrayInfo((d, out), ("embed", None), "normal", f32, d),
            "ape": ArrayInfo((ratio, out), (None, None), "bias", f32),
            "norm": _norm(width)}


def v4_attention_specs(cfg: Config, kind: str) -> dict[str, Any]:
    """A V4 layer's attention (`dsr1.core.compressed_attention`) and its two mHC mixings."""
    d, h, hd, q, g = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    specs: dict[str, Any] = {
        "hc_attn": hc_specs(cfg, mix), "hc_ffn": hc_specs(cfg, mix),
        "attn_norm": _norm(d), "mlp_norm": _norm(d),
        "q_a": _linear((d, q), ("embed", "q_lora"), d), "q_a_norm": _norm(q),
        "q_b": _linear((q, h, hd), ("q_lora", "heads", "head_dim"), q),
        "kv": _linear((d, hd), ("embed", "head_dim"), d), "kv_norm": _norm(hd),
        "sinks": ArrayInfo((h,), ("heads",), "bias", jnp.float32),
        "o_a": _linear((g, h // g, hd, cfg.o_lora_rank), ("heads", None, "head_dim", None), h // g * hd,
                       input_axes=(1, 2)),
        "o_b": _linear((g, cfg.o_lora_rank, d), ("heads", None, "embed"), g * cfg.o_lora_rank, input_axes=(0, 1)),
    }
    ratios = {"csa": CSA_RATIO, "hca": cfg.hca_ratio}
    if kind != "window":
        specs["compressor"] = compressor_specs(cfg, ratios[kind], hd)
    if kind == "csa":
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        specs["indexer"] = {"wq_b": _linear((q, hi, di), ("q_lora", None, "head_dim"), q),
                            "weights_proj": ArrayInfo((d, hi), ("embed", None), "normal", jnp.float32, d),
                            "compressor": compressor_specs(cfg, CSA_RATIO, di)}
    return specs


def v4_moe_specs(cfg: Config, hashed: bool) -> dict[str, Any]:
    """A V4 MoE layer: `moe_specs`' weights, with a hash layer's `tid2eid [vocab, K]` for the bias."""
    specs = moe_specs(cfg)
    if hashed:
        del specs["router_bias"]
        specs["tid2eid"] = ArrayInfo((cfg.vocab_size, cfg.num_experts_per_tok), (None, None), "expert_ids",
                                     jnp.int32, cfg.n_routed_experts)
    return specs


def v4_mtp_specs(cfg: Config) -> dict[str, Any]:
    """A V4 MTP module: `e_proj(enorm(embed)) + h_proj(hnorm(streams))` into one layer of the kind its
    compress ratio says (the release's: window-only) with top-k MoE, then its own `hc_head` and norm
    (the embeddings and output head are the model's)."""
    d = cfg.hidden_size
    return {**v4_attention_specs(cfg, attention_kind(cfg, cfg.num_hidden_layers)), "moe": v4_moe_specs(cfg, False),
            "e_proj": _linear((d, d), ("embed", None), d), "h_proj": _linear((d, d), ("embed", None), d),
            "enorm": _norm(d), "hnorm": _norm(d), "head_norm": _norm(d), "hc_head": hc_specs(cfg, cfg.hc_mult)}


def v4_specs(cfg: Config, *, mtp: bool = False) -> dict[str, Any]:
    """Every V4 weight: embeddings, the stacks of `v4_stacks`, the final `hc_head` collapse, norm, head;
    with `mtp`, the MTP modules (`params["mtp"]`, stacked)."""
    d = cfg.hidden_size
    specs: dict[str, Any] = {
        "embed": ArrayInfo((cfg.vocab_size, d), ("vocab", "embed"), "normal", fan_in=1),
        "hc_head": hc_specs(cfg, cfg.hc_mult),
        "final_norm": _norm(d),
        "lm_head": _linear((d, cfg.vocab_size), ("embed", "vocab"), d, quantizable=False),
    }
    for name, layers in v4_stacks(cfg).items():
        kind = attention_kind(cfg, layers[0])
        layer = {**v4_attention_specs(cfg, kind), "moe": v4_moe_specs(cfg, name.startswith("hash_"))}
        specs[name] = _stack(layer, len(layers))
    if mtp and cfg.num_nextn_predict_layers:
        specs["mtp"] = _stack(v4_mtp_specs(cfg), cfg.num_nextn_predict_layers)
    return specs
