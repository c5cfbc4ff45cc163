"""The TPU kernel gathering selected positions out of a page pool (`dsr1.core.paged_gather`, V3.2's
sparse attention in the serving engine): in Pallas' TPU interpreter on CPU against XLA's gather, in
every stored dtype, and compiled for a v5e chip by libtpu's deviceless compile."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsr1.core import paged_gather

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'dsr1[tpu-plan]')")


# The interpreter runs each DMA on the host: bf16 in the quick tier, int8 slow, the rest extended.
@pytest.mark.parametrize("page_size,dtype", [
    (64, jnp.bfloat16), pytest.param(4, jnp.float32, marks=pytest.mark.extended),
    pytest.param(64, jnp.int8, marks=pytest.mark.slow), pytest.param(16, jnp.uint16, marks=pytest.mark.extended)],
    ids=["64-bf16", "4-f32", "64-int8", "16-bf16-bits"])
def test_interpreted_kernel_equals_xla_gather(page_size, dtype):
    """Positions of a 2-layer pool named by (page, slot), `[rows, queries, K]` with K not a multiple of
    a tile (its padding dropped), layer 1: the kernel's rows are XLA's, bit for bit."""
    rng = np.random.default_rng(page_size)
    pool = jnp.asarray(rng.standard_normal((2, 7, page_size, 24)) * 40).astype(dtype)
    pages = jnp.asarray(rng.integers(0, 7, (2, 2, 11)), jnp.int32)
    slots = jnp.asarray(rng.integers(0, page_size, (2, 2, 11)), jnp.int32)
    got = paged_gather.gather(pool, jnp.int32(1), pages, slots, interpret=True)
    assert got.dtype == pool.dtype and got.shape == (2, 2, 11, 24)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pool[1, pages, slots]))


def test_applies_on_tpu_only_and_counts_a_tile_per_position():
    assert paged_gather.applies("tpu") and not any(paged_gather.applies(p) for p in ("cpu", "gpu"))
    assert not paged_gather.applies()  # this machine: CPU
    # R1's latents, bf16, pages of 64: 2,048 selected positions move a 16-row tile each, a quarter page.
    assert paged_gather.bytes_moved(2048, 512, jnp.bfloat16, 64) == 2048 * 16 * 512 * 2
    assert paged_gather.tile_rows(jnp.int8, 16) == 16 and paged_gather.tile_rows(jnp.float32, 64) == 8


@pytest.mark.slow
@needs_libtpu
def test_compiles_for_a_v5e_chip():
    """Mosaic's real lowering and XLA:TPU's compile, without a TPU: R1's latent (512) and rope (64)
    widths, bf16 and int8 pools of 64-token pages, 8 queries of 2,048 selected positions."""
    from .harness import v5e_chip

    on_chip = jax.sharding.SingleDeviceSharding(v5e_chip())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)

    for width, dtype in ((512, jnp.bfloat16), (512, jnp.int8), (64, jnp.bfloat16)):
        args = (spec((4, 257, 64, width), dtype), spec((), jnp.int32), spec((8, 2048), jnp.int32),
                spec((8, 2048), jnp.int32))
        hlo = jax.jit(paged_gather.gather).lower(*args).compile().as_text()
        assert paged_gather.NAME in hlo
