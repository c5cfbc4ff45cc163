"""V3.2's sparse attention over the serving engine's page pool (`cache.PagedRows`,
`sparse_attention.attend_extend`): a pool read through shuffled page tables gives what the contiguous
cache of the same positions gives; the paged `extend` in chunks and one-token steps gives `forward`'s
logits at every position (float32), with XLA's gather and with the TPU kernel (interpreted); a pool
split over each row's positions is refused."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.core import paged_gather
from dsr1.core.cache import KVCache, PagedKVCache, PagedRows, empty_paged_cache

from .harness import relative_error

CONFIG = dataclasses.replace(dsr1.Config.preset("tiny-v3.2"), vocab_size=256)


def _pool_and_cache(rng, page_size: int, int8: bool):
    """The same random positions of 2 rows (lengths 13 and 6) as a contiguous 2-layer `KVCache` and as a
    pool whose pages are shuffled (page tables 4 wide, unused entries on the scratch page)."""
    layers, b, width, r, rope, d = 2, 2, 4, 8, 4, 6
    n = width * page_size
    c = rng.standard_normal((layers, b, n, r)).astype(np.float32)
    c_kv, scale = ((rng.integers(-127, 128, c.shape).astype(np.int8), rng.uniform(0.01, 0.1, c.shape[:3]))
                   if int8 else (c, None))
    pe, keys = rng.standard_normal((layers, b, n, rope)), rng.standard_normal((layers, b, n, d))
    order = rng.permutation(b * width) + 1
    table = order.reshape(b, width)

    def paged(a):  # [L, B, n, ...] -> [L, 1 + B * width, page_size, ...] at the table's pages
        pool = np.zeros((layers, 1 + b * width, page_size, *a.shape[3:]), a.dtype)
        pool[:, table.reshape(-1)] = a.reshape(layers, b * width, page_size, *a.shape[3:])
        return jnp.asarray(pool)

    lengths = jnp.asarray([13, 6], jnp.int32)
    cache = KVCache(jnp.asarray(c_kv), jnp.asarray(pe), None if scale is None else jnp.asarray(scale, jnp.float32),
                    lengths, jnp.asarray(keys))
    pool = PagedKVCache(paged(c_kv), paged(pe), None if scale is None else paged(scale.astype(np.float32)),
                        paged(keys))
    return cache, PagedRows(pool, jnp.asarray(table, jnp.int32), lengths)


@pytest.mark.parametrize("int8", [False, True])
def test_paged_rows_read_as_the_contiguous_cache(int8):
    """Every indexer key of each row's pages, and the latents (int8: with their scales) at selected
    positions, equal the contiguous cache's."""
    cache, rows = _pool_and_cache(np.random.default_rng(1), page_size=4, int8=int8)
    layer = jnp.int32(1)
    assert rows.max_len == cache.max_len and rows.batch_size == cache.batch_size
    np.testing.assert_array_equal(np.asarray(rows.read_index_keys(layer)), np.asarray(cache.read_index_keys(layer)))
    picked = jnp.asarray(np.random.default_rng(2).integers(0, cache.max_len, (2, 3, 5)), jnp.int32)
    for got, want in zip(rows.gather_positions(layer, picked), cache.gather_positions(layer, picked)):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_paged_rows_need_the_indexer_keys_and_one_device_per_row():
    """A dense pool (no indexer keys) and a pool split over each row's positions are refused, naming why."""
    from dsr1.core.model import extend
    from dsr1.core.sharding import layout_rules

    dense = empty_paged_cache(1, 3, 4, 8, 4, jnp.float32)
    with pytest.raises(ValueError, match="holds no indexer keys"):
        PagedRows(dense, jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32))
    split = types.SimpleNamespace(shape={"expert": 2, "tensor": 2})  # layout dp's rows and positions
    with pytest.raises(ValueError, match=r"split over each row's positions \(rules.positions='tensor'\)"):
        extend({}, None, np.zeros((1, 1), np.int32), np.zeros(1, np.int32), np.ones(1, np.int32),
               np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), cfg=CONFIG, mesh=split,
               rules=layout_rules("dp"))


