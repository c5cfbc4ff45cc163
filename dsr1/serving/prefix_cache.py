"""The prefix cache: full pages of latents, keyed by every token up to their end, shared read-only.

A *trie of page-sized chunks*: each node is one full page, keyed by its `page_size` tokens under
its parent (the page before it), so a node stands for exactly one token prefix and a lookup
compares tokens (no hash collisions to worry about). A new request walks the trie with its prompt
and reuses the longest chain of pages found; only the rest of its prompt is prefilled.

Pages are shared through the `PageAllocator`'s reference counts: the cache holds each page it
indexes once, every request reading it once more. A page only the cache holds is *unreferenced*:
when the pool runs short, `make_room` evicts the least recently used of those. With a `PageStore`
and a host budget, an evicted page is copied to host memory first (offload) and its node stays in
the trie, so a later hit brings it back into a fresh page (reload) instead of recomputing it; past
the host budget the least recently used host pages are pruned, with everything below them in the
trie (a page is useless without its prefix). Without a store, eviction prunes at once.

LRU order: a hit touches its chain from the deepest page up, so a page is always more recent than
the pages after it and eviction takes the tails of prefixes first.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from .pages import PageAllocator

__all__ = ["PageStore", "PrefixCache", "PrefixCacheStats", "PrefixMatch"]


class PageStore(Protocol):
    """Copies of whole pages between the device pool and host memory (the engine's `PageLog`, whose
    operations every process's `PagePool` runs)."""

    page_bytes: int

    def save(self, pages: Sequence[int]) -> list[Any]:
        """Copies of `pages`' contents, taken before anything written to those pages later."""

    def restore(self, pages: Sequence[int], copies: Sequence[Any]) -> None:
        """Write `copies` (from `save`) into `pages`, before anything that reads them later."""

    def release(self, copies: Sequence[Any]) -> None:
        """`copies` are no longer needed (restored, superseded or pruned): free their host memory."""


@dataclasses.dataclass(eq=False)
class _Node:
    """One full page of a cached prefix: its tokens, where it is (a device page or a host copy)."""

    chunk: tuple[int, ...]
    parent: _Node | None
    page: int | None = None  # the device page, held once by the cache; None when offloaded
    host: Any = None  # the host copy while offloaded
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The cached pages of a prompt's longest cached prefix, in order (device-resident or offloaded)."""

    nodes: tuple[_Node, ...]
    tokens: int  # prompt tokens they hold

    @property
    def offloaded(self) -> int:
        """Pages of the match that must be reloaded from host memory."""
        return sum(node.page is None for node in self.nodes)


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    device_pages: int  # device pages the cache holds
    host_pages: int  # pages offloaded to host memory
    host_bytes: int
    hit_tokens: int  # prompt tokens served from the cache (not recomputed)
    offloaded: int  # pages copied to host memory on eviction, in total
    reloaded: int  # pages brought back from host memory on a hit, in total
    pruned: int  # pages dropped from the cache, in total


class PrefixCache:
    """Full pages of prompts (and outputs) keyed by their token prefix; see the module docstring.

    `store` and `host_bytes` > 0 turn on host offload; `enabled=False` makes every lookup miss and
    every insert a no-op (for comparisons)."""

    def __init__(self, allocator: PageAllocator, page_size: int, *, store: PageStore | None = None,
                 host_bytes: int = 0, enabled: bool = True):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._store = store
        self._host_pages_max = host_bytes // store.page_bytes if store is not None else 0
        self._root = _Node((), None)
        # Least recently used first. Host pages are never touched (a hit moves them to the device),
        # and eviction takes device pages in LRU order, so eviction order is LRU order on the host too.
        self._device: OrderedDict[_Node, None] = OrderedDict()
        self._host: OrderedDict[_Node, None] = OrderedDict()
        self._hit_tokens = self._offloaded = self._reloaded = self._pruned = 0

    # ---- lookups -------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """The longest chain of cached pages that `tokens[:limit]` begins with (changes nothing)."""
        nodes: list[_Node] = []
        node = self._root
        for chunk in self._chunks(tokens, limit if self.enabled else 0):
            node = node.children.get(chunk)
            if node is None:
                break
            nodes.append(node)
        return PrefixMatch(tuple(nodes), len(nodes) * self.page_size)

    def acquire(self, match: PrefixMatch) -> list[int]:
        """The match's device pages, each now held once more by the caller; offloaded pages are
        first reloaded into fresh pages (evicting others if needed: call only when
        `match.offloaded` pages can be freed). The chain becomes the most recently used."""
        resident = [node.page for node in match.nodes if node.page is not None]
        self.allocator.incref(resident)  # held now, so the reload below cannot evict them
        offloaded = [node for node in match.nodes if node.page is None]
        if offloaded:
            self._evict(len(offloaded))
            pages = self.allocator.allocate(len(offloaded))
            self._store.restore(pages, [node.host for node in offloaded])
            for node, page in zip(offloaded, pages):
                self._to_device(node, page)
            self._reloaded += len(offloaded)
            self.allocator.incref(pages)
            self._enforce_host_budget()
        self._touch(match.nodes)
        self._hit_tokens += match.tokens
        return [node.page for node in match.nodes]

    # ---- filling -------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Index the full pages of a sequence: `pages[i]` holds `tokens[i * page_size : (i + 1) * page_size]`
        (written, or being written by a program already dispatched). Chunks cached already keep
        their page (an offloaded one adopts the sequence's page instead of being reloaded)."""
        if not self.enabled:
            return
        node, path = self._root, []
        for chunk, page in zip(self._chunks(tokens, len(tokens)), pages):
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node(chunk, node)
            if child.page is None:
                self.allocator.incref([page])
                self._to_device(child, page)
            path.append(child)
            node = child
        self._touch(path)

    # ---- eviction ------------------------------------------------------------------------------
    def unreferenced_count(self) -> int:
        """Device pages held by the cache alone: what `make_room` can free."""
        return self._count_unreferenced(self.held_pages())

    def can_evict(self, pages: int, keep: PrefixMatch) -> bool:
        """Whether eviction could free `pages` device pages without taking any of `keep`'s. Scans in
        LRU order and stops as soon as it has found them: the least recently used pages are mostly
        unreferenced, so a full pool costs a few lookups, not one per cached page."""
        kept = {node.page for node in keep.nodes if node.page is not None}
        return pages <= 0 or any(
            found == pages for found, _ in enumerate(self._unreferenced(excluding=kept), start=1))

    def make_room(self, pages: int) -> None:
        """Evict unreferenced pages, least recently used first, until `pages` pages are free (or
        nothing more can be evicted)."""
        self._evict(pages)
        self._enforce_host_budget()

    def held_pages(self) -> list[int]:
        """The device pages the cache holds (one reference each), for `PageAllocator.check`."""
        return [node.page for node in self._device]

    def stats(self) -> PrefixCacheStats:
        page_bytes = self._store.page_bytes if self._store is not None else 0
        return PrefixCacheStats(len(self._device), len(self._host), len(self._host) * page_bytes, self._hit_tokens,
                                self._offloaded, self._reloaded, self._pruned)

    # ---- internals -----------------------------------------------------------------------------
    def _chunks(self, tokens: Sequence[int], limit: int) -> Iterator[tuple[int, ...]]:
        size = self.page_size
        for start in range(0, min(limit, len(tokens)) // size * size, size):
            yield tuple(tokens[start:start + size])

    def _count_unreferenced(self, pages: list[int]) -> int:
        return int((self.allocator.refcounts(pages) == 1).sum()) if pages else 0

    def _unreferenced(self, excluding: set[int] = frozenset()) -> Iterator[_Node]:
        """Device nodes held by the cache alone, least recently used first (lazily)."""
        return (node for node in self._device if node.page not in excluding and self.allocator.refcount(node.page) == 1)

    def _to_device(self, node: _Node, page: int) -> None:
        """The node's page is now `page` (held once by the cache); a host copy is dropped."""
        if node.host is not None:
            self._store.release([node.host])
        node.page, node.host = page, None
        self._host.pop(node, None)
        self._device[node] = None

    def _touch(self, chain: Sequence[_Node]) -> None:
        for node in reversed(chain):  # deepest first: a prefix stays more recent than its tails
            self._device.move_to_end(node)

    def _offloads(self) -> bool:
        return self._store is not None and self._host_pages_max > 0

    def _evict(self, pages: int) -> None:
        """Free unreferenced pages, least recently used first, until `pages` are free; offloaded to
        host when the cache has a store and a host budget, else pruned."""
        short = pages - self.allocator.free_count
        if short <= 0:
            return
        victims = list(itertools.islice(self._unreferenced(), short))
        if not self._offloads():
            for node in victims:
                if node in self._device:  # not pruned already with an earlier victim's subtree
                    self._prune(node)
            return
        copies = self._store.save([node.page for node in victims])
        self.allocator.free([node.page for node in victims])
        for node, copy in zip(victims, copies):
            node.page, node.host = None, copy
            del self._device[node]
            self._host[node] = None
        self._offloaded += len(victims)

    def _enforce_host_budget(self) -> None:
        """Prune the least recently used offloaded pages (and what follows them) past the host budget."""
        while len(self._host) > self._host_pages_max:
            self._prune(next(iter(self._host)))

    def _prune(self, top: _Node) -> None:
        """Drop `top` and everything below it from the cache (requests holding the pages keep them)."""
        del top.parent.children[top.chunk]
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.page is not None:
                self.allocator.free([node.page])
                del self._device[node]
            else:
                self._store.release([node.host])
                del self._host[node]
            self._pruned += 1
