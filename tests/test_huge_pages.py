"""Weights on CPU in 2 MiB pages (`dsr1.host.huge_pages`)."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.host import huge_pages
from dsr1.host.huge_pages import HUGE_PAGE, on_huge_pages

needs_madvise = pytest.mark.skipif(not huge_pages.supported(), reason="no madvise(MADV_HUGEPAGE) here (not Linux)")


def _huge_page_kib(address: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding `address`, from /proc/self/smaps (None: not there)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


@needs_madvise
def test_large_arrays_move_to_page_aligned_memory_with_the_same_values():
    """Arrays of at least one huge page move, values, dtypes and shapes unchanged; smaller arrays and
    other leaves stay the very same objects; an array appearing twice is moved once."""
    big = jnp.arange(HUGE_PAGE, dtype=jnp.bfloat16).reshape(1024, -1)  # 2 MiB
    ints = jnp.arange(3 * HUGE_PAGE // 2, dtype=jnp.int8)  # 3 MiB
    small = jnp.ones((16, 16), jnp.float32)
    tree = {"big": big, "again": big, "ints": ints, "small": small, "n": 3, "none": None}
    moved = on_huge_pages(tree)
    for name in ("big", "ints"):
        assert moved[name] is not tree[name]
        assert moved[name].unsafe_buffer_pointer() % HUGE_PAGE == 0
        assert moved[name].dtype == tree[name].dtype and moved[name].shape == tree[name].shape
        np.testing.assert_array_equal(np.asarray(moved[name]), np.asarray(tree[name]))
    assert moved["again"] is moved["big"]
    assert moved["small"] is small and moved["n"] == 3 and moved["none"] is None


def test_the_switch_leaves_arrays_where_they_are(monkeypatch):
    monkeypatch.setenv("DSR1_HUGE_PAGES", "0")
    big = jnp.ones((HUGE_PAGE,), jnp.float32)
    assert not huge_pages.supported() and on_huge_pages({"w": big})["w"] is big


@needs_madvise
def test_moved_arrays_outlive_their_host_views_and_compute_like_any_array():
    """The moved array owns its memory (the host view is gone), donated or not."""
    x = on_huge_pages(jnp.arange(HUGE_PAGE // 4, dtype=jnp.float32))
    gc.collect()
    assert float(jnp.sum(x[:1000])) == sum(range(1000))
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    np.testing.assert_array_equal(np.asarray(y[:3]), [1, 2, 3])


@needs_madvise
@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_moved_arrays_are_backed_by_huge_pages():
    """Linux backs the moved memory with 2 MiB pages (what the move is for): at least one of the two
    (compaction may not find a second free one on a busy machine)."""
    x = on_huge_pages(jnp.ones((4 * HUGE_PAGE // 2,), jnp.bfloat16))
    assert _huge_page_kib(x.unsafe_buffer_pointer()) >= HUGE_PAGE // 1024


@needs_madvise
@pytest.mark.slow
def test_a_model_holds_its_large_weights_on_huge_pages_and_computes_the_same():
    """`init_random` moves the large weights; the logits equal those from copies of the same weights
    in XLA's own memory."""
    model = dsr1.init_random(dsr1.Config.preset("tiny"), dtype="float32")
    large = [x for x in jax.tree.leaves(model.params) if x.nbytes >= HUGE_PAGE]
    assert large and all(x.unsafe_buffer_pointer() % HUGE_PAGE == 0 for x in large)
    copied = dataclasses.replace(model, params=jax.tree.map(jnp.copy, model.params))
    tokens = np.array([[3, 5, 7, 9]])
    np.testing.assert_array_equal(np.asarray(model.forward(tokens)), np.asarray(copied.forward(tokens)))


@needs_madvise
def test_arrays_made_in_huge_page_memory_stay_where_they_are():
    """`empty`'s large arrays are page-aligned in memory that asks for huge pages, and a CPU device takes
    them without a copy; `on_huge_pages` then leaves them (the same objects), while it still moves an
    array of the same size that XLA made. Small ones are aligned for XLA in ordinary memory."""
    host = huge_pages.empty((HUGE_PAGE // 2,), np.uint16)
    host[:] = 7
    born = jax.device_put(host, jax.devices("cpu")[0])
    assert born.unsafe_buffer_pointer() == host.ctypes.data and host.ctypes.data % HUGE_PAGE == 0
    made = jnp.full((HUGE_PAGE // 2,), 7, jnp.uint16)
    moved = on_huge_pages({"born": born, "made": made})
    assert moved["born"] is born and moved["made"] is not made
    np.testing.assert_array_equal(np.asarray(moved["made"]), np.asarray(born))
    small = huge_pages.empty((3, 5), np.float32)
    assert small.shape == (3, 5) and small.ctypes.data % huge_pages.ALIGNMENT == 0


def test_empty_without_huge_pages_is_aligned_ordinary_memory(monkeypatch):
    monkeypatch.setenv("DSR1_HUGE_PAGES", "0")
    x = huge_pages.empty((HUGE_PAGE,), np.uint8)
    assert x.shape == (HUGE_PAGE,) and x.ctypes.data % huge_pages.ALIGNMENT == 0


@needs_madvise
def test_a_loaded_model_is_born_on_huge_pages(tmp_path, monkeypatch):
    """`dsr1.load` of a release-layout FP8 checkpoint fills its buffers in huge-page memory and makes the
    transposed copies there: with `on_huge_pages` doing nothing, every large weight is still in memory
    that asks for huge pages, page-aligned."""
    from dsr1.bench.loading import write_fp8_checkpoint

    cfg = dsr1.Config.preset("tiny")
    write_fp8_checkpoint(tmp_path, cfg)
    monkeypatch.setattr(huge_pages, "on_huge_pages", lambda tree: tree)
    model = dsr1.load(tmp_path, progress=False)
    large = [x for x in jax.tree.leaves(model.params) if x.nbytes >= HUGE_PAGE]
    assert large and all(x.unsafe_buffer_pointer() % HUGE_PAGE == 0 for x in large)
    asking = huge_pages._memory_asking_for_huge_pages()
    assert all(huge_pages._in_place(x, asking) for x in large)
