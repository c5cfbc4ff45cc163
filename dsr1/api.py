"""The public entry points: `load`, `init_random` and the `Model` facade over the jitted programs.

`Model` holds the config, the mesh, the sharding rules, the sharded weights and the checkpoint's
tokenizer; its methods check their inputs on the host (clear errors instead of silent garbage) and
call `dsr1.programs`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from . import cpu, programs
from .core.cache import KVCache, check_kv_cache_dtype
from .core.config import Config, ConfigError, outside_vocabulary
from .core.eplb import ExpertPlacement, placement_of
from .core.eplb import balance as eplb_balance
from .core.params import Params
from .core.quant import Int8Weight, check_quant
from .core.sharding import DEFAULT_RULES, ShardingRules, make_mesh, put_replicated, to_host
from .cpu import loading as cpu_loading
from .generation.tokenizer import Tokenizer, checkpoint_tokenizer
from .programs.eplb import moved_to, with_placement
from .weights.loading import load_params

DEFAULT_DECODE_ROOM = 256
log = logging.getLogger("dsr1.weights")


@dataclasses.dataclass(frozen=True)
class Model:
    """A DeepSeek-V3-architecture model placed on a mesh. Methods take numpy or jax int32 tokens.

    `kv_cache_dtype`: None keeps the decode cache in the model's dtype; "int8" stores the latent
    `c_kv` as int8 with per-token scales. `rules`: how logical axes map onto the mesh.
    `tokenizer`: the checkpoint's own (`tokenizer.json` in the folder `dsr1.load` read), which
    `dsr1.generate` and `dsr1.serving.Engine` use unless given another; None for random weights and
    folders without one, which then use R1's."""

    cfg: Config
    params: Params
    mesh: Mesh
    kv_cache_dtype: str | None = None
    rules: ShardingRules = DEFAULT_RULES
    tokenizer: Tokenizer | None = None

    def __post_init__(self):
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def program_kwargs(self) -> dict[str, Any]:
        """The static arguments every program of `dsr1.programs` is compiled for."""
        return {"cfg": self.cfg, "mesh": self.mesh, "rules": self.rules}

    @property
    def dtype(self) -> jnp.dtype:
        return self.params["embed"].dtype

    @property
    def quant(self) -> str | None:
        """"int8" when the matmul weights are int8 with per-channel scales, else None."""
        return "int8" if any(isinstance(x, Int8Weight) for x in jax.tree.leaves(
            self.params, is_leaf=lambda x: isinstance(x, Int8Weight))) else None

    def with_expert_placement(self, placement: ExpertPlacement) -> Model:
        """This model with redundant experts (`dsr1.core.eplb`): the routed-expert stacks stored by the
        placement's physical slots, each (token, expert) pair sent to one copy. Tokens are unchanged.
        A model that holds a placement already moves its experts to the new one (same number of slots)."""
        devices = self.rules.devices(self.mesh, "experts")
        if devices == 1:
            raise ValueError("redundant experts balance the devices of the expert axis: this mesh has one")
        if placement.devices != devices:
            raise ValueError(f"the placement is for {placement.devices} devices; the expert axis has {devices}")
        placed = moved_to if placement_of(self.params) else with_placement
        return dataclasses.replace(self, params=placed(self.params, placement))

    def with_redundant_experts(self, redundant: int) -> Model:
        """This model with `redundant` more expert slots per MoE layer, placed for an even load (a
        serving engine places them again from the routing it counts: `Engine(rebalance_every=...)`)."""
        devices = self.rules.devices(self.mesh, "experts")
        even = np.ones((self.cfg.num_moe_layers, self.cfg.n_routed_experts))
        return self.with_expert_placement(eplb_balance(even, devices, redundant))

    def weight_bytes(self) -> int:
        """Bytes of all weights (int8 values and their scales included; an array held twice counted once)."""
        return sum(x.nbytes for x in {id(x): x for x in jax.tree.leaves(self.params)}.values())

    def forward(self, tokens: Any, lengths: Any = None) -> jax.Array:
        """Logits `[B, T, V]` (float32) for right-padded `tokens [B, T]`; rows are `lengths` long
        (default: all T). Logits past a row's length are zero."""
        tokens, lengths = self.check_prompt(tokens, lengths)
        return programs.forward(self.params, tokens, lengths, **self.program_kwargs)

    def prefill(self, tokens: Any, lengths: Any = None, max_len: int | None = None) -> tuple[jax.Array, KVCache]:
        """Run the prompts; return logits `[B, V]` at each row's last token and a cache with room for
        `max_len` positions (default: T + 256, within max_position_embeddings)."""
        tokens, lengths = self.check_prompt(tokens, lengths)
        t = tokens.shape[1]
        if max_len is None:
            max_len = max(t, min(t + DEFAULT_DECODE_ROOM, self.cfg.max_position_embeddings))
        if not t <= max_len <= self.cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} must be at least the prompt length {t} and at most "
                             f"max_position_embeddings={self.cfg.max_position_embeddings}")
        return programs.prefill(self.params, tokens, lengths, **self.program_kwargs, max_len=max_len,
                                kv_cache_dtype=self.kv_cache_dtype)

    def decode(self, cache: KVCache, tokens: Any) -> tuple[jax.Array, KVCache]:
        """Feed one token per row (`tokens [B]`) at position `cache.lengths`; return logits `[B, V]` and
        the grown cache. The cache passed in is consumed (its buffers are reused)."""
        tokens = self._check_tokens(np.asarray(tokens), ndim=1)
        if tokens.shape[0] != cache.batch_size:
            raise ValueError(f"decode got {tokens.shape[0]} tokens for a cache of batch {cache.batch_size}")
        longest = int(to_host(cache.lengths).max())
        if longest >= cache.max_len:
            raise ValueError(f"cache is full: a row has length {longest} = max_len {cache.max_len}; "
                             f"prefill with a larger max_len")
        logits, cache, _ = programs.decode(self.params, cache, put_replicated(tokens, self.mesh),
                                           **self.program_kwargs)
        return logits, cache

    # ---- input checks --------------------------------------------------------------------------
    def _check_tokens(self, tokens: np.ndarray, ndim: int) -> np.ndarray:
        if tokens.ndim != ndim or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array of rank {ndim}, got {tokens.dtype}{list(tokens.shape)}")
        if (problem := outside_vocabulary(tokens, self.cfg.vocab_size)) is not None:
            raise ValueError(problem)
        return tokens.astype(np.int32)

    def check_draft_tokens(self, draft_tokens: Any) -> int:
        """`draft_tokens` (MTP drafts per decode step) as `generate` and the engine take it: an integer
        >= 0, and > 0 only for a model holding its MTP module."""
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 0:
            raise ValueError(f"draft_tokens must be an integer >= 0 (0 = off), got {draft_tokens!r}")
        if draft_tokens and "mtp" not in self.params:
            raise ValueError("draft_tokens > 0 needs the model's MTP module: load it with dsr1.load(..., mtp=True) "
                             "(or dsr1.init_random(..., mtp=True) with num_nextn_predict_layers >= 1)")
        return draft_tokens

    def check_prompt(self, tokens: Any, lengths: Any = None) -> tuple[jax.Array, jax.Array]:
        """Validate right-padded prompts `tokens [B, T]` with `lengths [B]` (default T) and place
        both on the mesh; raises a ValueError naming the bad token, length or size."""
        tokens = self._check_tokens(np.asarray(tokens), ndim=2)
        b, t = tokens.shape
        lengths = np.full(b, t, np.int32) if lengths is None else np.asarray(lengths)
        if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"lengths must be {b} integers, got {lengths.dtype}{list(lengths.shape)}")
        if ((lengths < 1) | (lengths > t)).any():
            raise ValueError(f"lengths {lengths.tolist()} must be within [1, {t}] (the padded prompt length)")
        if t > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt length {t} exceeds max_position_embeddings={self.cfg.max_position_embeddings}")
        return put_replicated((tokens, lengths.astype(np.int32)), self.mesh)


def _resolve(mesh: Mesh | None, dtype: Any) -> tuple[Mesh, jnp.dtype]:
    return (make_mesh() if mesh is None else mesh), jnp.dtype(dtype)


def _check_model_api(cfg: Config, source: str) -> None:
    """`Model` runs the MLA family; a V4 config is run by `dsr1.programs.model_v4` for now."""
    if cfg.compressed_attention:
        raise ConfigError(f"{source}: DeepSeek-V4 (model_type 'deepseek_v4') is not served by dsr1.Model yet: its "
                          f"passes are dsr1.programs.model_v4 (dsr1.core.model_v4), its release files not read yet")


def init_random(cfg: Config, *, seed: int = 0, mesh: Mesh | None = None, dtype: Any = "bfloat16",
                quant: str | None = None, kv_cache_dtype: str | None = None,
                rules: ShardingRules = DEFAULT_RULES, mtp: bool = False) -> Model:
    """A model with random weights (std 1/sqrt(fan_in)), created directly in their shardings.
    The values depend on `seed` only, not on the mesh. `quant="int8"` quantizes the matmul weights.
    `mtp=True` also creates the multi-token-prediction module(s) as `params["mtp"]` (the config
    must have `num_nextn_predict_layers > 0`)."""
    _check_model_api(cfg, "init_random")
    mesh, dtype = _resolve(mesh, dtype)
    if mtp and not cfg.num_nextn_predict_layers:
        raise ValueError("init_random(mtp=True) needs a config with num_nextn_predict_layers > 0")
    params = cpu.prepare(programs.init_params(cfg, mesh, rules, seed=seed, dtype=dtype, quant=quant, mtp=mtp), cfg,
                         mesh)
    return Model(cfg, params, mesh, kv_cache_dtype, rules)


