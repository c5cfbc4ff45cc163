"""Trained weights to a HF folder in the release layout (what `dsr1.load` and transformers read).

`config.json` (`Config.to_hf_dict()`, `architectures: ["DeepseekV3ForCausalLM"]`, one MTP layer),
`model.safetensors` in bf16 with the release's tensor names (one tensor per expert, `kv_b_proj`
whole, the MTP module as layer `num_hidden_layers`), `tokenizer.json` and `tokenizer_config.json`.
Each weight is the inverse of the loader's `Source.to_ours`; written to `FOLDER.tmp`, then renamed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from ..core.config import Config
from ..core.params import loading_units, unit_specs
from ..weights.release import is_source, weight_sources

WEIGHTS = "model.safetensors"
ROUTER_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def _to_release(ours: np.ndarray, src, cfg: Config) -> np.ndarray:
    """One weight of ours (one layer, one expert) in the release's layout, the inverse of `src.to_ours`."""
    if src.name.endswith("kv_b_proj.weight"):
        raise AssertionError("kv_b_proj is assembled from wk_b and wv_b")
    if src.to_ours.__name__ == "_transposed":
        return np.ascontiguousarray(ours.reshape(src.hf_shape[::-1]).T)
    return ours.reshape(src.hf_shape)


def _kv_b(layer: dict, cfg: Config) -> np.ndarray:
    """`kv_b_proj` `[h * (nope + v), r]` from our `wk_b [h, nope, r]` and `wv_b [h, v, r]`."""
    h, r = cfg.num_attention_heads, cfg.kv_lora_rank
    kv_b = np.concatenate([layer["wk_b"], layer["wv_b"]], axis=1)
    return kv_b.reshape(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r)


def _first_layer(cfg: Config, unit: str) -> int:
    """The release layer number of a stack's first layer."""
    return {"dense_layers": 0, "moe_layers": cfg.num_dense_layers, "mtp": cfg.num_hidden_layers}[unit]


def release_tensors(params: dict, cfg: Config, dtype: Any = ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """Every release tensor of `params` (float weights in our stacked layout, MTP under "mtp")."""
    mtp = "mtp" in params
    sources = weight_sources(cfg, mtp=mtp)
    host = jax.tree.map(np.asarray, jax.device_get(params))
    out: dict[str, np.ndarray] = {}
    for unit, layer in loading_units(cfg, host):
        if unit == "globals":
            names = list(unit_specs(host, unit))
            weights, srcs = {k: host[k] for k in names}, {k: sources[k] for k in names}
        else:
            i = layer - _first_layer(cfg, unit)
            weights, srcs = jax.tree.map(lambda a: a[i], host[unit]), sources[unit]
        for src, w in zip(jax.tree.leaves(srcs, is_leaf=is_source), jax.tree.leaves(weights)):
            name = src.name.format(layer=layer, expert="{expert}")
            if name.endswith("kv_b_proj.weight"):
                kv_owner = weights["block"] if unit == "mtp" else weights
                out[name] = _kv_b(kv_owner, cfg)
            elif src.per_expert:
                for e in range(cfg.n_routed_experts):
                    out[name.format(expert=e)] = _to_release(w[e], src, cfg)
            else:
                out[name] = _to_release(w, src, cfg)
    # The router (`mlp.gate.weight`) and its bias stay float32, as trained: routing is sensitive to them.
    return {k: v.astype(np.float32 if k.endswith(ROUTER_TENSORS) else dtype) for k, v in out.items()}


def hf_config(cfg: Config) -> dict:
    """`config.json` of the exported model (one MTP layer, bf16)."""
    d = cfg.to_hf_dict()
    d.update(num_nextn_predict_layers=max(1, cfg.num_nextn_predict_layers), torch_dtype="bfloat16")
    return d


def export(params: dict, cfg: Config, tokenizer_folder: str | Path, folder: str | Path) -> Path:
    """Write the release-layout folder (config, bf16 weights with MTP, tokenizer) to `folder`, atomically."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    save_file(release_tensors(params, cfg), str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / WEIGHTS).chmod(0o644)  # safetensors writes 0600; the folder ships as package data
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_folder) / name, tmp / name)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder

