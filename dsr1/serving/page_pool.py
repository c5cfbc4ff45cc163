"""The device page pool and copies of its pages in host memory (the prefix cache's offload).

`PagePool` owns the current `PagedKVCache` (every program that writes it returns a new one, which
replaces it) and is the prefix cache's `PageStore`: `save` dispatches a copy of whole pages (every
layer's `c_kv`, `c_scale`, `k_pe`) and starts its transfer to the host without waiting; `restore`
writes host copies back into fresh pages. Both go through fixed-size programs (`COPY_BATCH`
pages per call, padded with the scratch page) so they never compile after warm-up.

Ordering needs no locks: every program that touches the pool takes the previous pool as input,
so the device runs them in dispatch order. A page saved and then handed to another request is
copied before the new owner's tokens are written; a page restored is written before any step
that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from .. import programs
from ..core.cache import SCRATCH_PAGE, PagedKVCache
from ..core.sharding import put_replicated, to_host

__all__ = ["COPY_BATCH", "HostPage", "PagePool"]

COPY_BATCH = 8  # pages per copy program: one shape, few calls per eviction


class _Copied:
    """One `copy_pages` result (`COPY_BATCH` pages on device, on their way to the host), turned
    into numpy once, when the first of its pages is needed."""

    def __init__(self, contents: PagedKVCache):
        for leaf in jax.tree.leaves(contents):
            leaf.copy_to_host_async()
        self._device: PagedKVCache | None = contents
        self._host: tuple[np.ndarray | None, ...] | None = None

    def host(self) -> tuple[np.ndarray | None, ...]:
        if self._host is None:
            c = self._device
            self._host = tuple(None if a is None else to_host(a) for a in (c.c_kv, c.k_pe, c.c_scale))
            self._device = None
        return self._host


class HostPage:
    """One page's latents for every layer in host memory: `c_kv [L, page_size, r]`, `k_pe [L, page_size,
    rope]`, `c_scale [L, page_size]` or None (still in flight until `settle`)."""

    def __init__(self, copied: _Copied, index: int):
        self._copied: _Copied | None = copied
        self._index = index
        self._arrays: tuple[np.ndarray | None, ...] | None = None

    def arrays(self) -> tuple[np.ndarray | None, ...]:
        """`(c_kv, k_pe, c_scale)`; waits for the copy if it is still in flight."""
        self.settle()
        return self._arrays

    def settle(self) -> None:
        """Take this page's own copy out of its batch (so the batch can be freed)."""
        if self._arrays is None:
            batch = self._copied.host()
            self._arrays = tuple(None if a is None else np.array(a[:, self._index]) for a in batch)
            self._copied = None


class PagePool:
    """The device page pool (`cache`) and page copies to and from host memory (a `PageStore`)."""

    def __init__(self, cache: PagedKVCache, mesh: Mesh):
        self.cache = cache
        self.mesh = mesh
        self.page_bytes = cache.nbytes() // cache.c_kv.shape[1]
        self._this_step: list[HostPage] = []  # copies dispatched while planning the current step
        self._earlier: list[HostPage] = []  # copies dispatched before it: done once its previous step is read

    def save(self, pages: Sequence[int]) -> list[HostPage]:
        """Dispatch copies of `pages` to host memory; returns one `HostPage` per page, at once."""
        saved = []
        for batch in _batches(pages):
            contents = programs.copy_pages(self.cache, put_replicated(_padded(batch), self.mesh), mesh=self.mesh)
            copied = _Copied(contents)
            saved += [HostPage(copied, i) for i in range(len(batch))]
        self._this_step += saved
        return saved

    def restore(self, pages: Sequence[int], copies: Sequence[HostPage]) -> None:
        """Dispatch writes of host copies into `pages` (the pool is replaced)."""
        for batch, batch_copies in zip(_batches(pages), _batches(copies)):
            contents = _stacked([c.arrays() for c in batch_copies])
            self.cache = programs.restore_pages(self.cache, put_replicated(_padded(batch), self.mesh),
                                                put_replicated(contents, self.mesh), mesh=self.mesh)

    def begin_step(self) -> None:
        """A new step is being planned: copies dispatched so far precede the previous step's programs."""
        self._earlier += self._this_step
        self._this_step = []

    def settle(self, everything: bool = False) -> None:
        """Move finished copies into their pages' own host arrays, freeing their device buffers: those
        dispatched before the current step's plan (done, once the previous step's tokens were read),
        or all of them (`everything`, when nothing runs on the device any more)."""
        pages = self._earlier + (self._this_step if everything else [])
        for page in pages:
            page.settle()
        self._earlier = []
        if everything:
            self._this_step = []

    def warm_up(self) -> None:
        """Compile the copy programs (on the scratch page: nothing changes)."""
        self.restore([SCRATCH_PAGE], self.save([SCRATCH_PAGE]))
        self.settle(everything=True)


def _batches(items: Sequence) -> list[list]:
    return [list(items[i:i + COPY_BATCH]) for i in range(0, len(items), COPY_BATCH)]


def _padded(batch: Sequence[int]) -> np.ndarray:
    """Page ids padded to `COPY_BATCH` with the scratch page (padding copies are never used)."""
    out = np.full(COPY_BATCH, SCRATCH_PAGE, np.int32)
    out[:len(batch)] = batch
    return out


def _stacked(arrays: Sequence[tuple[np.ndarray | None, ...]]) -> PagedKVCache:
    """Host pages `(c_kv, k_pe, c_scale)` as one `COPY_BATCH`-page pool (zero padding)."""
    def stack(parts: list[np.ndarray | None]) -> np.ndarray | None:
        if parts[0] is None:
            return None
        out = np.zeros((parts[0].shape[0], COPY_BATCH, *parts[0].shape[1:]), parts[0].dtype)
        out[:, :len(parts)] = np.stack(parts, axis=1)
        return out

    return PagedKVCache(*(stack([a[i] for a in arrays]) for i in range(3)))
