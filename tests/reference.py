"""Tiny random DeepSeek-V3 checkpoints in the release layout, and HF transformers as the reference.

`write_checkpoint` draws weights with numpy and writes them as the release does: `[out, in]`
linear weights, one tensor per expert, the router bias as `e_score_correction_bias`, optionally an
MTP layer. HF `DeepseekV3ForCausalLM.from_pretrained` reads that folder itself (fusing the
per-expert tensors), which proves the layout; its float32 logits are the reference.
`write_release` writes the release's precision: FP8 e4m3 per 128x128 block (`fp8_blocks`) for
the tensors the release quantizes (`is_fp8_in_release`), bf16 for the rest.

Random routers produce near-ties at top-k boundaries; two correct float32 implementations may then
pick different experts. `reference_logits` measures the reference's smallest routing margin so a
fixture can re-draw its seed instead of loosening tolerances.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

BASE = dict(
    vocab_size=220, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=20,
    qk_nope_head_dim=7, qk_rope_head_dim=6, v_head_dim=5, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
    scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, attention_bias=False,
    num_key_value_heads=4, rope_interleave=True, torch_dtype="float32",
)

# Variants exercised by the parity tests: group-limited routing with q_lora and odd head dims;
# plain q_proj with one group, unnormalized weights, two shared experts and no dense layer.
CONFIGS: dict[str, dict[str, Any]] = {
    "grouped_qlora": BASE,
    "plain_q_one_group": {**BASE, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                          "n_shared_experts": 2, "first_k_dense_replace": 0, "num_experts_per_tok": 3,
                          "routed_scaling_factor": 1.5, "qk_nope_head_dim": 8, "v_head_dim": 9},
}

FP8_MAX = 448.0


def hf_config(overrides: dict[str, Any]) -> dict[str, Any]:
    cfg = {**BASE, **overrides}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def _linear(rng: np.random.Generator, out: int, inp: int, gain: float = 1.0) -> np.ndarray:
    return (gain * rng.standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)


def release_tensors(cfg: dict[str, Any], seed: int, mtp: bool = False, calm: bool = False) -> dict[str, np.ndarray]:
    """Random weights named and shaped as in the DeepSeek release checkpoint.

    By default some projections get gains of 2-3: activations and routing become sensitive, which
    makes float32 parity tests sharper. `calm=True` uses unit gains, closer to a trained model's
    behaviour under rounding (fewer routing flips), for precision measurements.
    """
    rng = np.random.default_rng(seed)
    if calm:
        _linear_gained = _linear
        linear = lambda r, out, inp, gain=1.0: _linear_gained(r, out, inp)  # noqa: E731
    else:
        linear = _linear
    d, h, r = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    e, f_moe = cfg["n_routed_experts"], cfg["moe_intermediate_size"]

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        "model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], d)).astype(np.float32),
        "model.norm.weight": norm(d),
        "lm_head.weight": linear(rng, cfg["vocab_size"], d, gain=2.0),
    }
    n_layers = cfg["num_hidden_layers"] + (cfg["num_nextn_predict_layers"] if mtp else 0)
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if cfg["q_lora_rank"] is None:
            t[p + "self_attn.q_proj.weight"] = linear(rng, h * (nope + rope), d)
        else:
            q = cfg["q_lora_rank"]
            t[p + "self_attn.q_a_proj.weight"] = linear(rng, q, d)
            t[p + "self_attn.q_a_layernorm.weight"] = norm(q)
            t[p + "self_attn.q_b_proj.weight"] = linear(rng, h * (nope + rope), q, gain=2.0)
        t[p + "self_attn.kv_a_proj_with_mqa.weight"] = linear(rng, r + rope, d, gain=2.0)
        t[p + "self_attn.kv_a_layernorm.weight"] = norm(r)
        t[p + "self_attn.kv_b_proj.weight"] = linear(rng, h * (nope + v), r, gain=2.0)
        t[p + "self_attn.o_proj.weight"] = linear(rng, d, h * v)
        if layer < cfg["first_k_dense_replace"]:
            f = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = linear(rng, f, d)
            t[p + "mlp.up_proj.weight"] = linear(rng, f, d)
            t[p + "mlp.down_proj.weight"] = linear(rng, d, f)
            continue
        t[p + "mlp.gate.weight"] = linear(rng, e, d, gain=3.0)
        # A non-zero correction bias that changes selections but keeps biased scores positive.
        t[p + "mlp.gate.e_score_correction_bias"] = rng.uniform(-0.08, 0.08, e).astype(np.float32)
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            t[q + "gate_proj.weight"] = linear(rng, f_moe, d)
            t[q + "up_proj.weight"] = linear(rng, f_moe, d)
            t[q + "down_proj.weight"] = linear(rng, d, f_moe)
        if cfg["n_shared_experts"]:
            fs = f_moe * cfg["n_shared_experts"]
            t[p + "mlp.shared_experts.gate_proj.weight"] = linear(rng, fs, d)
            t[p + "mlp.shared_experts.up_proj.weight"] = linear(rng, fs, d)
            t[p + "mlp.shared_experts.down_proj.weight"] = linear(rng, d, fs)
    if mtp:
        for layer in range(cfg["num_hidden_layers"], n_layers):
            p = f"model.layers.{layer}."
            t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].copy()
            t[p + "enorm.weight"] = norm(d)
            t[p + "hnorm.weight"] = norm(d)
            t[p + "eh_proj.weight"] = linear(rng, d, 2 * d)
            t[p + "shared_head.norm.weight"] = norm(d)
            t[p + "shared_head.head.weight"] = linear(rng, cfg["vocab_size"], d)
    return t


def write_checkpoint(folder: Path, cfg: dict[str, Any], tensors: dict[str, np.ndarray],
                     shards: int = 2, dtype: str = "float32") -> Path:
    """Write `config.json`, safetensors shards and `model.safetensors.index.json` like the release."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    names = sorted(tensors)
    weight_map = {}
    torch_dtype = getattr(torch, dtype)
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:06d}.safetensors"
        part = {n: torch.from_numpy(np.ascontiguousarray(tensors[n])).to(torch_dtype) for n in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def routing_margin(router_logits: np.ndarray, bias: np.ndarray, cfg: dict[str, Any]) -> float:
    """Smallest gap at a selection boundary (group top-k and expert top-k) over all tokens."""
    scores = 1.0 / (1.0 + np.exp(-router_logits.astype(np.float64))) + bias
    n, e = scores.shape
    g, kg, k = cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]
    margins = []
    if kg < g:
        group_scores = np.sort(scores.reshape(n, g, e // g), axis=-1)[..., -2:].sum(-1)
        ordered = np.sort(group_scores, axis=-1)[:, ::-1]
        margins.append(ordered[:, kg - 1] - ordered[:, kg])
        kept = np.argsort(-group_scores, axis=-1)[:, :kg]
        mask = np.zeros((n, g), bool)
        np.put_along_axis(mask, kept, True, axis=1)
        scores = np.where(np.repeat(mask, e // g, axis=1), scores, -np.inf)
    ordered = np.sort(scores, axis=-1)[:, ::-1]
    margins.append(ordered[:, k - 1] - ordered[:, k])
    return float(min(m.min() for m in margins))


def reference_logits(folder: Path, tokens: np.ndarray, dtype: str = "float32") -> tuple[np.ndarray, float]:
    """HF logits `[B, T, V]` (as float32) computed in `dtype`, and the smallest routing margin seen."""
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype),
                                                        output_loading_info=True)
    cfg = json.loads((folder / "config.json").read_text())
    mtp_prefix = f"model.layers.{cfg['num_hidden_layers']}."  # HF has no MTP module; it may skip it
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(mtp_prefix)]
    assert not info["missing_keys"] and not unexpected, \
        f"HF could not load the release layout: missing {info['missing_keys']}, unexpected {unexpected}"
    model.eval()
    margins: list[float] = []

    def hook(module, inputs, outputs):
        margins.append(routing_margin(outputs[0].detach().float().numpy(),
                                      module.e_score_correction_bias.float().numpy(), cfg))

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    with torch.no_grad():
        logits = model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()
    for handle in handles:
        handle.remove()
    return logits, min(margins, default=math.inf)


def is_fp8_in_release(name: str) -> bool:
    """The release stores every layer's *_proj matmul in FP8, except the MTP projection eh_proj, and
    V3.2's indexer `wq_b` and `wk` (not its `weights_proj`: the official code declares it in the
    default dtype)."""
    if ".indexer." in name:
        return name.endswith((".indexer.wq_b.weight", ".indexer.wk.weight"))
    return (name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
            and ".eh_proj." not in name)


def fp8_blocks(w: np.ndarray, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fp8 weight, scale_inv per 128x128 block, the dequantized weight), block by block. `ue8m0`:
    each scale rounded up to a power of two, as V3.1's release (`scale_fmt: "ue8m0"`) stores them."""
    rows, cols = w.shape
    nr, nc = -(-rows // 128), -(-cols // 128)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    scale = np.empty((nr, nc), np.float32)
    deq = np.empty(w.shape, np.float32)
    for i in range(nr):
        for j in range(nc):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(block).max() / FP8_MAX
            if ue8m0:
                scale[i, j] = 2.0 ** np.ceil(np.log2(scale[i, j]))
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
            deq[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (
                q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(np.float32) * scale[i, j])
    return q, scale, deq


def write_release(folder: Path, config: dict, tensors: dict[str, np.ndarray], ue8m0: bool = False
                  ) -> dict[str, np.ndarray]:
    """An FP8 release-layout folder of `tensors` in three shards; returns the weights it stands for."""
    import torch
    from safetensors.torch import save_file

    fp8_tensors, dequantized = {}, {}
    for name, w in tensors.items():
        if is_fp8_in_release(name):
            q, scale, deq = fp8_blocks(w, ue8m0)
            fp8_tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            fp8_tensors[name + "_scale_inv"] = torch.from_numpy(scale)
            dequantized[name] = deq
        else:
            fp8_tensors[name] = torch.from_numpy(w).to(torch.bfloat16)
            dequantized[name] = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(fp8_tensors)
    weight_map = {}
    for i in range(3):
        file = f"model-{i + 1:05d}-of-000003.safetensors"
        save_file({n: fp8_tensors[n].contiguous() for n in names[i::3]}, str(folder / file))
        weight_map.update({n: file for n in names[i::3]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dequantized
