"""Host-side page bookkeeping for the paged latent cache (`dsr1.core.cache.PagedKVCache`).

A sequence's cached tokens live in fixed-size pages of the device pool; its *page table* is the
list of its page ids in order (token `pos` is in `table[pos // page_size]`). `PageAllocator` hands
out page ids with reference counts: a page returns to the free list when its last holder frees it,
so a prefix cache and the requests reading a common prefix can share pages. Page `SCRATCH_PAGE`
(0) is never handed out: the device writes padding tokens there.

Misuse fails loudly: running out of pages raises `OutOfPagesError` (allocating nothing), freeing or
sharing a page nobody holds raises `PageError`. `check(holders)` verifies the whole state against
the page lists that are supposed to be alive (tests call it after every scenario): each page's
count equals its number of holders (a larger count is a leak, a smaller one a double free that
slipped past because the page was reallocated), the free list holds exactly the unheld pages, once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from ..core.cache import SCRATCH_PAGE

__all__ = ["SCRATCH_PAGE", "OutOfPagesError", "PageAllocator", "PageError", "check_extend_batch", "page_table_array",
           "pages_needed"]


class PageError(RuntimeError):
    """A page was used against the allocator's rules (double free, sharing a free page, leak)."""


class OutOfPagesError(PageError):
    """More pages were asked for than are free."""


