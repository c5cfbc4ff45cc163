"""Model configuration: one frozen dataclass, read from a HF `config.json` or a named preset."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2")
SPARSE_MODEL_TYPE = "deepseek_v32"  # V3.2: DeepSeek Sparse Attention (`index_*` fields)
V4_MODEL_TYPE = "deepseek_v4"  # V4: window + compressed attention, mHC (`V4_FIELDS`, `compress_ratios`)
INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")
V4_FIELDS = ("head_dim", "o_groups", "o_lora_rank", "sliding_window", "compress_rope_theta", "hc_mult",
             "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "num_hash_layers")
CSA_RATIO = 4  # the compress ratio of compressed sparse attention (overlapping windows, an indexer)


class ConfigError(ValueError):
    """A config.json that dsr1 cannot run, with the file and field at fault."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek-V3 uses `type: yarn`; `factor == 1` means plain RoPE)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of a DeepSeek-V3-architecture model (R1, V3, V3.2, Kimi-K2, Moonlight, ...).

    `index_topk > 0` (V3.2, `model_type: deepseek_v32`): DeepSeek Sparse Attention, a lightning
    indexer of `index_n_heads` heads of `index_head_dim` per layer choosing the `index_topk` cached
    positions each query attends to (`dsr1.core.sparse_attention`); 0: dense MLA.

    `compress_ratios` non-empty (V4, `model_type: deepseek_v4`): every layer attends through
    `dsr1.core.compressed_attention` (one shared key=value head of `head_dim`, a window of
    `sliding_window` raw entries, plus per layer `compress_ratios[i]`: 0 none, `CSA_RATIO` compressed
    sparse attention whose indexer picks `index_topk` entries, any other ratio heavily compressed
    attention reading every entry), the residual is `hc_mult` streams (`dsr1.core.hyper_connections`)
    and the first `num_hash_layers` MoE layers route by token id. The MLA fields then describe the
    same head: `kv_lora_rank = v_head_dim = head_dim`, `qk_nope_head_dim = head_dim - qk_rope_head_dim`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    scoring_func: str = "sigmoid"  # the router's score: "sigmoid" (V3), "sqrtsoftplus" (V4)
    swiglu_limit: float = 0.0  # V4: experts' gate clamped to <= limit, up to [-limit, limit]; 0: none
    head_dim: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    sliding_window: int = 0
    compress_ratios: tuple[int, ...] = ()  # per layer, then per MTP layer
    compress_rope_theta: float = 0.0
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 1e-6
    num_hash_layers: int = 0

    def __post_init__(self):
        _validate(self, "Config")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def sparse_attention(self) -> bool:
        """Whether the layers attend through DeepSeek Sparse Attention (V3.2's indexer)."""
        return self.index_topk > 0 and not self.compressed_attention

    @property
    def compressed_attention(self) -> bool:
        """Whether this is a V4 model: window and compressed attention, mHC streams (see the class)."""
        return bool(self.compress_ratios)

    @property
    def hca_ratio(self) -> int:
        """V4: the compress ratio of the heavily compressed attention layers (0: none)."""
        return max((r for r in self.compress_ratios if r not in (0, CSA_RATIO)), default=0)

    def compress_ratio(self, layer: int) -> int:
        """V4: layer `layer`'s compress ratio (0: window only; layers past the model's: its MTP layers)."""
        return self.compress_ratios[layer]

    @property
    def softmax_scale(self) -> float:
        """`1/sqrt(qk_head_dim)`, times YaRN's `mscale(factor, mscale_all_dim)^2`."""
        m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
        return self.qk_head_dim**-0.5 * m * m

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> Config:
        """Read a HF `config.json` (the file, or a checkpoint folder holding it)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{file}: no such file (expected a HF config.json or a folder holding one)")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> Config:
        """Build from the fields of a HF `config.json` already parsed into a dict."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type={model_type!r} is not supported; dsr1 runs the DeepSeek-V3 "
                f"architecture ({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type == V4_MODEL_TYPE:
            return _from_v4_dict(raw, source)
        _require(raw, "scoring_func", "sigmoid", source)
        _require(raw, "topk_method", "noaux_tc", source)
        _require(raw, "hidden_act", "silu", source)
        if raw.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{source}: moe_layer_freq={raw['moe_layer_freq']} is not supported (only 1)")
        if raw.get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=true is not supported")
        _check_quantization(raw.get("quantization_config"), source)

        def get(name: str, default: Any = dataclasses.MISSING) -> Any:
            if name in raw and raw[name] is not None:
                return raw[name]
            if default is dataclasses.MISSING:
                raise ConfigError(f"{source}: missing field {name!r}")
            return default

        eos = raw.get("eos_token_id", 1)
        fields = dict(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("moe_intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts", 0),
            num_experts_per_tok=get("num_experts_per_tok"),
            n_group=get("n_group", 1),
            topk_group=get("topk_group", 1),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=get("max_position_embeddings", 4096),
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            **({name: get(name) for name in INDEX_FIELDS} if model_type == SPARSE_MODEL_TYPE else {}),
        )
        theta, scaling = _read_rope(raw, source)
        try:
            return cls(**fields, rope_theta=theta, rope_scaling=scaling)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def preset(cls, name: str) -> Config:
        """A named configuration: `deepseek-r1` (the release config; `deepseek-v3.1` is the same
        architecture and shapes), `deepseek-v3.2` (R1's plus the sparse-attention indexer), `tiny` (a
        CPU demo model with R1's vocabulary; `tiny-v3.2` with an indexer choosing 8 positions), `bench`
        (memory-bound on CPU, for benchmarks) or `demo` (the trained demo model's shape)."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields of a HF `config.json` describing this model (used to write test checkpoints)."""
        if self.compressed_attention:
            return _v4_hf_dict(self)
        skip = {"rope_scaling", "compress_ratios", *V4_FIELDS} | (set() if self.sparse_attention else set(INDEX_FIELDS))
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        model_type, architecture = ((SPARSE_MODEL_TYPE, "DeepseekV32ForCausalLM") if self.sparse_attention
                                    else ("deepseek_v3", "DeepseekV3ForCausalLM"))
        d.update(model_type=model_type, architectures=[architecture], hidden_act="silu",
                 scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, attention_bias=False,
                 num_key_value_heads=self.num_attention_heads, rope_interleave=True)
        s = self.rope_scaling
        if s.factor != 1.0:
            d["rope_scaling"] = dict(type="yarn", **dataclasses.asdict(s))
        return d


