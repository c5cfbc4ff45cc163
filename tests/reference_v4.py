"""Tiny random DeepSeek-V4 models and their two references, float32.

- `official_logits`: a torch transcription of the official V4 `inference/model.py` (the V4-Pro
  release folder's; its `kernel.py`'s `sparse_attn` and `hc_split_sinkhorn`) in its prefill form
  (`start_pos == 0`) on the release's tensor names (`official_state`), exact: `act_quant`,
  `fp4_act_quant` and the Hadamard rotation (orthogonal, applied to both sides of the indexer's
  products) left out. Its prefill is causal in everything (the window, each entry's visibility
  `w < (t + 1) // ratio`, the indexer's mask before its top-k), so the head applied at every position
  gives what `Transformer.forward` (which keeps the last) returns for each prefix.
- `hf_token_by_token`: transformers' `DeepseekV4ForCausalLM` fed one token at a time with its cache
  (its full-sequence forward disagrees with it once compressed entries matter: docs/design.md).

The weights are drawn in dsr1's layout from its declarations (`dsr1.core.params.float_specs`) with
NumPy (`random_params`), and mapped to the official and HF names here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dsr1.core.config import CSA_RATIO, Config
from dsr1.core.params import float_specs, is_spec, v4_stacks

BASE: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    topk_method="noaux_tc", norm_topk_prob=True, compress_rope_theta=160000.0, rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1),
    hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=1.0, index_n_heads=4, index_head_dim=16,
    max_position_embeddings=64, rms_norm_eps=1e-6, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1)

# Every kind, small windows and ratios (sequences of 3-6 windows), index_topk below the entries.
CONFIGS: dict[str, dict[str, Any]] = {
    "all_kinds": {**BASE, "num_hidden_layers": 4, "compress_ratios": [0, 4, 8, 4, 0], "sliding_window": 8,
                  "num_hash_layers": 2, "hc_mult": 2, "index_topk": 3, "num_nextn_predict_layers": 1},
    "hca_first": {**BASE, "num_hidden_layers": 3, "compress_ratios": [16, 4, 0], "sliding_window": 12,
                  "num_hash_layers": 1, "hc_mult": 4, "index_topk": 5, "num_attention_heads": 8, "o_groups": 4},
}


def config(name: str) -> Config:
    return Config.from_dict(CONFIGS[name])


# ---- weights ----------------------------------------------------------------------------------------

def random_params(cfg: Config, seed: int, mtp: bool = False) -> dict[str, Any]:
    """dsr1-layout weights for `cfg` (NumPy, float32), every declared array drawn (with `mtp`, the MTP
    module's too, drawn last): matrices with std 1/sqrt(fan_in), norms around 1, sinks, biases and
    `ape` spread enough to matter."""
    rng = np.random.default_rng(seed)

    def draw(path, spec):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if spec.init == "expert_ids":
            return np.argsort(rng.random((*spec.shape[:-1], spec.fan_in)), -1)[..., :spec.shape[-1]].astype(np.int32)
        if spec.init == "ones":
            return (1.0 + 0.2 * rng.standard_normal(spec.shape)).astype(np.float32)
        if spec.init == "bias":
            return ((1.0 if name.endswith("sinks") else 0.3) * rng.standard_normal(spec.shape)).astype(np.float32)
        gain = 2.0 if name.endswith(("wgate", "weights_proj", "router")) else 1.0
        return (gain * spec.fan_in ** -0.5 * rng.standard_normal(spec.shape)).astype(np.float32)

    import jax

    return jax.tree_util.tree_map_with_path(draw, float_specs(cfg, mtp=mtp), is_leaf=is_spec)


def _layers(cfg: Config, params: dict) -> list[tuple[int, dict]]:
    """(release layer, its weights) in order, each sliced from its stack."""
    out = []
    for name, members in v4_stacks(cfg).items():
        for i, layer in enumerate(members):
            out.append((layer, _tree_map(lambda a, i=i: a[i], params[name])))
    return sorted(out, key=lambda lp: lp[0])


def _tree_map(f, tree):
    return {k: _tree_map(f, v) if isinstance(v, dict) else f(v) for k, v in tree.items()}


def _o_a(o_a: np.ndarray) -> np.ndarray:
    """dsr1's `o_a [G, H/G, d, R]` as the release's `wo_a [G * R, H/G * d]`."""
    g, hg, d, r = o_a.shape
    return o_a.reshape(g, hg * d, r).transpose(0, 2, 1).reshape(g * r, hg * d)


def official_state(cfg: Config, params: dict) -> dict[str, np.ndarray]:
    """The weights under the official code's names, `[out, in]` as its `Linear`s hold them."""
    s = {"embed.weight": params["embed"], "norm.weight": params["final_norm"], "head.weight": params["lm_head"].T,
         "hc_head_fn": params["hc_head"]["fn"].T, "hc_head_base": params["hc_head"]["base"],
         "hc_head_scale": params["hc_head"]["scale"]}
    for layer, p in _layers(cfg, params):
        s.update(_official_layer(f"layers.{layer}.", p))
    if "mtp" in params:
        p = _tree_map(lambda a: a[0], params["mtp"])
        s.update(_official_layer("mtp.0.", p))
        s.update({"mtp.0.e_proj.weight": p["e_proj"].T, "mtp.0.h_proj.weight": p["h_proj"].T,
                  "mtp.0.enorm.weight": p["enorm"], "mtp.0.hnorm.weight": p["hnorm"],
                  "mtp.0.norm.weight": p["head_norm"],
                  "mtp.0.hc_head_fn": p["hc_head"]["fn"].T, "mtp.0.hc_head_base": p["hc_head"]["base"],
                  "mtp.0.hc_head_scale": p["hc_head"]["scale"]})
    return s


def _official_layer(pre: str, p: dict) -> dict[str, np.ndarray]:
    """One `Block`'s weights (a layer's, or an MTP module's) under the official names."""
    s = {}
    for hc in ("attn", "ffn"):
        s[pre + f"hc_{hc}_fn"] = p[f"hc_{hc}"]["fn"].T
        s[pre + f"hc_{hc}_base"], s[pre + f"hc_{hc}_scale"] = p[f"hc_{hc}"]["base"], p[f"hc_{hc}"]["scale"]
    s[pre + "attn_norm.weight"], s[pre + "ffn_norm.weight"] = p["attn_norm"], p["mlp_norm"]
    a = pre + "attn."
    s.update({a + "wq_a.weight": p["q_a"].T, a + "q_norm.weight": p["q_a_norm"],
              a + "wq_b.weight": p["q_b"].reshape(p["q_b"].shape[0], -1).T, a + "wkv.weight": p["kv"].T,
              a + "kv_norm.weight": p["kv_norm"], a + "attn_sink": p["sinks"], a + "wo_a.weight": _o_a(p["o_a"]),
              a + "wo_b.weight": p["o_b"].reshape(-1, p["o_b"].shape[-1]).T})
    if "compressor" in p:
        s.update(_official_compressor(a + "compressor.", p["compressor"]))
    if "indexer" in p:
        ix = p["indexer"]
        s.update(_official_compressor(a + "indexer.compressor.", ix["compressor"]))
        s.update({a + "indexer.wq_b.weight": ix["wq_b"].reshape(ix["wq_b"].shape[0], -1).T,
                  a + "indexer.weights_proj.weight": ix["weights_proj"].T})
    s.update(_official_moe(pre + "ffn.", p["moe"]))
    return s


def _official_compressor(pre: str, c: dict) -> dict[str, np.ndarray]:
    return {pre + "ape": c["ape"], pre + "wkv.weight": c["wkv"].T, pre + "wgate.weight": c["wgate"].T,
            pre + "norm.weight": c["norm"]}


def _official_moe(pre: str, m: dict) -> dict[str, np.ndarray]:
    s = {pre + "gate.weight": m["router"].T}
    s[pre + ("gate.tid2eid" if "tid2eid" in m else "gate.bias")] = m.get("tid2eid", m.get("router_bias"))
    for e in range(m["gate"].shape[0]):
        s.update({pre + f"experts.{e}.w1.weight": m["gate"][e].T, pre + f"experts.{e}.w3.weight": m["up"][e].T,
                  pre + f"experts.{e}.w2.weight": m["down"][e].T})
    sh = m["shared"]
    s.update({pre + "shared_experts.w1.weight": sh["gate"].T, pre + "shared_experts.w3.weight": sh["up"].T,
              pre + "shared_experts.w2.weight": sh["down"].T})
    return s


# ---- the transcription of inference/model.py (prefill, start_pos == 0) ------------------------------

@dataclasses.dataclass
class Margins:
    """The smallest gaps seen at selection boundaries (absolute): the routers' k-th against the
    (k+1)-th biased score, and the indexer's k-th against the (k+1)-th visible score."""

    routing: float = math.inf
    index: float = math.inf


def _freqs_cis(cfg: Config, compressed: bool, seqlen: int):
    """`precompute_freqs_cis`: YaRN (original_seq_len > 0) with `compress_rope_theta` for layers with
    compressed entries, plain `rope_theta` for window-only layers."""
    import torch

    dim, s = cfg.qk_rope_head_dim, cfg.rope_scaling
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if compressed:
        def correction(rot):
            return dim * math.log(s.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(correction(s.beta_fast)), 0), min(math.ceil(correction(s.beta_slow)), dim - 1)
        high = high + 0.001 if low == high else high
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        freqs = freqs / s.factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotary(x, freqs_cis, inverse: bool = False):
    """`apply_rotary_emb` on the last axis of `x [b, s, (h,) d]`, interleaved pairs."""
    import torch

    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    f = freqs_cis.conj() if inverse else freqs_cis
    f = f.view(1, z.size(1), z.size(-1)) if z.ndim == 3 else f.view(1, z.size(1), 1, z.size(-1))
    return torch.view_as_real(z * f).flatten(-2)


def _rms(x, weight, eps):
    import torch

    return weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def _compressor(s: dict, pre: str, x, ratio: int, d: int, freqs_cis, cfg: Config):
    """`Compressor.forward` at start_pos 0: the entries `[b, seqlen // ratio, d]`."""
    import torch

    overlap, rd = ratio == CSA_RATIO, cfg.qk_rope_head_dim
    b, seqlen, _ = x.shape
    kv, score = x @ s[pre + "wkv.weight"].T, x @ s[pre + "wgate.weight"].T
    cutoff = seqlen - seqlen % ratio
    kv, score = kv[:, :cutoff].unflatten(1, (-1, ratio)), score[:, :cutoff].unflatten(1, (-1, ratio)) + s[pre + "ape"]
    if overlap:
        def transform(t, value):  # `overlap_transform`
            new = t.new_full((b, t.size(1), 2 * ratio, d), value)
            new[:, :, ratio:] = t[:, :, :, d:]
            new[:, 1:, :ratio] = t[:, :-1, :, :d]
            return new
        kv, score = transform(kv, 0.0), transform(score, float("-inf"))
    kv = (kv * score.softmax(dim=2)).sum(dim=2)
    kv = _rms(kv, s[pre + "norm.weight"], cfg.rms_norm_eps)
    return torch.cat([kv[..., :-rd], _rotary(kv[..., -rd:], freqs_cis[:cutoff:ratio])], -1)


def _indexer(s: dict, pre: str, x, qr, freqs_cis, offset: int, cfg: Config, margins: Margins):
    """`Indexer.forward` at start_pos 0: the chosen entries' indices (+ offset; -1: none) `[b, s, k]`."""
    import torch

    b, seqlen, _ = x.shape
    ratio, rd, hi, di = CSA_RATIO, cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim
    q = (qr @ s[pre + "wq_b.weight"].T).unflatten(-1, (hi, di))
    q = torch.cat([q[..., :-rd], _rotary(q[..., -rd:], freqs_cis[:seqlen])], -1)
    keys = _compressor(s, pre + "compressor.", x, ratio, di, freqs_cis, cfg)
    weights = (x @ s[pre + "weights_proj.weight"].T) * (di ** -0.5 * hi ** -0.5)
    score = (torch.einsum("bshd,btd->bsht", q, keys).relu() * weights.unsqueeze(-1)).sum(dim=2)
    mask = torch.arange(seqlen // ratio).repeat(seqlen, 1) >= torch.arange(1, seqlen + 1).unsqueeze(1) // ratio
    score = score + torch.where(mask, float("-inf"), 0.0)
    k = min(cfg.index_topk, seqlen // ratio)
    ranked = score.sort(dim=-1, descending=True).values.numpy()
    if ranked.shape[-1] > k:
        contested = np.isfinite(ranked[..., k])
        if contested.any():
            gaps = ranked[..., k - 1][contested] - ranked[..., k][contested]
            margins.index = min(margins.index, float(gaps.min()))
    idx = score.topk(k, dim=-1)[1]
    return torch.where(idx >= torch.arange(1, seqlen + 1).unsqueeze(1) // ratio, -1, idx + offset)


def _window_idxs(window: int, seqlen: int):
    """`get_window_topk_idxs` at start_pos 0."""
    import torch

    base = torch.arange(seqlen).unsqueeze(1)
    matrix = (base - window + 1).clamp(0) + torch.arange(min(seqlen, window))
    return torch.where(matrix > base, -1, matrix)


def _sparse_attn(q, kv, sink, idxs, scale: float):
    """kernel.py's `sparse_attn`: `q [b, s, h, d]` over the rows `idxs [b, s, k]` of `kv [b, n, d]`."""
    import torch

    b, seqlen, h, d = q.shape
    valid = idxs != -1
    picked = kv.unsqueeze(1).expand(b, seqlen, -1, d).gather(2, idxs.clamp_min(0).long().unsqueeze(-1).expand(
        b, seqlen, idxs.size(-1), d))
    scores = torch.einsum("bshd,bskd->bshk", q, picked) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    top = scores.max(dim=-1).values
    e = torch.exp(scores - top.unsqueeze(-1))
    weights = e / (e.sum(-1) + torch.exp(sink.view(1, 1, h) - top)).unsqueeze(-1)
    return torch.einsum("bshk,bskd->bshd", weights, picked)


def _attention(s: dict, pre: str, x, layer: int, cfg: Config, margins: Margins):
    """`Attention.forward` at start_pos 0."""
    import torch

    b, seqlen, _ = x.shape
    ratio, rd, eps = cfg.compress_ratio(layer), cfg.qk_rope_head_dim, cfg.rms_norm_eps
    freqs_cis = _freqs_cis(cfg, ratio > 0, seqlen)
    qr = _rms(x @ s[pre + "wq_a.weight"].T, s[pre + "q_norm.weight"], eps)
    q = (qr @ s[pre + "wq_b.weight"].T).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    q = torch.cat([q[..., :-rd], _rotary(q[..., -rd:], freqs_cis)], -1)
    kv = _rms(x @ s[pre + "wkv.weight"].T, s[pre + "kv_norm.weight"], eps)
    kv = torch.cat([kv[..., :-rd], _rotary(kv[..., -rd:], freqs_cis)], -1)
    idxs = _window_idxs(cfg.sliding_window, seqlen).unsqueeze(0).expand(b, -1, -1)
    if ratio:
        offset = seqlen
        if ratio == CSA_RATIO:
            chosen = _indexer(s, pre + "indexer.", x, qr, freqs_cis, offset, cfg, margins)
        else:  # `get_compress_topk_idxs`
            matrix = torch.arange(seqlen // ratio).repeat(seqlen, 1)
            mask = matrix >= torch.arange(1, seqlen + 1).unsqueeze(1) // ratio
            chosen = torch.where(mask, -1, matrix + offset).unsqueeze(0).expand(b, -1, -1)
        idxs = torch.cat([idxs, chosen], -1)
        if seqlen >= ratio:
            kv = torch.cat([kv, _compressor(s, pre + "compressor.", x, ratio, cfg.head_dim, freqs_cis, cfg)], 1)
    o = _sparse_attn(q, kv, s[pre + "attn_sink"], idxs, cfg.head_dim ** -0.5)
    o = torch.cat([o[..., :-rd], _rotary(o[..., -rd:], freqs_cis, inverse=True)], -1)
    g = cfg.o_groups
    o = torch.einsum("bsgd,grd->bsgr", o.view(b, seqlen, g, -1), s[pre + "wo_a.weight"].view(g, cfg.o_lora_rank, -1))
    return o.flatten(2) @ s[pre + "wo_b.weight"].T


def _moe(s: dict, pre: str, x, ids, cfg: Config, margins: Margins):
    """`Gate` (sqrtsoftplus; hash layers by `tid2eid`), `Expert` with the SwiGLU clamp, `MoE`."""
    import torch
    import torch.nn.functional as F

    shape = x.shape
    x = x.reshape(-1, shape[-1])
    scores = F.softplus(x @ s[pre + "gate.weight"].T).sqrt()
    k = cfg.num_experts_per_tok
    if pre + "gate.tid2eid" in s:
        indices = s[pre + "gate.tid2eid"][ids.flatten()].long()
    else:
        biased = scores + s[pre + "gate.bias"]
        ranked = biased.sort(dim=-1, descending=True).values
        margins.routing = min(margins.routing, float((ranked[:, k - 1] - ranked[:, k]).min()))
        indices = biased.topk(k, dim=-1)[1]
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True) * cfg.routed_scaling_factor

    def expert(prefix, rows):
        limit = cfg.swiglu_limit
        gate, up = rows @ s[prefix + "w1.weight"].T, rows @ s[prefix + "w3.weight"].T
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        return (F.silu(gate) * up) @ s[prefix + "w2.weight"].T

    y = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        rows, slot = torch.where(indices == e)
        if len(rows):
            y[rows] += expert(pre + f"experts.{e}.", x[rows]) * weights[rows, slot, None]
    return (y + expert(pre + "shared_experts.", x)).view(shape)


def _hc_pre(s: dict, name: str, x, cfg: Config):
    """`Block.hc_pre` with kernel.py's `hc_split_sinkhorn`: the input, `post`, `comb`."""
    import torch

    hc, eps = cfg.hc_mult, cfg.hc_eps
    flat = x.flatten(2)
    mixes = (flat @ s[name + "_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    scale, base = s[name + "_scale"], s[name + "_base"]
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(1, 1, hc, hc)
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return torch.sum(pre.unsqueeze(-1) * x, dim=2), post, comb


def _hc_post(x, residual, post, comb):
    import torch

    return post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)


def _block(s: dict, pre: str, h, layer: int, ids, cfg: Config, margins: Margins):
    """`Block.forward` at start_pos 0 on the streams `h [b, s, hc, D]`."""
    residual = h
    x, post, comb = _hc_pre(s, pre + "hc_attn", h, cfg)
    x = _attention(s, pre + "attn.", _rms(x, s[pre + "attn_norm.weight"], cfg.rms_norm_eps), layer, cfg, margins)
    h = _hc_post(x, residual, post, comb)
    residual = h
    x, post, comb = _hc_pre(s, pre + "hc_ffn", h, cfg)
    x = _moe(s, pre + "ffn.", _rms(x, s[pre + "ffn_norm.weight"], cfg.rms_norm_eps), ids, cfg, margins)
    return _hc_post(x, residual, post, comb)


def _head(s: dict, pre: str, h, cfg: Config):
    """`ParallelHead.forward` at every position: `hc_head`, the norm `pre + norm`, the head."""
    import torch

    flat = h.flatten(2)
    mixes = (flat @ s[pre + "hc_head_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    pre_w = torch.sigmoid(mixes * s[pre + "hc_head_scale"] + s[pre + "hc_head_base"]) + cfg.hc_eps
    x = torch.sum(pre_w.unsqueeze(-1) * h, dim=2)
    return _rms(x, s[pre + "norm.weight"], cfg.rms_norm_eps) @ s["head.weight"].T


def official_logits(cfg: Config, state: dict[str, np.ndarray], tokens: np.ndarray, margins: Margins | None = None,
                    streams: bool = False):
    """The transcription's logits `[b, s, V]` at every position of `tokens [b, s]` (float32); with
    `streams`, also the residual streams after the last layer `[b, s, hc, D]` (the MTP module's input)."""
    import torch

    s = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
    margins = margins if margins is not None else Margins()
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    with torch.no_grad():
        h = s["embed.weight"][ids].unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
        for layer in range(cfg.num_hidden_layers):
            h = _block(s, f"layers.{layer}.", h, layer, ids, cfg, margins)
        logits = _head(s, "", h, cfg).numpy()
    return (logits, h.numpy()) if streams else logits


def official_mtp_logits(cfg: Config, state: dict[str, np.ndarray], streams: np.ndarray, tokens: np.ndarray,
                        margins: Margins | None = None) -> np.ndarray:
    """`MTPBlock.forward` at start_pos 0: the logits `[b, s, V]` of the streams `[b, s, hc, D]` at each
    position with the next tokens `tokens [b, s]`."""
    import torch

    s = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
    ids, eps = torch.from_numpy(np.asarray(tokens, np.int64)), cfg.rms_norm_eps
    with torch.no_grad():
        e = _rms(s["embed.weight"][ids], s["mtp.0.enorm.weight"], eps)
        x = _rms(torch.from_numpy(streams), s["mtp.0.hnorm.weight"], eps)
        x = (e @ s["mtp.0.e_proj.weight"].T).unsqueeze(2) + x @ s["mtp.0.h_proj.weight"].T
        x = _block(s, "mtp.0.", x, cfg.num_hidden_layers, ids, cfg, margins or Margins())
        return _head(s, "mtp.0.", x, cfg).numpy()


# ---- transformers' deepseek_v4 ----------------------------------------------------------------------

def hf_state(cfg: Config, params: dict) -> dict[str, np.ndarray]:
    """The weights under transformers' names (`DeepseekV4ForCausalLM`)."""
    s = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
         "lm_head.weight": params["lm_head"].T, "model.hc_head.hc_fn": params["hc_head"]["fn"].T,
         "model.hc_head.hc_base": params["hc_head"]["base"], "model.hc_head.hc_scale": params["hc_head"]["scale"]}
    for layer, p in _layers(cfg, params):
        pre = f"model.layers.{layer}."
        for hc in ("attn", "ffn"):
            s.update({pre + f"{hc}_hc.fn": p[f"hc_{hc}"]["fn"].T, pre + f"{hc}_hc.base": p[f"hc_{hc}"]["base"],
                      pre + f"{hc}_hc.scale": p[f"hc_{hc}"]["scale"]})
        s[pre + "input_layernorm.weight"], s[pre + "post_attention_layernorm.weight"] = p["attn_norm"], p["mlp_norm"]
        a = pre + "self_attn."
        s.update({a + "q_a_proj.weight": p["q_a"].T, a + "q_a_norm.weight": p["q_a_norm"],
                  a + "q_b_proj.weight": p["q_b"].reshape(p["q_b"].shape[0], -1).T, a + "kv_proj.weight": p["kv"].T,
                  a + "kv_norm.weight": p["kv_norm"], a + "sinks": p["sinks"], a + "o_a_proj.weight": _o_a(p["o_a"]),
                  a + "o_b_proj.weight": p["o_b"].reshape(-1, p["o_b"].shape[-1]).T})
        if "compressor" in p:
            s.update(_hf_compressor(a + "compressor.", p["compressor"]))
        if "indexer" in p:
            ix = p["indexer"]
            s.update(_hf_compressor(a + "compressor.indexer.", ix["compressor"]))
            s.update({a + "compressor.indexer.q_b_proj.weight": ix["wq_b"].reshape(ix["wq_b"].shape[0], -1).T,
                      a + "compressor.indexer.scorer.weights_proj.weight": ix["weights_proj"].T})
        m = pre + "mlp."
        s[m + "gate.weight"] = p["moe"]["router"].T
        if "tid2eid" in p["moe"]:
            s[m + "gate.tid2eid"] = p["moe"]["tid2eid"].astype(np.int64)
        else:
            s[m + "gate.e_score_correction_bias"] = p["moe"]["router_bias"]
        s[m + "experts.gate_up_proj"] = np.concatenate([p["moe"]["gate"], p["moe"]["up"]], -1).transpose(0, 2, 1)
        s[m + "experts.down_proj"] = p["moe"]["down"].transpose(0, 2, 1)
        sh = p["moe"]["shared"]
        s.update({m + "shared_experts.gate_proj.weight": sh["gate"].T, m + "shared_experts.up_proj.weight": sh["up"].T,
                  m + "shared_experts.down_proj.weight": sh["down"].T})
    return s


def _hf_compressor(pre: str, c: dict) -> dict[str, np.ndarray]:
    return {pre + "kv_proj.weight": c["wkv"].T, pre + "gate_proj.weight": c["wgate"].T,
            pre + "position_bias": c["ape"], pre + "kv_norm.weight": c["norm"]}


def hf_model(cfg: Config, params: dict):
    """transformers' `DeepseekV4ForCausalLM` of `cfg` holding `params` (float32, eager attention)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = cfg.to_hf_dict()
    raw.pop("compress_ratios")  # transformers reads `layer_types` and `compress_rates`
    hf_cfg = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_cfg).float().eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_state(cfg, params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"HF V4 state: missing {missing}, unexpected {unexpected}")
    return model


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


def hf_greedy_token_by_token(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt` by HF's token-by-token path (`new_tokens` of them)."""
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