class PageAllocator:
    """Reference-counted page ids `first + 1 .. first + num_pages - 1` of a pool (or one data-parallel
    rank's share of it, `first` its first page) of `num_pages` pages; page `first` is scratch.

    `allocate(n)` gives n free pages with count 1; `incref(pages)` adds a holder to pages in use;
    `free(pages)` drops one holder from each, and pages nobody holds any more become free.
    Freed pages are reused first (last freed, first allocated), which keeps recently written pages
    hot; nothing relies on any order.
    """

    def __init__(self, num_pages: int, first: int = SCRATCH_PAGE):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the scratch page and at least one usable page")
        self.first = first  # the share's scratch page
        self._counts = np.zeros(num_pages, np.int64)
        self._free = list(range(first + num_pages - 1, first, -1))  # pop() gives first + 1, + 2, ...

    @property
    def num_pages(self) -> int:
        """Pages in the pool, the scratch page included."""
        return len(self._counts)

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.capacity - self.free_count

    def refcount(self, page: int) -> int:
        """How many holders `page` has (0: free)."""
        self._check_id(page)
        return int(self._counts[page - self.first])

    def refcounts(self, pages: Sequence[int]) -> np.ndarray:
        """How many holders each of `pages` has (no id checks: for bookkeeping loops over many pages)."""
        return self._counts[np.asarray(pages, np.int64) - self.first]

    def allocate(self, n: int) -> list[int]:
        """`n` free pages, each now held once. Raises `OutOfPagesError` (taking nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages but only {len(self._free)} of {self.capacity} are free")
        pages = [self._free.pop() for _ in range(n)]
        self._counts[np.asarray(pages, np.int64) - self.first] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more holder for each of `pages` (a page listed twice gains two); each must be in use."""
        pages = list(pages)
        self._require_held(pages, "share")
        np.add.at(self._counts, np.asarray(pages, np.int64) - self.first, 1)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder from each of `pages`; pages left with none become free. Checks everything
        before changing anything, so a bad call (a page freed more often than it is held, the scratch
        page, an unknown id) raises `PageError` and leaves the allocator as it was."""
        pages = list(pages)
        self._require_held(pages, "free")
        np.subtract.at(self._counts, np.asarray(pages, np.int64) - self.first, 1)
        self._free.extend(p for p in dict.fromkeys(pages) if self._counts[p - self.first] == 0)

    def check(self, holders: Iterable[Sequence[int]] = ()) -> None:
        """Verify the allocator against the page lists of everything that should hold pages now (each
        list holds each of its pages once; no lists: everything should be free). Raises `PageError`
        naming every page whose count differs from its holders (leaked or over-freed) and any
        corruption of the free list."""
        held = Counter(p for pages in holders for p in pages)
        for page in held:
            self._check_id(page)
        problems, first = [], self.first
        count = {p: int(self._counts[p - first]) for p in range(first + 1, first + self.num_pages)}
        leaked = [p for p, n in count.items() if n > held[p]]
        over_freed = [p for p, n in count.items() if n < held[p]]
        if leaked:
            problems.append("leaked (count above holders): " + _describe(leaked, count, held))
        if over_freed:
            problems.append("freed while held (count below holders): " + _describe(over_freed, count, held))
        if (self._counts < 0).any() or self._counts[0] != 0:
            problems.append(f"bad counts: {(np.flatnonzero(self._counts < 0) + first).tolist()} negative, "
                            f"scratch page count {self._counts[0]}")
        free = Counter(self._free)
        unheld = {p for p, n in count.items() if n == 0}
        if set(free) != unheld or any(c > 1 for c in free.values()):
            problems.append(f"free list {sorted(self._free)} is not the unheld pages {sorted(unheld)} once each")
        if problems:
            raise PageError("page allocator invariants broken: " + "; ".join(problems))

    def _check_id(self, page: int) -> None:
        if not self.first < page < self.first + self.num_pages:
            raise PageError(f"page {page} is not an allocatable page ({self.first + 1} .. "
                            f"{self.first + self.num_pages - 1}; {self.first} is the scratch page)")

    def _require_held(self, pages: list[int], action: str) -> None:
        for page in pages:
            self._check_id(page)
        asked = Counter(pages)
        # Freeing: each page at most as often as it is held. Sharing: only pages someone holds.
        counts = {p: int(self._counts[p - self.first]) for p in asked}
        bad = [p for p, n in asked.items() if (counts[p] < n if action == "free" else counts[p] == 0)]
        if bad:
            raise PageError(f"cannot {action} pages {sorted(bad)}: held "
                            f"{[counts[p] for p in sorted(bad)]} times (double free or stale page id?)")


def _describe(pages: list[int], counts: dict[int, int], held: Counter) -> str:
    return ", ".join(f"page {p} count {counts[p]} holders {held[p]}" for p in pages)


def pages_needed(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


def page_table_array(tables: Sequence[Sequence[int] | None], width: int, rows: int | None = None) -> np.ndarray:
    """The `[rows, width]` int32 page-table array `extend` takes: row i lists `tables[i]` (None: an
    idle slot), padded with `SCRATCH_PAGE`. Raises ValueError if a table is wider than `width`."""
    rows = len(tables) if rows is None else rows
    if len(tables) > rows:
        raise ValueError(f"{len(tables)} page tables for {rows} batch slots")
    out = np.full((rows, width), SCRATCH_PAGE, np.int32)
    for i, table in enumerate(tables):
        if table is None:
            continue
        if len(table) > width:
            raise ValueError(f"slot {i} holds {len(table)} pages; the page table is {width} wide")
        out[i, :len(table)] = table
    return out


def check_extend_batch(tokens: np.ndarray, starts: np.ndarray, counts: np.ndarray, page_table: np.ndarray,
                       logits_at: np.ndarray, *, page_size: int, num_pages: int) -> None:
    """Check the host arrays of one `extend` call before they go to the device (the device does not
    check: a page id out of range or a row outgrowing its table would silently read or write the
    wrong tokens). Raises ValueError naming the slot at fault."""
    b, t = tokens.shape
    shapes = {"starts": (starts.shape, (b,)), "counts": (counts.shape, (b,)),
              "page_table": (page_table.shape[:1], (b,)), "logits_at": (logits_at.shape[:1], (b,))}
    for name, (got, want) in shapes.items():
        if got != want:
            raise ValueError(f"{name} has leading shape {got}, expected {want} for {b} slots")
    if ((counts < 0) | (counts > t)).any() or (starts < 0).any():
        raise ValueError(f"counts {counts.tolist()} must be within [0, {t}] and starts {starts.tolist()} >= 0")
    if ((page_table < 0) | (page_table >= num_pages)).any():
        raise ValueError(f"page ids must be within [0, {num_pages}); got {sorted(set(page_table.ravel().tolist()))}")
    if ((logits_at < 0) | (logits_at >= t)).any():
        raise ValueError(f"logits_at must index the chunk [0, {t})")
    for slot in np.flatnonzero(counts):
        end = int(starts[slot] + counts[slot])
        used = page_table[slot, :pages_needed(end, page_size)]
        if end > page_table.shape[1] * page_size or (used == SCRATCH_PAGE).any():
            raise ValueError(f"slot {slot}: {end} tokens need {pages_needed(end, page_size)} pages of {page_size}; "
                             f"its table {page_table[slot].tolist()} does not provide them")
