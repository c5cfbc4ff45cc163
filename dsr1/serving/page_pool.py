"""The device page pool and copies of its pages in host memory (the prefix cache's offload).

Two halves, so that every JAX process can run the copies process 0's prefix cache decides:

- `PageLog` is the prefix cache's `PageStore` on process 0: `save`, `restore` and `release` only
  *record* `PageOp`s (host copies are named by integer ids it hands out) and return at once. The
  engine takes the recorded ops into the step's `StepWork`, which every process runs in order.
- `PagePool` owns the current `PagedKVCache` (every program that writes it returns a new one,
  which replaces it) and, with MTP drafts, the MTP module's one-layer pool under the same page ids
  (`mtp_cache`), and *runs* the ops: a save dispatches a copy of whole pages (every layer's
  `c_kv`, `c_scale`, `k_pe`, and V3.2's indexer keys `index_k`, in both pools) and starts its
  transfer to host memory without waiting; a restore writes host copies back into fresh pages; a
  release drops host copies. Copies go through fixed-size programs (`COPY_BATCH` pages per call,
  padded with the scratch page) so they never compile after warm-up.

Across processes each process keeps its own host copies, under the ids process 0 gave them: a copy
program returns its pages whole on every device (under attention data parallelism, where each rank
holds its share of the pool, the rank holding a page sends it to the others: `copy_pages`), so each
process copies them from its own devices to its own host memory and writes them back to its own
devices' shares.

Ordering needs no locks: every program that touches the pool takes the previous pool as input,
so the device runs them in dispatch order. A page saved and then handed to another request is
copied before the new owner's tokens are written; a page restored is written before any step
that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.cache import SCRATCH_PAGE, PagedKVCache
from ..core.sharding import DEFAULT_RULES, ShardingRules, put_replicated, to_host
from ..programs.step import copy_pages, restore_pages

__all__ = ["COPY_BATCH", "PAGE_OP_KINDS", "HostPage", "PageLog", "PageOp", "PagePool", "page_batches", "warm_up_ops"]

COPY_BATCH = 8  # pages per copy program: one shape, few calls per eviction
PAGE_OP_KINDS = ("save", "restore", "release")


@dataclasses.dataclass(frozen=True)
class PageOp:
    """One recorded page operation: `save` copies `pages` to host copies `ids`; `restore` writes
    copies `ids` into `pages`; `release` drops copies `ids` (`pages` empty). Save and restore carry
    at most `COPY_BATCH` pages."""

    kind: str
    pages: np.ndarray  # int32
    ids: np.ndarray  # int32, one per page (release: the copies to drop)


class PageLog:
    """The prefix cache's `PageStore` on the deciding process: records page operations for the
    step being planned (see the module docstring); host copies are integer ids."""

    def __init__(self, page_bytes: int):
        self.page_bytes = page_bytes
        self._ops: list[PageOp] = []
        self._next_id = 0

    def save(self, pages: Sequence[int]) -> list[int]:
        ids = list(range(self._next_id, self._next_id + len(pages)))
        self._next_id += len(pages)
        self._ops += [PageOp("save", _int32(p), _int32(i)) for p, i in zip(page_batches(pages), page_batches(ids))]
        return ids

    def restore(self, pages: Sequence[int], copies: Sequence[int]) -> None:
        self._ops += [PageOp("restore", _int32(p), _int32(c))
                      for p, c in zip(page_batches(pages), page_batches(copies))]

    def release(self, copies: Sequence[int]) -> None:
        if not copies:
            return
        if self._ops and self._ops[-1].kind == "release":  # one op for a run of releases
            copies = [*self._ops.pop().ids.tolist(), *copies]
        self._ops.append(PageOp("release", _int32([]), _int32(copies)))

    def take(self) -> tuple[PageOp, ...]:
        """The operations recorded since the last call, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops


Latents = tuple[np.ndarray | None, ...]  # (c_kv, k_pe, c_scale, index_k) of one pool, in host memory


def _arrays(pool: PagedKVCache) -> tuple:
    """A pool's arrays in `Latents` order (None where it holds none)."""
    return pool.c_kv, pool.k_pe, pool.c_scale, pool.index_k


class _Copied:
    """The `copy_pages` results of one batch (`COPY_BATCH` pages on device, one result per pool, on
    their way to the host), turned into numpy once, when the first of its pages is needed."""

    def __init__(self, contents: tuple[PagedKVCache, ...]):
        for leaf in jax.tree.leaves(contents):
            leaf.copy_to_host_async()
        self._device: tuple[PagedKVCache, ...] | None = contents
        self._host: tuple[Latents, ...] | None = None

    def host(self) -> tuple[Latents, ...]:
        if self._host is None:
            self._host = tuple(tuple(None if a is None else to_host(a) for a in _arrays(c))
                               for c in self._device)
            self._device = None
        return self._host


class HostPage:
    """One page's latents for every layer in host memory, per pool (the model's, then the MTP module's if
    any): `c_kv [L, page_size, r]`, `k_pe [L, page_size, rope]`, `c_scale [L, page_size]` or None,
    `index_k [L, page_size, index_head_dim]` or None (still in flight until `settle`)."""

    def __init__(self, copied: _Copied, index: int):
        self._copied: _Copied | None = copied
        self._index = index
        self._arrays: tuple[Latents, ...] | None = None

    def arrays(self) -> tuple[Latents, ...]:
        """`(c_kv, k_pe, c_scale, index_k)` of each pool; waits for the copy if it is still in flight."""
        self.settle()
        return self._arrays

    def settle(self) -> None:
        """Take this page's own copy out of its batch (so the batch can be freed)."""
        if self._arrays is None:
            self._arrays = tuple(tuple(None if a is None else np.array(a[:, self._index]) for a in pool)
                                 for pool in self._copied.host())
            self._copied = None