def outside_vocabulary(ids: Any, vocab_size: int) -> str | None:
    """What is wrong with token `ids` (any integer sequence or array) for a vocabulary of `vocab_size`:
    the first id outside `[0, vocab_size)`, with its index (a tuple) where `ids` has more than one; None when
    every id is in it. The one check of token ids that every entry point (the API, the engine, the
    server) makes."""
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= vocab_size)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    at = f" at index {where}" if ids.size > 1 else ""
    return f"token id {int(ids[where])}{at} is outside the vocabulary [0, {vocab_size})"


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: `0.1 * mscale * ln(factor) + 1` (1 when not extending)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _require(raw: dict, field: str, expected: str, source: str) -> None:
    value = raw.get(field, expected)
    if value != expected:
        raise ConfigError(f"{source}: {field}={value!r} is not supported (dsr1 implements {expected!r})")


# The FP8 releases' weight scales: R1's and V3's any float32 (absent), V3.1's on powers of two stored as
# float32 ("ue8m0"); both dequantize as w * scale, so the loader reads them alike.
SCALE_FORMATS = (None, "ue8m0")


def _check_quantization(quant: Any, source: str) -> None:
    """A release's `quantization_config`: DeepSeek's FP8 (e4m3 weights in 128x128 blocks, each with a
    float32 scale, `scale_fmt` absent or "ue8m0"); a ConfigError naming the field for anything else
    dsr1's FP8 loader would misread. Other quantization methods are left to the weight loader."""
    if quant is None:
        return
    if not isinstance(quant, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, got {type(quant).__name__}")
    if quant.get("scale_fmt") not in SCALE_FORMATS:
        raise ConfigError(f"{source}: quantization_config.scale_fmt={quant['scale_fmt']!r} is not supported "
                          f"(dsr1 reads float32 block scales: absent, or 'ue8m0' for powers of two)")
    if quant.get("quant_method") != "fp8":
        return
    for field, expected in (("fmt", "e4m3"), ("weight_block_size", [128, 128])):
        if field in quant and quant[field] != expected:
            raise ConfigError(f"{source}: quantization_config.{field}={quant[field]!r} is not supported "
                              f"(DeepSeek's FP8 releases use {expected!r})")


def _read_rope(raw: dict, source: str) -> tuple[float, RopeScaling]:
    """`rope_scaling` (older HF) or `rope_parameters` (newer HF) to (theta, RopeScaling)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind != "yarn":
        raise ConfigError(f"{source}: rope type {kind!r} is not supported (only 'yarn' or none)")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            mscale=float(params.get("mscale", 1.0)),
            mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
        )
    except KeyError as e:
        raise ConfigError(f"{source}: yarn rope scaling is missing field {e.args[0]!r}") from None
    return theta, scaling


SCORING_FUNCTIONS = ("sigmoid", "sqrtsoftplus")
HF_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": CSA_RATIO,
                  "heavily_compressed_attention": None}  # HCA's ratio: `compress_rates`


def _v4_ratios(raw: dict, source: str) -> tuple[int, ...]:
    """V4's per-layer compress ratios, from the release's `compress_ratios` (layers, then MTP layers)
    or transformers' `layer_types` with `compress_rates` (layers only: MTP layers are window-only)."""
    layers, mtp = raw.get("num_hidden_layers", 0), raw.get("num_nextn_predict_layers", 0) or 0
    if raw.get("compress_ratios") is not None:
        ratios = tuple(int(r) for r in raw["compress_ratios"])
        if len(ratios) not in (layers, layers + mtp):
            raise ConfigError(f"{source}: compress_ratios has {len(ratios)} entries; expected num_hidden_layers "
                              f"({layers}) plus num_nextn_predict_layers ({mtp})")
        return ratios + (0,) * (layers + mtp - len(ratios))
    if raw.get("layer_types") is None:
        raise ConfigError(f"{source}: missing field 'compress_ratios' (or transformers' 'layer_types')")
    rates = raw.get("compress_rates") or {"compressed_sparse_attention": CSA_RATIO,
                                          "heavily_compressed_attention": 128}
    ratios = []
    for kind in raw["layer_types"]:
        if kind not in HF_LAYER_TYPES:
            raise ConfigError(f"{source}: layer_types entry {kind!r} is not supported ({', '.join(HF_LAYER_TYPES)})")
        ratios.append(int(rates.get(kind, 0)) if kind != "sliding_attention" else 0)
    if rates.get("compressed_sparse_attention", CSA_RATIO) != CSA_RATIO:
        raise ConfigError(f"{source}: compress_rates.compressed_sparse_attention="
                          f"{rates['compressed_sparse_attention']} is not supported (CSA's is {CSA_RATIO})")
    return tuple(ratios) + (0,) * mtp


def _v4_rope(raw: dict, source: str) -> tuple[float, float, RopeScaling]:
    """(window layers' theta, compressed layers' theta, compressed layers' YaRN), from the release's
    `rope_theta`, `compress_rope_theta`, `rope_scaling` or transformers' nested `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        _, scaling = _read_rope({"rope_parameters": params["compress"]}, source)
        return float(params["main"].get("rope_theta", 10000.0)), float(params["compress"]["rope_theta"]), scaling
    theta, scaling = _read_rope(raw, source)
    return theta, float(raw.get("compress_rope_theta", theta)), scaling


def _from_v4_dict(raw: dict[str, Any], source: str) -> Config:
    """A DeepSeek-V4 `config.json` (the release's or one transformers wrote) as a Config."""
    _require(raw, "scoring_func", "sqrtsoftplus", source)
    _require(raw, "hidden_act", "silu", source)
    _require(raw, "topk_method", "noaux_tc", source)
    for field, expected in (("num_key_value_heads", 1), ("n_shared_experts", 1), ("norm_topk_prob", True),
                            ("attention_bias", False)):
        if raw.get(field, expected) != expected:
            raise ConfigError(f"{source}: {field}={raw[field]!r} is not supported (DeepSeek-V4 has {expected!r})")
    _check_quantization(raw.get("quantization_config"), source)

    def get(name: str, default: Any = dataclasses.MISSING) -> Any:
        if raw.get(name) is not None:
            return raw[name]
        if default is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing field {name!r}")
        return default

    head, moe = get("head_dim"), get("moe_intermediate_size")
    rope = raw.get("qk_rope_head_dim") or int(head * float(get("partial_rotary_factor", 64 / 512)))
    ratios = _v4_ratios(raw, source)
    theta, compress_theta, scaling = _v4_rope(raw, source)
    eos = raw.get("eos_token_id", 1)
    n_hash = raw.get("num_hash_layers")
    if n_hash is None:
        n_hash = sum(t == "hash_moe" for t in raw.get("mlp_layer_types") or ()) if "mlp_layer_types" in raw else 3
    fields = dict(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), intermediate_size=moe,
        moe_intermediate_size=moe, num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"), q_lora_rank=get("q_lora_rank"), kv_lora_rank=head,
        qk_nope_head_dim=head - rope, qk_rope_head_dim=rope, v_head_dim=head, n_routed_experts=get("n_routed_experts"),
        n_shared_experts=1, num_experts_per_tok=get("num_experts_per_tok"), n_group=1, topk_group=1,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), norm_topk_prob=True, first_k_dense_replace=0,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=get("max_position_embeddings", 4096),
        num_nextn_predict_layers=get("num_nextn_predict_layers", 0),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)), bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, scoring_func="sqrtsoftplus",
        swiglu_limit=float(get("swiglu_limit", 0.0)), head_dim=head, o_groups=get("o_groups"),
        o_lora_rank=get("o_lora_rank"), sliding_window=get("sliding_window"), compress_ratios=ratios,
        compress_rope_theta=compress_theta, hc_mult=get("hc_mult"), hc_sinkhorn_iters=get("hc_sinkhorn_iters"),
        hc_eps=float(get("hc_eps", 1e-6)), num_hash_layers=n_hash,
        **({name: get(name) for name in INDEX_FIELDS} if CSA_RATIO in ratios else {}),
    )
    try:
        return Config(**fields)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _v4_hf_dict(cfg: Config) -> dict[str, Any]:
    """A V4 config's fields as transformers' `deepseek_v4` reads them (and the release's names)."""
    layers = cfg.num_hidden_layers
    kinds = {0: "sliding_attention", CSA_RATIO: "compressed_sparse_attention"}
    d = {name: getattr(cfg, name) for name in (
        "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "q_lora_rank", "qk_rope_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
        "routed_scaling_factor", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "num_nextn_predict_layers", "tie_word_embeddings", "bos_token_id", "eos_token_id", "scoring_func",
        *V4_FIELDS, *INDEX_FIELDS)}
    d.update(model_type=V4_MODEL_TYPE, architectures=["DeepseekV4ForCausalLM"], hidden_act="silu",
             topk_method="noaux_tc", norm_topk_prob=True, num_key_value_heads=1, attention_bias=False,
             compress_ratios=list(cfg.compress_ratios),
             layer_types=[kinds.get(r, "heavily_compressed_attention") for r in cfg.compress_ratios[:layers]],
             compress_rates={"compressed_sparse_attention": CSA_RATIO,
                             "heavily_compressed_attention": cfg.hca_ratio or 128},
             mlp_layer_types=["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(layers)])
    s = cfg.rope_scaling
    if s.factor != 1.0:
        d["rope_scaling"] = dict(type="yarn", factor=s.factor, beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                                 original_max_position_embeddings=s.original_max_position_embeddings)
    return d


def _validate_v4(cfg: Config, fail) -> None:
    """V4's shapes: the head holds the rope slice, the heads split into `o_groups`, a ratio per layer
    (and MTP layer), one HCA ratio, an indexer where a layer is CSA."""
    if not cfg.qk_rope_head_dim < cfg.head_dim:
        fail(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be below head_dim={cfg.head_dim}")
    if cfg.o_groups <= 0 or cfg.num_attention_heads % cfg.o_groups:
        fail(f"o_groups={cfg.o_groups} must divide num_attention_heads={cfg.num_attention_heads}")
    for name in ("o_lora_rank", "sliding_window", "hc_mult", "hc_sinkhorn_iters"):
        if getattr(cfg, name) <= 0:
            fail(f"{name}={getattr(cfg, name)} must be positive")
    if cfg.q_lora_rank is None:
        fail("DeepSeek-V4 needs q_lora_rank (the query latent)")
    expected = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if len(cfg.compress_ratios) != expected:
        fail(f"compress_ratios has {len(cfg.compress_ratios)} entries; expected {expected} (layers, then MTP layers)")
    bad = [r for r in cfg.compress_ratios if r < 0 or r == 1]
    if bad:
        fail(f"compress_ratios entry {bad[0]} is not supported (0: window only, {CSA_RATIO}: CSA, >= 2: HCA)")
    if len({r for r in cfg.compress_ratios if r not in (0, CSA_RATIO)}) > 1:
        fail(f"compress_ratios holds several HCA ratios {sorted(set(cfg.compress_ratios) - {0, CSA_RATIO})}; "
             f"dsr1 runs one")
    if not 0 <= cfg.num_hash_layers <= cfg.num_hidden_layers:
        fail(f"num_hash_layers={cfg.num_hash_layers} must be in [0, num_hidden_layers={cfg.num_hidden_layers}]")
    if cfg.scoring_func != "sqrtsoftplus":
        fail(f"scoring_func={cfg.scoring_func!r} is not supported for DeepSeek-V4 (only 'sqrtsoftplus')")
    if CSA_RATIO in cfg.compress_ratios:
        if min(cfg.index_n_heads, cfg.index_topk) <= 0:
            fail(f"index_n_heads={cfg.index_n_heads} and index_topk={cfg.index_topk} must be positive "
                 f"(CSA layers' indexer)")
        if not cfg.qk_rope_head_dim < cfg.index_head_dim:
            fail(f"index_head_dim={cfg.index_head_dim} must exceed qk_rope_head_dim={cfg.qk_rope_head_dim}")


def _validate(cfg: Config, source: str) -> None:
    def fail(msg: str):
        raise ConfigError(msg)

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok"):
        if getattr(cfg, name) <= 0:
            fail(f"{name}={getattr(cfg, name)} must be positive")
    if cfg.qk_rope_head_dim <= 0 or cfg.qk_rope_head_dim % 2:
        fail(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be a positive even number (rope rotates pairs)")
    if cfg.n_routed_experts % cfg.n_group:
        fail(f"n_routed_experts={cfg.n_routed_experts} is not divisible by n_group={cfg.n_group}")
    per_group = cfg.n_routed_experts // cfg.n_group
    if per_group < 2 and cfg.n_group > 1:
        fail(f"n_group={cfg.n_group} leaves {per_group} expert per group; group scores need at least 2")
    if not 1 <= cfg.topk_group <= cfg.n_group:
        fail(f"topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]")
    if cfg.num_experts_per_tok > cfg.topk_group * per_group:
        fail(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the {cfg.topk_group * per_group} experts "
             f"in topk_group={cfg.topk_group} groups")
    if cfg.first_k_dense_replace < 0:
        fail(f"first_k_dense_replace={cfg.first_k_dense_replace} must be >= 0")
    if cfg.sparse_attention:
        _validate_indexer(cfg, fail)
    if cfg.scoring_func not in SCORING_FUNCTIONS:
        fail(f"scoring_func={cfg.scoring_func!r} is not supported (dsr1 implements {', '.join(SCORING_FUNCTIONS)})")
    if cfg.compressed_attention:
        _validate_v4(cfg, fail)


def _validate_indexer(cfg: Config, fail) -> None:
    """V3.2's indexer: its queries come from the query latent, and its rope takes the first
    `qk_rope_head_dim` of each head's `index_head_dim` channels."""
    if cfg.q_lora_rank is None:
        fail("index_topk > 0 (sparse attention) needs q_lora_rank: the indexer's queries read the query latent")
    if cfg.index_n_heads <= 0:
        fail(f"index_n_heads={cfg.index_n_heads} must be positive")
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        fail(f"index_head_dim={cfg.index_head_dim} must be at least qk_rope_head_dim={cfg.qk_rope_head_dim} "
             f"(the indexer ropes its first qk_rope_head_dim channels)")


def _r1() -> Config:
    return Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=3, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
    )


def _tiny() -> Config:
    """R1's structure at toy size (2-of-4 groups, 16 experts, YaRN, a dense layer, then MoE) with
    R1's vocabulary, so the real tokenizer and chat template work with it."""
    return dataclasses.replace(
        _r1(), hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
        rope_scaling=dataclasses.replace(_r1().rope_scaling, factor=4.0, original_max_position_embeddings=512),
        max_position_embeddings=2048, num_nextn_predict_layers=0,
    )


def _bench() -> Config:
    """Big enough to be memory-bound on a CPU (~1 GB of bf16 weights, 64 experts of which a batch of
    one reads 6 per layer), with R1's per-layer structure and YaRN."""
    return dataclasses.replace(
        _r1(), vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=5, num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
        num_nextn_predict_layers=0,
    )


def _demo() -> Config:
    """The embedded demo model that `python -m dsr1.train` trains: R1's structure (a dense first layer,
    then MoE with a shared expert and 2-of-4 group routing, MLA with q_lora, YaRN, one MTP module) at
    a size whose bf16 weights, MTP module included, stay under 25 MB, with a 4096-token BPE vocabulary."""
    return dataclasses.replace(
        _r1(), vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_scaling=dataclasses.replace(_r1().rope_scaling, factor=4.0, original_max_position_embeddings=512),
        max_position_embeddings=2048, num_nextn_predict_layers=1,
    )


def _v32() -> Config:
    """DeepSeek-V3.2(-Exp): R1's shapes plus the indexer of its release config."""
    return dataclasses.replace(_r1(), index_n_heads=64, index_head_dim=128, index_topk=2048)


def _tiny_v32() -> Config:
    """The tiny preset with a V3.2 indexer that selects fewer positions than a short prompt holds."""
    return dataclasses.replace(_tiny(), index_n_heads=4, index_head_dim=32, index_topk=8)


# V3-0324, R1-0528, V3.1 and V3.1-Terminus have R1's architecture and shapes: `deepseek-v3.1` is R1's config.
PRESETS: dict[str, Config] = {"deepseek-r1": _r1(), "deepseek-v3.1": _r1(), "deepseek-v3.2": _v32(), "tiny": _tiny(),
                              "tiny-v3.2": _tiny_v32(), "bench": _bench(), "demo": _demo()}
