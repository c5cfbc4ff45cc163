"""DeepSeek-V4's attention: one shared key=value head over a window of raw entries plus compressed ones.

Every layer keeps a window of the last `sliding_window` raw entries (`kv_norm(x W_kv)`, K = V, the
query's own included). A layer of compress ratio m > 0 adds entries each pooling m tokens: the
compressor scores each token's `x W_kv` channel by channel (`x W_gate + ape[position % m]`), and
entry w is the softmax-weighted sum over its tokens, RMS-normalised and roped at position `w m`.
HCA (any ratio but 4) reads every entry; CSA (m = 4) pools 8 slots with overlap (the first half of
the channels of window w-1's tokens, the second half of window w's) and reads the `index_topk`
entries its lightning indexer scores best (the indexer has a compressor of its own, of
`index_head_dim`). Entry w is visible to the query at t iff `w < (t + 1) // m`.

Queries: `q_b(q_norm(q_a x))` per head, RMS-normalised without weight; rope (interleaved, on the
last `qk_rope_head_dim` channels; YaRN'd `compress_rope_theta` where a layer has entries, plain
`rope_theta` where it has none) on queries, window and entries alike. Scores scale by
`head_dim^-0.5`; each head's sink adds `exp(sink)` to its softmax's denominator. The output's rope
slice is rotated back at the query's position, then the grouped projection: heads in `o_groups`
groups, each group's outputs through `o_a` to `o_lora_rank`, all groups through `o_b`.

One function serves every pass: `attend` takes T new tokens per row after `start` cached positions
(prefill: an empty cache; decode: T = 1; chunks of any size between), so chunked prefill and decode
compute what a whole-sequence prefill does. The layer's cache (`LayerCache` arrays) holds the
window as a ring (position p at slot p % window), the compressed entries (and the indexer's), and
the compressor's state: the tokens of the unfinished window (and, for CSA, of the window before)
with their scores, float32. This is the exact float32 form: no FP8/FP4 simulation, no Hadamard
rotation (orthogonal: the indexer's products do not change).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import CSA_RATIO, Config
from .layers import rms_norm
from .products import einsum, matmul
from .rope import rotate, v4_inverse_frequencies

HIGHEST = jax.lax.Precision.HIGHEST
LayerCache = dict[str, jax.Array]  # "window", and "entries", "state_kv", "state_score" (+ "index_*": CSA)


def layer_ratio(cfg: Config, kind: str) -> int:
    """The compress ratio of a layer of attention kind `kind` ("window", "csa", "hca")."""
    return {"window": 0, "csa": CSA_RATIO, "hca": cfg.hca_ratio}[kind]


def empty_layer_cache(cfg: Config, kind: str, batch: int, max_len: int, dtype=jnp.float32) -> LayerCache:
    """One layer's cache for `batch` rows of up to `max_len` positions, holding nothing."""
    cache = {"window": jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype)}
    ratio = layer_ratio(cfg, kind)
    if ratio:
        cache.update(_compressor_cache(ratio, cfg.head_dim, batch, max_len, dtype, ""))
    if kind == "csa":
        cache.update(_compressor_cache(ratio, cfg.index_head_dim, batch, max_len, dtype, "index_"))
    return cache