def _extend_logits(model: dsr1.Model, tokens: np.ndarray, chunks: tuple[int, ...]) -> np.ndarray:
    """Both rows' tokens through the paged `extend` in `chunks` (prefill chunks, then one-token steps)
    on shuffled pages of 4: the logits at every position `[B, T, V]`."""
    from dsr1.core.model import extend

    cfg, (b, n) = model.cfg, tokens.shape
    width = -(-n // 4)
    table = jnp.asarray(np.random.default_rng(3).permutation(b * width).reshape(b, width) + 1, jnp.int32)
    cache = empty_paged_cache(cfg.num_hidden_layers, 1 + b * width, 4, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                              jnp.float32, index_head_dim=cfg.index_head_dim)
    step = jax.jit(lambda *a: extend(*a, **model.program_kwargs))
    out, start = [], 0
    for chunk in chunks:
        at = jnp.broadcast_to(jnp.arange(chunk), (b, chunk))
        logits, _, cache = step(model.params, cache, jnp.asarray(tokens[:, start:start + chunk]),
                                jnp.full((b,), start, jnp.int32), jnp.full((b,), chunk, jnp.int32), table, at)
        out.append(np.asarray(logits))
        start += chunk
    return np.concatenate(out, axis=1)


@pytest.mark.extended
@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_paged_extend_equals_forward_at_every_position(monkeypatch, kernel):
    """28 positions (3.5x index_topk) in chunks of 8, 8 and 4 then 8 one-token steps: `forward`'s logits
    within 1e-5 at each; with the TPU gather kernel forced on (interpreted), the same."""
    from dsr1.core.model import forward

    model = dsr1.init_random(CONFIG, seed=0, dtype="float32")
    tokens = np.random.default_rng(0).integers(2, CONFIG.vocab_size, (2, 28)).astype(np.int32)
    want = np.asarray(jax.jit(lambda p, t, m: forward(p, t, m, **model.program_kwargs))(
        model.params, tokens, jnp.full((2,), 28, jnp.int32)))
    if kernel:
        real = paged_gather.gather
        monkeypatch.setattr(paged_gather, "applies", lambda platform=None: True)
        monkeypatch.setattr(paged_gather, "gather", lambda *a, **k: real(*a, **{**k, "interpret": True}))
    got = _extend_logits(model, tokens, (8, 8, 4) + (1,) * 8)
    assert max(relative_error(got[r, t], want[r, t]) for r in range(2) for t in range(28)) < 1e-5


@pytest.mark.extended
def test_paged_decode_step_reads_only_the_selected_latents():
    """The compiled one-token `extend` of rows of 1,000 positions (250 pages of 4) holds no layer's
    latents of a row's every position, nor a page loop's block of them: it scans the row's indexer
    keys, then gathers the 8 selected positions' latents."""
    from dsr1.programs import model as programs

    cfg = dataclasses.replace(CONFIG, index_head_dim=24)  # shapes apart from the latents'
    model = dsr1.init_random(cfg, seed=0, dtype="float32")
    b, width = 2, 250
    pool = programs.paged_cache(cfg=cfg, mesh=model.mesh, num_pages=1 + b * width, page_size=4, dtype=jnp.float32,
                                kv_cache_dtype=None)
    table = jnp.arange(1, 1 + b * width, dtype=jnp.int32).reshape(b, width)
    one = jnp.ones((b, 1), jnp.int32)
    hlo = programs.extend.lower(model.params, pool, one, jnp.full((b,), 900, jnp.int32), one[:, 0], table,
                                one - 1, **model.program_kwargs).compile().as_text()
    r, rope, n = cfg.kv_lora_rank, cfg.qk_rope_head_dim, width * 4
    assert f"f32[{b},{n},{cfg.index_head_dim}]" in hlo  # the keys are scanned
    # A row's every position, or a page loop's block of 512 positions (128 pages), flat or as pages.
    whole = [f"f32[{b},{m},{d}]" for d in (r, rope) for m in (n, 512)] + [f"f32[{b},{m},4,{d}]" for d in (r, rope)
                                                                          for m in (width, 128)]
    assert [s for s in whole if s in hlo] == []
    assert f"f32[{b},1,8,{r}]" in hlo  # the selected latents
