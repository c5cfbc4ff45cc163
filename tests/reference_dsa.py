"""Tiny random DeepSeek-V3.2 checkpoints (DeepSeek Sparse Attention) and their two references.

- `official_forward`: a float32 transcription of the official `inference/model.py` of
  deepseek-ai/DeepSeek-V3.2-Exp (its update of 2025-11-17: the indexer's rope on halves,
  `interleaved=False`), in torch, from the release-layout tensors: `Indexer` (Hadamard rotation
  included; the FP8 quantization of q and k left out: this is the exact form), `MLA` in its prefill
  form (the indexer's top-k scattered into a -inf mask on the causal scores), `Gate` with the
  correction bias (the release's 7168-wide gate has it; the code keys it on `dim == 7168`), `MoE`,
  `Block`, `Transformer`. Its prefill is causal in everything (the mask is added before the top-k),
  so its logits at position t over a whole sequence are those of its prefill of the first t + 1
  tokens: the logits `Transformer.forward` returns for that prefix.
- `hf_token_by_token`: transformers' `DeepseekV32ForCausalLM` fed one token at a time with its
  cache (its full-sequence forward disagrees with it once the selection matters: docs/design.md).

Random indexers and routers produce near-ties at top-k boundaries (and exact ties where every
head's dot product is negative: the score is 0); `official_forward` measures the smallest margins so
a fixture can re-draw its seed instead of loosening tolerances.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from . import reference

V32 = {**reference.BASE, "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
       "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, "max_position_embeddings": 64}
V32.pop("rope_interleave")

# Group-limited routing with a dense first layer and an MTP layer; one group without a dense layer.
CONFIGS: dict[str, dict[str, Any]] = {
    "v32_grouped_mtp": {**V32, "num_nextn_predict_layers": 1},
    "v32_one_group": {**V32, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "n_shared_experts": 2,
                      "num_experts_per_tok": 3, "routed_scaling_factor": 1.5, "qk_nope_head_dim": 8},
}
MIN_INDEX_MARGIN = 1e-4  # relative gap at the top-k boundary below which float32 rounding may flip a choice


def v32_tensors(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Release-layout tensors: V3's (`reference.release_tensors`, MTP layer included where the
    config has one) plus every layer's indexer."""
    mtp = bool(cfg["num_nextn_predict_layers"])
    t = reference.release_tensors(cfg, seed, mtp=mtp)
    rng = np.random.default_rng(10_000 + seed)
    d, q, hi, di = cfg["hidden_size"], cfg["q_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"]
    for layer in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{layer}.self_attn.indexer."
        t[p + "wq_b.weight"] = reference._linear(rng, hi * di, q, gain=2.0)
        t[p + "wk.weight"] = reference._linear(rng, di, d, gain=2.0)
        t[p + "k_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(di)).astype(np.float32)
        t[p + "k_norm.bias"] = (0.1 * rng.standard_normal(di)).astype(np.float32)
        t[p + "weights_proj.weight"] = reference._linear(rng, hi, d)
    return t


@dataclasses.dataclass
class Margins:
    """The smallest gaps seen at selection boundaries: routing (absolute, as `reference.routing_margin`)
    and the indexer's top-k (relative to the row's largest |score|)."""

    routing: float = math.inf
    index: float = math.inf


# ---- the transcription of inference/model.py ------------------------------------------------------

def _freqs_cis(cfg: dict[str, Any], seqlen: int):
    """`precompute_freqs_cis` (YaRN where max_seq_len exceeds the original length)."""
    import torch

    s, dim, base = cfg["rope_scaling"], cfg["qk_rope_head_dim"], cfg["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if cfg["max_position_embeddings"] > s["original_max_position_embeddings"]:
        def correction(rot):
            return dim * math.log(s["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(correction(s["beta_fast"])), 0), min(math.ceil(correction(s["beta_slow"])), dim - 1)
        high = high + 0.001 if low == high else high
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        freqs = freqs / s["factor"] * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotary(x, freqs_cis, interleaved: bool = True):
    """`apply_rotary_emb` on `x [B, S, H, d]`."""
    import torch

    shape = x.shape
    if not interleaved:
        x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    z = torch.view_as_complex(x.float().contiguous().reshape(*shape[:-1], -1, 2))
    y = torch.view_as_real(z * freqs_cis.view(1, z.size(1), 1, z.size(-1))).flatten(3)
    return torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1) if not interleaved else y


def _hadamard(n: int):
    """`rotate_activation`'s transform as a matrix: Sylvester's Hadamard matrix times n^-0.5."""
    import torch

    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return torch.from_numpy(h * n ** -0.5).float()


def _rms(x, w, eps: float):
    import torch

    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _indexer(w, p: str, cfg: dict[str, Any], x, qr, freqs_cis, mask, margins: Margins):
    """`Indexer.forward` (prefill, start_pos 0): top-k indices `[B, S, k]`."""
    import torch
    import torch.nn.functional as F

    b, s, _ = x.shape
    hi, di, rope = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    q = (qr @ w[p + "wq_b.weight"].T).view(b, s, hi, di)
    q_pe, q_nope = torch.split(q, [rope, di - rope], dim=-1)
    q = torch.cat([_rotary(q_pe, freqs_cis, interleaved=False), q_nope], dim=-1)
    k = F.layer_norm(x @ w[p + "wk.weight"].T, (di,), w[p + "k_norm.weight"], w[p + "k_norm.bias"], 1e-6)
    k_pe, k_nope = torch.split(k, [rope, di - rope], dim=-1)
    k = torch.cat([_rotary(k_pe.unsqueeze(2), freqs_cis, interleaved=False).squeeze(2), k_nope], dim=-1)
    rot = _hadamard(di)
    q, k = q @ rot, k @ rot
    weights = (x @ w[p + "weights_proj.weight"].T) * hi ** -0.5 * di ** -0.5
    # fp8_index: sum over heads of relu(q . k) times the head's weight
    score = torch.einsum("bshd,btd->bsht", q, k).relu().mul(weights.unsqueeze(-1)).sum(2) + mask
    topk = min(cfg["index_topk"], s)
    _index_margin(score, topk, margins)
    return score.topk(topk, dim=-1)[1]


def _index_margin(score, topk: int, margins: Margins) -> None:
    """The smallest relative gap between the k-th and the next score of a query seeing more than k."""
    import torch

    ordered = score.sort(dim=-1, descending=True)[0]
    rows = torch.isfinite(ordered).sum(-1) > topk
    if rows.any():
        gap = (ordered[..., topk - 1] - ordered[..., topk]) / ordered[..., 0].abs().clamp_min(1e-30)
        margins.index = min(margins.index, float(gap[rows].min()))


def _mla(w, p: str, cfg: dict[str, Any], x, freqs_cis, mask, margins: Margins):
    """`MLA.forward` in its prefill form (`mask is not None`)."""
    import torch

    b, s, _ = x.shape
    h, nope, rope, v, r = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim", "kv_lora_rank"))
    qr = _rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], 1e-6)
    q = (qr @ w[p + "q_b_proj.weight"].T).view(b, s, h, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    q = torch.cat([q_nope, _rotary(q_pe, freqs_cis)], dim=-1)
    kv, k_pe = torch.split(x @ w[p + "kv_a_proj_with_mqa.weight"].T, [r, rope], dim=-1)
    kv = (_rms(kv, w[p + "kv_a_layernorm.weight"], 1e-6) @ w[p + "kv_b_proj.weight"].T).view(b, s, h, nope + v)
    k_nope, values = torch.split(kv, [nope, v], dim=-1)
    k = torch.cat([k_nope, _rotary(k_pe.unsqueeze(2), freqs_cis).expand(-1, -1, h, -1)], dim=-1)
    sc = cfg["rope_scaling"]
    mscale = 0.1 * sc["mscale"] * math.log(sc["factor"]) + 1.0
    scores = torch.einsum("bshd,bthd->bsht", q, k) * (nope + rope) ** -0.5 * mscale * mscale
    topk_indices = _indexer(w, p + "indexer.", cfg, x, qr, freqs_cis, mask, margins)
    index_mask = torch.full((b, s, s), float("-inf")).scatter_(-1, topk_indices, 0) + mask
    probs = (scores + index_mask.unsqueeze(2)).softmax(dim=-1)
    return torch.einsum("bsht,bthd->bshd", probs, values).flatten(2) @ w[p + "o_proj.weight"].T


def _mlp(w, p: str, x):
    import torch.nn.functional as F

    return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def _moe(w, p: str, cfg: dict[str, Any], x, margins: Margins):
    """`Gate` (sigmoid scores, correction bias, group-limited top-k, normalized, scaled) and `MoE`."""
    import torch

    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    logits = x @ w[p + "gate.weight"].T
    bias = w[p + "gate.e_score_correction_bias"]
    margins.routing = min(margins.routing, reference.routing_margin(logits.numpy(), bias.numpy(), cfg))
    original = logits.sigmoid()
    scores = original + bias
    groups, e = cfg["n_group"], cfg["n_routed_experts"]
    if groups > 1:
        grouped = scores.view(x.size(0), groups, -1)
        kept = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(cfg["topk_group"], dim=-1)[1]
        drop = torch.ones(x.size(0), groups, dtype=torch.bool).scatter_(1, kept, False)
        scores = grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)
    indices = scores.topk(cfg["num_experts_per_tok"], dim=-1)[1]
    weights = original.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True) * cfg["routed_scaling_factor"]
    y = torch.zeros_like(x)
    for i in range(e):
        rows, slot = torch.where(indices == i)
        if len(rows):
            y[rows] += _mlp(w, f"{p}experts.{i}.", x[rows]) * weights[rows, slot, None]
    return (y + _mlp(w, p + "shared_experts.", x)).view(shape)