def _compressor_cache(ratio: int, width: int, batch: int, max_len: int, dtype, prefix: str) -> LayerCache:
    """Entries `[B, max_len // ratio, width]` and the state of `(1 + overlap) * ratio` tokens."""
    wide = 2 if ratio == CSA_RATIO else 1
    state = (batch, wide * ratio, wide * width)
    return {f"{prefix}entries": jnp.zeros((batch, max_len // ratio, width), dtype),
            f"{prefix}state_kv": jnp.zeros(state, jnp.float32),
            f"{prefix}state_score": jnp.full(state, -jnp.inf, jnp.float32)}


def _rope(x: jax.Array, positions: jax.Array, freqs, cfg: Config, inverse: bool = False) -> jax.Array:
    """`x [..., T, (H,) dim]` with its last `qk_rope_head_dim` channels rotated at `positions`."""
    rd = cfg.qk_rope_head_dim
    roped = rotate(x[..., -rd:], positions, freqs, inverse=inverse)
    return jnp.concatenate([x[..., :-rd], roped], axis=-1)


def _unweighted_rms(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _queries(p: dict, x: jax.Array, positions: jax.Array, freqs, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """The query latent `[B, T, q_lora]` and the roped queries `[B, T, H, head_dim]` (float32)."""
    c_q = rms_norm(matmul(x, p["q_a"]), p["q_a_norm"], cfg.rms_norm_eps)
    q = _unweighted_rms(einsum("btq,qhd->bthd", c_q, p["q_b"], preferred_element_type=jnp.float32), cfg.rms_norm_eps)
    return c_q, _rope(q, positions, freqs, cfg)


def _windows(buf: jax.Array, ratio: int, overlap: bool, width: int) -> jax.Array:
    """A compressor buffer `[B, L, (1 + overlap) width]` (slot j: the window j // ratio) as the slots
    each entry pools: `[B, L / ratio - overlap, (1 + overlap) ratio, width]`; with overlap entry j pools
    the first `width` channels of window j's tokens and the last of window j + 1's."""
    b, length, _ = buf.shape
    grouped = buf.reshape(b, length // ratio, ratio, -1)
    if not overlap:
        return grouped
    return jnp.concatenate([grouped[:, :-1, :, :width], grouped[:, 1:, :, width:]], axis=2)


def _row_update(buf: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
    """Per row, `new [B, T, ...]` written into `buf [B, L, ...]` from slot `at [B]`."""
    return jax.vmap(lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n, i, 0))(buf, new, at)


def _row_slice(buf: jax.Array, at: jax.Array, size: int) -> jax.Array:
    return jax.vmap(lambda b, i: jax.lax.dynamic_slice_in_dim(b, i, size, 0))(buf, at)


def compress(p: dict, x: jax.Array, start: jax.Array, counts: jax.Array, cache: LayerCache, prefix: str,
             ratio: int, freqs, cfg: Config) -> LayerCache:
    """The compressor's pass over `counts [B]` new tokens `x [B, T, D]` after `start [B]` positions:
    the cache's `{prefix}entries` with every window these tokens complete written, and its state
    moved on (see the module). Padding tokens (index >= counts) change nothing."""
    overlap, width = ratio == CSA_RATIO, cache[f"{prefix}entries"].shape[-1]
    b, t, _ = x.shape
    positions = start[:, None] + jnp.arange(t)
    fresh = (jnp.arange(t) < counts[:, None])[..., None]
    kv = jnp.where(fresh, jnp.matmul(x.astype(jnp.float32), p["wkv"], precision=HIGHEST), 0.0)
    score = jnp.matmul(x.astype(jnp.float32), p["wgate"], precision=HIGHEST) + p["ape"][positions % ratio]
    score = jnp.where(fresh, score, -jnp.inf)
    # The buffer: the state's windows (from window start // ratio - overlap), then room for the new tokens.
    held = cache[f"{prefix}state_kv"].shape[1]
    length = held + ratio * -(-t // ratio)
    at = overlap * ratio + start % ratio
    buf_kv = _row_update(jnp.pad(cache[f"{prefix}state_kv"], ((0, 0), (0, length - held), (0, 0))), kv, at)
    buf_score = _row_update(jnp.pad(cache[f"{prefix}state_score"], ((0, 0), (0, length - held), (0, 0)),
                                    constant_values=-jnp.inf), score, at)
    slots_kv, slots_score = _windows(buf_kv, ratio, overlap, width), _windows(buf_score, ratio, overlap, width)
    weights = jax.nn.softmax(slots_score, axis=2)
    pooled = jnp.sum(jnp.where(weights > 0, weights * slots_kv, 0.0), axis=2)  # [B, n, width]
    first = start // ratio  # the first entry these tokens may complete
    entry_ids = first[:, None] + jnp.arange(pooled.shape[1])
    normed = rms_norm(pooled, p["norm"], cfg.rms_norm_eps).astype(jnp.float32)
    entries = _rope(normed, entry_ids * ratio, freqs, cfg)
    end = (start + counts) // ratio  # entries complete after these tokens
    held_entries = cache[f"{prefix}entries"]
    n = jnp.arange(held_entries.shape[1])[None, :]
    source = jnp.clip(n - first[:, None], 0, pooled.shape[1] - 1)
    written = (n >= first[:, None]) & (n < end[:, None])
    picked = jnp.take_along_axis(entries, source[..., None], axis=1)
    moved = (end - first) * ratio
    return {**cache, f"{prefix}entries": jnp.where(written[..., None], picked, held_entries).astype(held_entries.dtype),
            f"{prefix}state_kv": _row_slice(buf_kv, moved, held),
            f"{prefix}state_score": _row_slice(buf_score, moved, held)}


def _ring_update(ring: jax.Array, kv: jax.Array, start: jax.Array, counts: jax.Array) -> jax.Array:
    """The window ring `[B, W, d]` after the new entries `kv [B, T, d]` (slot s: the latest position
    p with p % W == s)."""
    w = ring.shape[1]
    last = (start + counts - 1)[:, None]
    newest = last - jnp.mod(last - jnp.arange(w), w)  # [B, W] the latest position of each slot
    fresh = newest >= start[:, None]
    picked = jnp.take_along_axis(kv, jnp.clip(newest - start[:, None], 0, kv.shape[1] - 1)[..., None], axis=1)
    return jnp.where(fresh[..., None], picked, ring).astype(ring.dtype)


def _window_keys(ring: jax.Array, kv: jax.Array, start: jax.Array, counts: jax.Array):
    """The keys a chunk's window reads: the ring's entries then the chunk's, `[B, W + T, d]`, with
    their positions (`-1`: none)."""
    w, t = ring.shape[1], kv.shape[1]
    before = (start - 1)[:, None]
    held = before - jnp.mod(before - jnp.arange(w), w)  # [B, W] the position each slot holds
    new = jnp.where(jnp.arange(t) < counts[:, None], start[:, None] + jnp.arange(t), -1)
    return jnp.concatenate([ring.astype(jnp.float32), kv], axis=1), jnp.concatenate([jnp.maximum(held, -1), new], 1)


def index_scores(p: dict, x: jax.Array, c_q: jax.Array, positions: jax.Array, keys: jax.Array, freqs,
                 cfg: Config) -> jax.Array:
    """The lightning indexer's scores `[B, T, N]` of the queries at `positions [B, T]` for the
    compressed index keys `keys [B, N, index_head_dim]`: `sum_h w_h relu(q_h . k)`, with
    `w = (x W_weights) index_head_dim^-0.5 index_n_heads^-0.5`; -inf where an entry is not visible."""
    q = einsum("btq,qhd->bthd", c_q, p["wq_b"], preferred_element_type=jnp.float32)
    q = _rope(q, positions, freqs, cfg)
    scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    w = jnp.matmul(x.astype(jnp.float32), p["weights_proj"], precision=HIGHEST) * scale
    dots = jnp.einsum("bthd,bnd->bthn", q, keys.astype(jnp.float32), precision=HIGHEST)
    scores = jnp.einsum("bth,bthn->btn", w, jax.nn.relu(dots), precision=HIGHEST)
    visible = jnp.arange(keys.shape[1]) < ((positions + 1) // CSA_RATIO)[..., None]
    return jnp.where(visible, scores, -jnp.inf)


def _compressed_keys(p: dict, x: jax.Array, c_q: jax.Array, positions: jax.Array, cache: LayerCache, kind: str,
                     freqs, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """The compressed entries each query reads, `[B, T, K, d]` or shared `[B, N, d]`, and whether each
    is visible `[B, T, K|N]`: CSA's indexer top-k, or every HCA entry."""
    entries = cache["entries"].astype(jnp.float32)
    if kind == "hca":
        ratio = layer_ratio(cfg, kind)
        return entries, jnp.arange(entries.shape[1]) < ((positions + 1) // ratio)[..., None]
    scores = index_scores(p["indexer"], x, c_q, positions, cache["index_entries"], freqs, cfg)
    best, chosen = jax.lax.top_k(scores, min(cfg.index_topk, entries.shape[1]))
    picked = jax.vmap(lambda e, i: e[i])(entries, chosen)  # [B, T, K, d]
    return picked, best > -jnp.inf


def _attend_keys(q: jax.Array, window: jax.Array, window_ok: jax.Array, compressed, compressed_ok,
                 sinks: jax.Array, cfg: Config) -> jax.Array:
    """Softmax attention of `q [B, T, H, d]` over the window keys `[B, S, d]` (visible `[B, T, S]`) and
    the compressed ones (shared `[B, N, d]` or per query `[B, T, K, d]`), K = V, with the sinks in the
    denominator."""
    scale = cfg.head_dim ** -0.5
    per_query = compressed is not None and compressed.ndim == 4
    parts = [jnp.where(window_ok[:, :, None], jnp.einsum("bthd,bsd->bths", q, window, precision=HIGHEST) * scale,
                       -jnp.inf)]
    if compressed is not None:
        spec = "bthd,btkd->bthk" if per_query else "bthd,bkd->bthk"
        parts.append(jnp.where(compressed_ok[:, :, None], jnp.einsum(spec, q, compressed, precision=HIGHEST) * scale,
                               -jnp.inf))
    logits = jnp.concatenate(parts, axis=-1)
    top = jnp.maximum(jnp.max(logits, axis=-1), sinks)
    e = jnp.exp(logits - top[..., None])
    probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sinks - top)[..., None])
    s = window.shape[1]
    out = jnp.einsum("bths,bsd->bthd", probs[..., :s], window, precision=HIGHEST)
    if compressed is not None:
        spec = "bthk,btkd->bthd" if per_query else "bthk,bkd->bthd"
        out = out + jnp.einsum(spec, probs[..., s:], compressed, precision=HIGHEST)
    return out


def _output(p: dict, o: jax.Array, cfg: Config) -> jax.Array:
    """The grouped output projection of `o [B, T, H, d]`: per group `o_a`, then `o_b` over all groups."""
    b, t = o.shape[:2]
    g = cfg.o_groups
    grouped = o.reshape(b, t, g, cfg.num_attention_heads // g, cfg.head_dim)
    low = einsum("btghd,ghdr->btgr", grouped, p["o_a"], preferred_element_type=jnp.float32)
    return einsum("btgr,grD->btD", low, p["o_b"], preferred_element_type=jnp.float32)


def attend(p: dict, x: jax.Array, start: jax.Array, counts: jax.Array, cache: LayerCache, kind: str,
           cfg: Config) -> tuple[jax.Array, LayerCache]:
    """One V4 attention block on `x [B, T, D]` (the normed sub-block input): T new tokens per row
    after `start [B]` cached positions, of which `counts [B]` are real (the rest padding). Returns
    the output `[B, T, D]` (float32) and the layer's cache holding the new tokens."""
    positions = start[:, None] + jnp.arange(x.shape[1])
    freqs = v4_inverse_frequencies(cfg, kind != "window")
    c_q, q = _queries(p, x, positions, freqs, cfg)
    kv = _rope(rms_norm(matmul(x, p["kv"]), p["kv_norm"], cfg.rms_norm_eps).astype(jnp.float32), positions, freqs, cfg)
    keys, key_positions = _window_keys(cache["window"], kv, start, counts)
    kp, qp = key_positions[:, None, :], positions[..., None]
    window_ok = (kp >= 0) & (kp <= qp) & (kp > qp - cfg.sliding_window)
    cache = {**cache, "window": _ring_update(cache["window"], kv, start, counts)}
    compressed = compressed_ok = None
    if kind != "window":
        ratio = layer_ratio(cfg, kind)
        cache = compress(p["compressor"], x, start, counts, cache, "", ratio, freqs, cfg)
        if kind == "csa":
            cache = compress(p["indexer"]["compressor"], x, start, counts, cache, "index_", ratio, freqs, cfg)
        compressed, compressed_ok = _compressed_keys(p, x, c_q, positions, cache, kind, freqs, cfg)
    o = _attend_keys(q, keys, window_ok, compressed, compressed_ok, p["sinks"].astype(jnp.float32), cfg)
    return _output(p, _rope(o, positions, freqs, cfg, inverse=True), cfg), cache