def load(path: str | Path, *, mesh: Mesh | None = None, dtype: Any = "bfloat16", quant: str | None = None,
         kv_cache_dtype: str | None = None, mtp: bool = False, progress: bool = True,
         rules: ShardingRules = DEFAULT_RULES) -> Model:
    """Load a checkpoint into `mesh`: a HF safetensors folder in the release layout (bf16, f32 or
    FP8 block-scaled) or a folder written by `python -m dsr1 convert`.

    `quant="int8"` holds the matmul weights as int8 with per-output-channel scales (embeddings,
    norms, router and lm_head stay in `dtype`); a converted int8 checkpoint is int8 already.
    `mtp=True` also loads the multi-token-prediction module as `params["mtp"]`. The folder's
    `tokenizer.json`, when it has one, becomes `Model.tokenizer`.

    Throughput: the progress bar shows bytes read and GB/s as it goes; at the end the logger
    `dsr1.weights` logs (INFO) a `dsr1.weights.throughput.Throughput` as the record's `throughput`
    attribute: `.bytes` this process read from disk (the regions of the checkpoint's tensors its
    devices hold, FP8 scales included, plus the tensors every device holds whole; `.reads` lists
    them), `.seconds` until every weight is on its devices, and `.gbps`.
    """
    mesh, dtype = _resolve(mesh, dtype)
    cfg = Config.from_hf(path)
    _check_model_api(cfg, str(path))
    params, read = load_params(path, cfg, mesh, rules, dtype, quant=check_quant(quant), mtp=mtp, progress=progress,
                               host=cpu_loading.host_layout(mesh))
    log.info("loaded %s: read %s", path, read, extra={"throughput": read})
    params = cpu.prepare(params, cfg, mesh)
    return Model(cfg, params, mesh, kv_cache_dtype, rules, checkpoint_tokenizer(path))