def _block(w, layer: int, cfg: dict[str, Any], x, freqs_cis, mask, margins: Margins):
    """`Block.forward`: pre-norm MLA with its indexer, then the MLP (dense layers) or MoE."""
    p, eps = f"model.layers.{layer}.", cfg["rms_norm_eps"]
    x = x + _mla(w, p + "self_attn.", cfg, _rms(x, w[p + "input_layernorm.weight"], eps), freqs_cis, mask, margins)
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    dense = layer < cfg["first_k_dense_replace"]
    return x + (_mlp(w, p + "mlp.", h) if dense else _moe(w, p + "mlp.", cfg, h, margins))


def official_forward(tensors: dict[str, np.ndarray], cfg: dict[str, Any], tokens: np.ndarray,
                     margins: Margins | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`Transformer.forward` of unpadded `tokens [B, S]` at every position: float32 logits `[B, S, V]`,
    and the residual stream entering the final norm `[B, S, D]` (the MTP layer's input)."""
    import torch

    w = {k: torch.from_numpy(np.ascontiguousarray(v)).float() for k, v in tensors.items()}
    margins = margins or Margins()
    s = tokens.shape[1]
    freqs_cis, mask = _freqs_cis(cfg, s), torch.full((s, s), float("-inf")).triu_(1)
    with torch.no_grad():
        x = w["model.embed_tokens.weight"][torch.from_numpy(np.asarray(tokens, np.int64))]
        for layer in range(cfg["num_hidden_layers"]):
            x = _block(w, layer, cfg, x, freqs_cis, mask, margins)
        logits = _rms(x, w["model.norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
    return logits.numpy(), x.numpy()


def official_mtp(tensors: dict[str, np.ndarray], cfg: dict[str, Any], hidden: np.ndarray, next_tokens: np.ndarray,
                 margins: Margins | None = None) -> np.ndarray:
    """The MTP layer (`model.layers.{num_hidden_layers}`: V3's `eh_proj([enorm(embed(t+1)); hnorm(h)])`,
    then a block with its own indexer, then its shared head) over full sequences: logits `[B, S, V]`."""
    import torch

    w = {k: torch.from_numpy(np.ascontiguousarray(v)).float() for k, v in tensors.items()}
    layer, eps, s = cfg["num_hidden_layers"], cfg["rms_norm_eps"], hidden.shape[1]
    p = f"model.layers.{layer}."
    freqs_cis, mask = _freqs_cis(cfg, s), torch.full((s, s), float("-inf")).triu_(1)
    with torch.no_grad():
        e = _rms(w[p + "embed_tokens.weight"][torch.from_numpy(np.asarray(next_tokens, np.int64))],
                 w[p + "enorm.weight"], eps)
        h = _rms(torch.from_numpy(hidden), w[p + "hnorm.weight"], eps)
        x = torch.cat([e, h], dim=-1) @ w[p + "eh_proj.weight"].T
        x = _block(w, layer, cfg, x, freqs_cis, mask, margins or Margins())
        return (_rms(x, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T).numpy()


# ---- transformers' deepseek_v32 ------------------------------------------------------------------

def hf_model(folder: Path):
    """`DeepseekV32ForCausalLM.from_pretrained` of a release-layout folder (float32), checking that every
    tensor it needs was found (it has no MTP module and skips that layer's tensors)."""
    import torch
    import transformers
    from transformers import DeepseekV32ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model, info = DeepseekV32ForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], f"HF could not load the release layout: missing {info['missing_keys']}"
    return model.eval()


def hf_token_by_token(model, tokens: list[int]) -> np.ndarray:
    """HF's logits `[S, V]` at every position of one sequence fed one token at a time with its cache."""
    import torch

    cache, out = None, []
    with torch.no_grad():
        for token in tokens:
            step = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = step.past_key_values
            out.append(step.logits[0, -1].float().numpy())
    return np.stack(out)


def hf_full_sequence(model, tokens: list[int]) -> np.ndarray:
    """HF's logits `[S, V]` of one whole-sequence forward."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float().numpy()


def hf_greedy_token_by_token(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt` by HF's token-by-token path (`new_tokens` of them, EOS included)."""
    import torch

    cache, out, feed = None, [], list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            for token in feed:
                step = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
                cache = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            feed = [out[-1]]
    return out