class PagePool:
    """The device page pool (`cache`; with MTP drafts also `mtp_cache`, the same pages of the MTP module)
    and this process's host copies of its pages, by id; runs `PageOp`s (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, mesh: Mesh, mtp_cache: PagedKVCache | None = None,
                 rules: ShardingRules = DEFAULT_RULES):
        self.cache = cache
        self.mtp_cache = mtp_cache
        self.mesh = mesh
        self.rules = rules  # how both pools' pages are split (`dsr1.core.cache.pool_axes`)
        self.page_bytes = sum(pool.nbytes() // pool.c_kv.shape[1] for pool in self.pools)
        self.copies: dict[int, HostPage] = {}
        self._this_step: list[HostPage] = []  # copies dispatched for the current step
        self._earlier: list[HostPage] = []  # copies dispatched before it: done once its previous step is read

    def apply(self, op: PageOp) -> None:
        """Run one page operation: dispatch a copy or a write (returns at once), or drop copies."""
        with jax.named_scope(f"page_{op.kind}"):
            if op.kind == "save":
                self._save(op.pages, op.ids)
            elif op.kind == "restore":
                self._restore(op.pages, [self.copies[i] for i in op.ids.tolist()])
            elif op.kind == "release":
                for i in op.ids.tolist():
                    del self.copies[i]
            else:
                raise ValueError(f"unknown page operation {op.kind!r}; expected one of {PAGE_OP_KINDS}")

    @property
    def pools(self) -> tuple[PagedKVCache, ...]:
        """The model's pool, then the MTP module's if any."""
        return (self.cache,) if self.mtp_cache is None else (self.cache, self.mtp_cache)

    def _save(self, pages: np.ndarray, ids: np.ndarray) -> None:
        copied = _Copied(self.take(pages))
        for index, copy_id in enumerate(ids.tolist()):
            self.copies[copy_id] = HostPage(copied, index)
            self._this_step.append(self.copies[copy_id])

    def _restore(self, pages: np.ndarray, copies: Sequence[HostPage]) -> None:
        self.put(pages, tuple(put_replicated(_stacked([c.arrays()[i] for c in copies]), self.mesh)
                              for i in range(len(self.pools))))

    def take(self, pages: np.ndarray) -> tuple[PagedKVCache, ...]:
        """The contents of up to `COPY_BATCH` `pages`, per pool, as `COPY_BATCH`-page pools on this
        pool's devices (dispatched, not waited for): to host memory, or to another pool's devices."""
        placed = put_replicated(_padded(pages), self.mesh)
        return tuple(copy_pages(pool, placed, mesh=self.mesh, rules=self.rules) for pool in self.pools)

    def put(self, pages: np.ndarray, contents: tuple[PagedKVCache, ...]) -> None:
        """Write `contents` (`take`'s form, on this pool's devices) into the same `pages`."""
        placed = put_replicated(_padded(pages), self.mesh)
        pools = [restore_pages(pool, placed, part, mesh=self.mesh, rules=self.rules)
                 for pool, part in zip(self.pools, contents)]
        self.cache = pools[0]
        if self.mtp_cache is not None:
            self.mtp_cache = pools[1]

    def begin_step(self) -> None:
        """A new step is being dispatched: copies dispatched so far precede the previous step's programs."""
        self._earlier += self._this_step
        self._this_step = []

    def settle(self, everything: bool = False) -> None:
        """Move finished copies into their pages' own host arrays, freeing their device buffers: those
        dispatched before the current step (done, once the previous step's tokens were read), or
        all of them (`everything`, when nothing runs on the device any more)."""
        pages = self._earlier + (self._this_step if everything else [])
        for page in pages:
            page.settle()
        self._earlier = []
        if everything:
            self._this_step = []


def warm_up_ops(log: PageLog) -> None:
    """Record the copy programs' warm-up into `log`: the scratch page out and back in, then drop
    the copy (nothing changes)."""
    copies = log.save([SCRATCH_PAGE])
    log.restore([SCRATCH_PAGE], copies)
    log.release(copies)


def page_batches(items: Sequence) -> list[list]:
    """`items` in runs of at most `COPY_BATCH` (one copy program each)."""
    return [list(items[i:i + COPY_BATCH]) for i in range(0, len(items), COPY_BATCH)]


def _int32(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, np.int32).reshape(-1)


def _padded(batch: np.ndarray) -> np.ndarray:
    """Page ids padded to `COPY_BATCH` with the scratch page (padding copies are never used)."""
    out = np.full(COPY_BATCH, SCRATCH_PAGE, np.int32)
    out[:len(batch)] = batch
    return out


def _stacked(arrays: Sequence[Latents]) -> PagedKVCache:
    """Host pages `(c_kv, k_pe, c_scale, index_k)` as one `COPY_BATCH`-page pool (zero padding)."""
    def stack(parts: list[np.ndarray | None]) -> np.ndarray | None:
        if parts[0] is None:
            return None
        out = np.zeros((parts[0].shape[0], COPY_BATCH, *parts[0].shape[1:]), parts[0].dtype)
        out[:, :len(parts)] = np.stack(parts, axis=1)
        return out

    return PagedKVCache(*(stack([a[i] for a in arrays]) for i in range(len(arrays[0]))))
