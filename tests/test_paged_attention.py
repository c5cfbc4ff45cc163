"""The ragged paged MLA kernel (`dsr1.core.paged_attention`): in Pallas' TPU interpreter on CPU against
XLA's page loop (`attention._fold_pages`), inside the model's `extend` against the XLA path, and
compiled for a v5e chip by libtpu's deviceless compile."""

from __future__ import annotations

import importlib.util
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.core import attention, paged_attention
from dsr1.core.cache import PagedKVCache, empty_paged_cache, to_stored

from .harness import TINY

LENGTHS = [1, 1100, 0, 37, 600, 16, 17, 1024]  # ragged: one position, none, exactly a page, a page and one
HEADS, TOKENS, RANK, ROPE, SCALE = 4, 2, 32, 16, 0.3

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'dsr1[tpu-plan]')")


def _pool(rng, page_size: int, dtype, int8: bool):
    """A 2-layer pool whose rows hold `LENGTHS` positions on shuffled pages, the page table with every
    entry past a row's pages naming a page no row holds, and that page set: every page no row holds
    is poisoned (NaN latents, or NaN scales for int8), so reading one would show in the output."""
    held = [-(-n // page_size) for n in LENGTHS]
    num_pages = sum(held) + 3
    order = rng.permutation(num_pages - 1)[: sum(held)] + 1
    width = max(held) + 2
    table = np.full((len(LENGTHS), width), num_pages - 1, np.int32)
    start = 0
    for row, n in enumerate(held):
        table[row, :n] = order[start:start + n]
        start += n
    unheld = np.setdiff1d(np.arange(num_pages), order)
    shape = (2, num_pages, page_size)
    pe = rng.standard_normal((*shape, ROPE)).astype(np.float32)
    if int8:
        c = rng.integers(-128, 128, (*shape, RANK)).astype(np.int8)
        scale = rng.uniform(0.002, 0.02, shape).astype(np.float32)
    else:
        c, scale = rng.standard_normal((*shape, RANK)).astype(np.float32), None
    clean = PagedKVCache(jnp.asarray(c if int8 else c.astype(dtype)), jnp.asarray(pe, dtype),
                         None if scale is None else jnp.asarray(scale))
    if int8:
        scale = scale.copy()
        scale[:, unheld] = np.nan
    else:
        c = c.copy()
        c[:, unheld] = np.nan
    pe = pe.copy()
    pe[:, unheld] = np.nan
    poisoned = PagedKVCache(jnp.asarray(c if int8 else c.astype(dtype)), jnp.asarray(pe, dtype),
                            None if scale is None else jnp.asarray(scale))
    return clean, poisoned, jnp.asarray(table)


@pytest.mark.slow
@pytest.mark.parametrize("page_size,dtype,int8,tolerance",
                         [(16, jnp.float32, False, 1e-5), (64, jnp.bfloat16, False, 2**-8),
                          (16, jnp.bfloat16, True, 2**-8), (64, jnp.float32, True, 1e-5)],
                         ids=["16-f32", "64-bf16", "16-bf16-int8", "64-f32-int8"])
def test_kernel_equals_the_xla_page_loop_and_reads_only_held_pages(page_size, dtype, int8, tolerance):
    """Rows of 0 to 1,100 positions, ragged, two new tokens of four heads each: the kernel's partial
    softmax merged with the new tokens' own keys gives XLA's context (1e-5 of max|context| in float32,
    2^-8 in bf16); every page no row holds is NaN for the kernel and its output stays finite. bf16
    latents and rope keys reach it as their bits, as a CPU pool keeps them."""
    rng = np.random.default_rng(page_size + int8)
    clean, poisoned, table = _pool(rng, page_size, dtype, int8)
    b = len(LENGTHS)
    q = attention.Query(jnp.asarray(rng.standard_normal((b, TOKENS, HEADS, RANK)) * 0.2, dtype),
                        jnp.asarray(rng.standard_normal((b, TOKENS, HEADS, ROPE)) * 0.2, dtype), absorbed=True)
    own = attention.Keys(*(jnp.asarray(rng.standard_normal((b, TOKENS, w)), dtype) for w in (RANK, RANK, ROPE)), None)
    cfg = types.SimpleNamespace(softmax_scale=SCALE)  # the scores' only use of the config
    layer, cached = jnp.int32(1), jnp.asarray(LENGTHS, jnp.int32)
    start = attention.fold_keys(None, q, own, attention.causal_mask(TOKENS), cfg)
    want = attention._fold_pages(start, {}, q, attention.PagedContext(clean, table, cached, 4), layer, dtype, cfg)
    stored = [to_stored(a, "cpu") for a in (poisoned.c_kv, poisoned.k_pe)]  # bf16 as its bits, as on CPU
    acc, run_max, total = paged_attention.paged_context(
        q.main.reshape(b, TOKENS * HEADS, RANK), q.pe.reshape(b, TOKENS * HEADS, ROPE), *stored, poisoned.c_scale,
        layer, table, cached, SCALE, interpret=True)
    assert np.isfinite(np.asarray(acc)).all()
    by_head = lambda a: a.reshape(b, TOKENS, HEADS, *a.shape[2:]).swapaxes(1, 2)  # noqa: E731
    got = start.merge(attention.PartialSoftmax(by_head(run_max), by_head(total), by_head(acc))).result()
    want = np.asarray(want.result())
    err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    print(f"\n[{page_size} {jnp.dtype(dtype).name} int8={int8}] kernel vs XLA: {err:.2e} of max|context|; "
          f"pages read {int(paged_attention.pages_read(cached, page_size))} of {table.size}")
    assert err < tolerance  # the poisoned pool's context is the clean one's: no page outside a row is read


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("page_size,int8", [(16, False), (64, True)])
def test_a_ragged_batch_copies_the_bytes_its_rows_hold(page_size, int8):
    """The serving target's ragged batch (one row of 32,768 positions beside 63 of 1,024), compiled
    for a v5e chip (`bench paged`): the kernel moves at most 1.5x the bytes the rows hold (its queries
    and outputs on top of their pages); XLA's page loop, walked with its trip count, over 20x."""
    from dsr1.bench.paged import measure, parse_lengths

    row = measure(parse_lengths("32768,1024x63"), page_size, heads=16, int8=int8)
    print(f"\n{row}")
    assert row["kernel_x"] <= 1.5
    assert row["xla_x"] > 20


def test_applies_on_tpu_only():
    assert paged_attention.applies("tpu")
    assert not any(paged_attention.applies(p) for p in ("cpu", "gpu"))
    assert not paged_attention.applies()  # this machine: CPU


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_extend_with_the_kernel_equals_the_xla_path(monkeypatch, kv_cache_dtype):
    """The model's paged `extend` (a prompt's chunks, then a verification-shaped step of two tokens)
    with the kernel forced on (interpreted) gives the XLA path's logits and latents (float32)."""
    from dsr1.core import model as model_module

    model = dsr1.init_random(TINY, seed=4, dtype="float32")
    cfg = model.cfg
    rng = np.random.default_rng(4)
    b, page_size, width = 3, 16, 6
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 40)), jnp.int32)
    table = jnp.asarray(np.arange(1, 1 + b * width).reshape(b, width), jnp.int32)

    def run():
        cache = empty_paged_cache(cfg.num_hidden_layers, 1 + b * width, page_size, cfg.kv_lora_rank,
                                               cfg.qk_rope_head_dim, jnp.float32, kv_cache_dtype)
        # A new function per run: traced again, with or without the kernel.
        extend = jax.jit(lambda *args: model_module.extend(*args, cfg=cfg, mesh=model.mesh, rules=model.rules,
                                                           absorbed=True))
        outs = []
        for start, chunk in ((0, 8), (8, 30), (38, 2)):  # 30 tokens: still absorbed (tiny's crossover is higher)
            counts = jnp.asarray([chunk, chunk - 3, 0], jnp.int32)
            starts = jnp.asarray([start, max(start - 3, 0), 0], jnp.int32)
            logits, _, cache = extend(model.params, cache, tokens[:, start:start + chunk], starts, counts, table,
                                      jnp.zeros((b, 1), jnp.int32) + counts[:, None] - 1)
            outs.append(np.asarray(logits))
        return outs, cache

    want, want_cache = run()
    real = paged_attention.paged_context
    monkeypatch.setattr(paged_attention, "applies", lambda platform=None: True)
    monkeypatch.setattr(paged_attention, "paged_context", lambda *a, **k: real(*a, **{**k, "interpret": True}))
    got, got_cache = run()
    # An int8 cache: a latent a hair apart in the two programs may round to the next int8 step (below),
    # which moves the logits, and the later layers' keys and scales, by about 1e-4 of their largest.
    tol = 1e-3 if kv_cache_dtype else 2e-5
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())
    for w, g in zip(jax.tree.leaves(want_cache), jax.tree.leaves(got_cache)):
        int8, w, g = w.dtype == jnp.int8, np.asarray(w, np.float32), np.asarray(g, np.float32)
        if int8:  # a latent a hair apart may round to the next int8 step
            assert np.abs(g - w).max() <= 1
        else:
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.slow
@needs_libtpu
def test_compiles_for_a_v5e_chip():
    """Mosaic's real lowering and XLA:TPU's compile, without a TPU: R1's widths (16 heads of a
    tensor-parallel 8, latent 512, rope 64), bf16 and int8 caches, pages of 16 and 64."""
    from .harness import v5e_chip

    on_chip = jax.sharding.SingleDeviceSharding(v5e_chip())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)

    layers, pages, rows, heads, rank, rope = 4, 257, 8, 16, 512, 64
    for page_size in (16, 64):
        for int8 in (False, True):
            shape = (layers, pages, page_size)
            args = (spec((rows, heads, rank), jnp.bfloat16), spec((rows, heads, rope), jnp.bfloat16),
                    spec((*shape, rank), jnp.int8 if int8 else jnp.bfloat16), spec((*shape, rope), jnp.bfloat16),
                    spec(shape, jnp.float32) if int8 else None, spec((), jnp.int32),
                    spec((rows, 2048 // page_size), jnp.int32), spec((rows,), jnp.int32))
            compiled = jax.jit(lambda *a: paged_attention.paged_context(*a, scale=0.1)).lower(*args).compile()
            assert "mla_paged_attention" in compiled.as_text()
