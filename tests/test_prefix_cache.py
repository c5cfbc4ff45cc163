"""The prefix cache on the host alone (a dict stands in for the device pool): longest-prefix matches
of full pages, shared pages held through the allocator's counts, LRU eviction of unreferenced pages
(tails of prefixes first), offload to host and reload on a hit, the host budget pruning the least
recently used pages with everything after them. The allocator is checked after every test."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dsr1.serving.pages import PageAllocator
from dsr1.serving.prefix_cache import PrefixCache

PAGE = 4


class FakeStore:
    """A page pool as a dict page -> contents; saves and restores copies of the contents."""

    page_bytes = 100

    def __init__(self):
        self.contents: dict[int, object] = {}
        self.saved: list[int] = []
        self.restored: list[int] = []
        self.released = 0  # host copies dropped: every copy saved is released once it leaves the host

    def save(self, pages: Sequence[int]) -> list[object]:
        self.saved += pages
        return [("copy", self.contents[p]) for p in pages]

    def restore(self, pages: Sequence[int], copies: Sequence[object]) -> None:
        self.restored += pages
        for page, (_, value) in zip(pages, copies):
            self.contents[page] = value

    def release(self, copies: Sequence[object]) -> None:
        self.released += len(copies)


class Harness:
    """An allocator, a store and a cache, plus 'requests' (page lists) holding pages like the scheduler's."""

    def __init__(self, num_pages: int, host_pages: int = 0, store: bool = True):
        self.allocator = PageAllocator(num_pages)
        self.store = FakeStore() if store else None
        self.cache = PrefixCache(self.allocator, PAGE, store=self.store, host_bytes=host_pages * FakeStore.page_bytes)
        self.requests: dict[str, list[int]] = {}

    def run(self, name: str, tokens: list[int]) -> list[int]:
        """A request: reuse the cached prefix, write the rest into new pages (contents = the page's
        tokens), index its full pages; it keeps holding its pages until `done`."""
        match = self.cache.match(tokens, len(tokens) - 1)
        pages = self.cache.acquire(match)
        missing = -(-len(tokens) // PAGE) - len(pages)
        self.cache.make_room(missing)
        own = self.allocator.allocate(missing)
        for i, page in enumerate(own, start=len(pages)):
            if self.store is not None:
                self.store.contents[page] = tuple(tokens[i * PAGE:(i + 1) * PAGE])
        self.requests[name] = pages + own
        self.cache.insert(tokens, pages + own)
        return pages + own

    def done(self, name: str) -> None:
        self.allocator.free(self.requests.pop(name))

    def contents(self, pages: list[int]) -> list[object]:
        return [self.store.contents[p] for p in pages]

    def check(self) -> None:
        self.allocator.check([*self.requests.values(), self.cache.held_pages()])
        if self.store is not None:
            held = len(self.store.saved) - self.store.released
            assert held == self.cache.stats().host_pages, "host copies leaked or released twice"


@pytest.fixture
def harnesses():
    made: list[Harness] = []
    yield lambda *args, **kwargs: made.append(Harness(*args, **kwargs)) or made[-1]
    for h in made:
        h.check()


def tokens(*chunks: int, tail: int = 0) -> list[int]:
    """Whole pages numbered `chunks` (page c is [c, c, c, c]) and `tail` extra tokens."""
    return [c for c in chunks for _ in range(PAGE)] + [99] * tail


def test_longest_full_page_prefix_is_shared(harnesses):
    h = harnesses(20)
    first = h.run("a", tokens(1, 2, 3, tail=2))
    assert h.cache.match(tokens(1, 2, 3, tail=2), 13).tokens == 12
    assert h.cache.match(tokens(1, 2, 3), 11).tokens == 8, "the last token always runs: its page is not reused"
    assert h.cache.match(tokens(1, 5, 3, tail=1), 12).tokens == 4, "a different page breaks the chain"
    second = h.run("b", tokens(1, 2, 7, tail=1))
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [h.allocator.refcount(p) for p in first[:2]] == [3, 3], "cache + two requests"
    h.check()
    h.done("a")
    h.done("b")
    assert h.cache.stats().hit_tokens == 8
    assert h.cache.unreferenced_count() == 4, "pages 1, 2, 3, 7 are now held by the cache alone"


def test_eviction_takes_least_recently_used_tails_first_and_prunes_without_a_store(harnesses):
    h = harnesses(9, store=False)  # 8 usable pages
    h.run("a", tokens(1, 2, 3))
    h.done("a")
    h.run("b", tokens(4, 5))
    h.done("b")
    h.run("c", tokens(1, 2, tail=1))  # touches 1, 2 again: 3 is now the least recently used
    h.done("c")
    assert h.allocator.free_count == 3 and h.cache.unreferenced_count() == 5
    h.cache.make_room(5)
    assert h.allocator.free_count == 5
    remaining = h.cache.match(tokens(1, 2, 3, tail=1), 12).tokens, h.cache.match(tokens(4, 5, tail=1), 8).tokens
    assert remaining == (8, 4), "3 went first (oldest), then 5 (the tail of 4, 5), keeping 4"
    assert h.cache.stats().pruned == 2


def test_can_evict_counts_unreferenced_pages_outside_the_match(harnesses):
    h = harnesses(9, store=False)  # 8 usable pages
    h.run("a", tokens(1, 2, 3))
    h.done("a")
    h.run("b", tokens(4, 5))  # held: not evictable
    assert h.cache.unreferenced_count() == 3 and h.allocator.free_count == 3
    nothing = h.cache.match([], 0)
    assert h.cache.can_evict(0, nothing) and h.cache.can_evict(3, nothing) and not h.cache.can_evict(4, nothing)
    ones_twos = h.cache.match(tokens(1, 2, tail=1), 8)
    assert h.cache.can_evict(1, ones_twos) and not h.cache.can_evict(2, ones_twos), "the match's pages are kept"
    h.done("b")
    assert h.cache.can_evict(5, nothing) and not h.cache.can_evict(6, nothing)


def test_pages_in_use_are_never_evicted(harnesses):
    h = harnesses(5, store=False)  # 4 usable
    h.run("a", tokens(1, 2, 3))
    h.cache.make_room(4)
    assert h.allocator.free_count == 1 and h.cache.match(tokens(1, 2, 3), 12).tokens == 12
    h.done("a")
    h.cache.make_room(4)
    assert h.allocator.free_count == 4 and h.cache.stats().device_pages == 0


def test_offloaded_pages_come_back_with_their_contents(harnesses):
    h = harnesses(5, host_pages=8)  # 4 usable device pages
    h.run("a", tokens(1, 2, 3, tail=1))
    h.done("a")
    h.run("b", tokens(6, 7, 8, tail=1))  # needs 4 pages: 1, 2, 3 and a's last page go to host... or get freed
    assert len(h.store.saved) == 3, "the cached pages of a were copied out before their pages were reused"
    h.done("b")
    stats = h.cache.stats()
    assert (stats.host_pages, stats.offloaded, stats.host_bytes) == (3, 3, 300)
    pages = h.run("c", tokens(1, 2, 3, tail=1))
    assert h.cache.stats().reloaded == 3 and len(h.store.restored) == 3
    assert h.contents(pages[:3]) == [(1,) * 4, (2,) * 4, (3,) * 4], "reloaded pages hold what was evicted"
    h.done("c")


def test_host_budget_prunes_least_recently_used(harnesses):
    h = harnesses(4, host_pages=2)  # 3 usable device pages, 2 host pages
    h.run("a", tokens(1, 2, tail=1))
    h.done("a")
    h.run("b", tokens(5, tail=1))  # evicts 2 (the tail of 1, 2) to host
    h.done("b")
    assert h.cache.stats().host_pages == 1
    h.run("c", tokens(6, 7, tail=1))  # evicts 1 and 5 to host: 3 pages there, over the budget of 2
    h.done("c")
    stats = h.cache.stats()
    assert (stats.host_pages, stats.offloaded, stats.pruned) == (2, 3, 1)
    assert h.cache.match(tokens(1, 2, tail=1), 9).tokens == 4, "2, the least recently used, was pruned; 1 stays"
    assert h.cache.match(tokens(5, tail=1), 5).tokens == 4


def test_insert_adopts_a_fresh_copy_of_an_offloaded_page(harnesses):
    h = harnesses(3, host_pages=4)  # 2 usable
    h.run("a", tokens(1, tail=1))
    h.done("a")
    h.run("b", tokens(2, tail=1))  # needs both pages: 1 goes to host
    h.done("b")
    h.cache.make_room(2)  # 2 goes to host too
    assert h.cache.stats().host_pages == 2
    h.requests["x"] = own = h.allocator.allocate(1)  # a request that computed page 1 again itself
    h.cache.insert(tokens(1), own)
    assert h.cache.stats().host_pages == 1, "the offloaded copy of 1 is dropped for the device copy"
    assert h.cache.acquire(h.cache.match(tokens(1, tail=1), 5)) == own, "nothing is reloaded"
    assert h.store.restored == []
    h.allocator.free(own)
    h.done("x")


def test_disabled_cache_never_matches(harnesses):
    h = harnesses(9)
    h.cache.enabled = False
    h.run("a", tokens(1, 2, tail=1))
    h.done("a")
    assert h.cache.match(tokens(1, 2, tail=1), 9).tokens == 0 and h.cache.held_pages() == []
