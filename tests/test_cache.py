"""The latent caches: a bf16 cache on CPU holds its latents' bits, written and read back exactly; a
decode step over a long cache reads the cached positions a block at a time, whatever room the cache
has, and equals one softmax over them; neither a decode step nor a serving step widens or copies a
whole cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1 import programs
from dsr1.core import attention
from dsr1.core.cache import (
    append_tokens,
    cache_from_prefill,
    empty_paged_cache,
    gather_pages,
    latent_values,
    scatter_pages,
    stores_bits,
    write_tokens,
)

from .harness import TINY

CFG = TINY
L, R, ROPE = CFG.num_hidden_layers, CFG.kv_lora_rank, CFG.qk_rope_head_dim


def _latents(batch: int, t: int, seed: int = 0, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((L, batch, t, R)), dtype),
            jnp.asarray(rng.standard_normal((L, batch, t, ROPE)), dtype))


def test_bf16_latents_are_stored_as_bits_on_cpu():
    assert stores_bits(jnp.bfloat16) and not stores_bits(jnp.float32)
    c_kv, k_pe = _latents(2, 5)
    cache = cache_from_prefill(c_kv, k_pe, jnp.asarray([5, 3]), max_len=8)
    assert cache.c_kv.dtype == cache.k_pe.dtype == jnp.uint16
    np.testing.assert_array_equal(latent_values(cache.c_kv[:, :, :5], jnp.bfloat16), c_kv)
    np.testing.assert_array_equal(latent_values(cache.k_pe[:, :, :5], jnp.float32), k_pe.astype(jnp.float32))
    f32 = cache_from_prefill(*_latents(2, 5, dtype=jnp.float32), jnp.asarray([5, 3]), max_len=8)
    assert f32.c_kv.dtype == jnp.float32


@pytest.mark.slow
def test_appended_bits_land_at_each_rows_length_and_past_the_end_are_dropped():
    cache = cache_from_prefill(*_latents(2, 5), jnp.asarray([5, 3]), max_len=8)
    new_c, new_pe = _latents(2, 4, seed=1)
    grown = append_tokens(cache, new_c, new_pe)
    values = np.asarray(latent_values(grown.c_kv, jnp.float32))
    np.testing.assert_array_equal(values[:, 0, 5:8], np.asarray(new_c[:, 0, :3], np.float32))  # the 4th dropped
    np.testing.assert_array_equal(values[:, 1, 3:7], np.asarray(new_c[:, 1], np.float32))
    np.testing.assert_array_equal(values[:, 1, :3], np.asarray(latent_values(cache.c_kv[:, 1, :3], jnp.float32)))
    assert grown.lengths.tolist() == [9, 7]


@pytest.mark.slow
def test_paged_bits_round_trip_through_pages():
    pool = empty_paged_cache(L, num_pages=6, page_size=4, kv_lora_rank=R, rope_dim=ROPE, dtype=jnp.bfloat16)
    assert pool.c_kv.dtype == jnp.uint16
    new_c, new_pe = _latents(1, 3)
    pool = write_tokens(pool, new_c, new_pe, jnp.asarray([[2, 2, 5]]), jnp.asarray([[0, 3, 1]]))
    np.testing.assert_array_equal(latent_values(pool.c_kv[:, 5, 1], jnp.bfloat16), new_c[:, 0, 2])
    moved = scatter_pages(empty_paged_cache(L, 6, 4, R, ROPE, jnp.bfloat16), jnp.asarray([1, 3]),
                          gather_pages(pool, jnp.asarray([2, 5])))
    np.testing.assert_array_equal(moved.c_kv[:, 1], pool.c_kv[:, 2])
    np.testing.assert_array_equal(moved.k_pe[:, 3], pool.k_pe[:, 5])


@pytest.fixture(scope="module")
def model():
    return dsr1.init_random(CFG, seed=0, dtype="float32")


@pytest.mark.parametrize("max_len", [300, 700])
@pytest.mark.slow
def test_decode_over_blocks_equals_one_softmax(model, max_len, monkeypatch):
    """Rows of 299 and 7 cached positions: two blocks of 256 (with room for 300 the second overlaps
    the first, its earlier positions masked), against one softmax over the cache (a block of 1024)."""
    c_kv, k_pe = _latents(2, 299, dtype=jnp.float32)
    tokens = jnp.asarray([3, 5])

    def logits(block: int) -> np.ndarray:
        monkeypatch.setattr(attention, "CACHE_BLOCK", block)
        jax.clear_caches()  # trace again with this block
        cache = cache_from_prefill(c_kv, k_pe, jnp.asarray([299, 7]), max_len)  # decode consumes it
        return np.asarray(model.decode(cache, tokens)[0])

    blocks, whole = logits(256), logits(1024)
    np.testing.assert_allclose(blocks, whole, rtol=2e-5, atol=2e-5)
    jax.clear_caches()


def _shapes(hlo: str, *shapes: str) -> list[str]:
    return [s for s in shapes if s in hlo]


@pytest.mark.slow
def test_decode_step_neither_widens_nor_copies_the_cache():
    """The compiled bf16 decode step holds no float32 (or bf16) cache and no copy of a layer's cache:
    XLA:CPU computes bf16 slices in float32 and hoisted that widening out of the layer loop."""
    bf16 = dsr1.init_random(CFG, seed=0)
    batch, max_len = 2, 1000
    cache = programs.random_cache(jax.random.key(0), cfg=CFG, mesh=bf16.mesh, batch=batch, context=5,
                                  max_len=max_len, dtype=jnp.bfloat16, kv_cache_dtype=None)
    step = programs.decode.lower(bf16.params, cache, jnp.ones(batch, jnp.int32), **bf16.program_kwargs)
    hlo = step.compile().as_text()
    whole = [f"{t}[{L},{batch},{max_len},{d}]" for t in ("f32", "bf16") for d in (R, ROPE)]
    layer = [f"{t}[{batch},{max_len},{d}]" for t in ("f32", "bf16", "u16") for d in (R, ROPE)]
    assert _shapes(hlo, *whole, *layer) == []


@pytest.mark.slow
def test_serving_step_neither_widens_nor_copies_the_pool():
    bf16 = dsr1.init_random(CFG, seed=0)
    pages, size = 500, 4
    pool = jax.jit(lambda: empty_paged_cache(L, pages, size, R, ROPE, jnp.bfloat16))()
    table = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    args = (bf16.params, pool, jnp.ones((2, 1), jnp.int32), jnp.asarray([5, 2]), jnp.ones(2, jnp.int32), table,
            jnp.zeros((2, 1), jnp.int32))
    hlo = programs.extend.lower(*args, **bf16.program_kwargs).compile().as_text()
    assert _shapes(hlo, *[f"{t}[{L},{pages},{size},{d}]" for t in ("f32", "bf16") for d in (R, ROPE)]) == []
