"""The host-side page allocator: reference counts, clear errors, and an invariant check that catches
leaks and double frees; page-table arrays."""

from __future__ import annotations

import numpy as np
import pytest

from dsr1.serving.pages import (
    SCRATCH_PAGE,
    OutOfPagesError,
    PageAllocator,
    PageError,
    check_extend_batch,
    page_table_array,
    pages_needed,
)


@pytest.fixture
def allocator():
    """A fresh allocator of 9 pages (8 usable); after the test, everything must be free again."""
    pages = PageAllocator(9)
    yield pages
    pages.check()


def test_allocate_and_free_round_trip(allocator):
    assert (allocator.num_pages, allocator.capacity, allocator.free_count) == (9, 8, 8)
    a = allocator.allocate(3)
    b = allocator.allocate(5)
    assert SCRATCH_PAGE not in a + b and len(set(a + b)) == 8
    assert allocator.free_count == 0 and allocator.used_count == 8
    assert all(allocator.refcount(p) == 1 for p in a + b)
    allocator.check([a, b])
    allocator.free(a)
    assert allocator.free_count == 3 and allocator.refcount(a[0]) == 0
    assert sorted(allocator.allocate(3)) == sorted(a), "freed pages are reused"
    allocator.free(a)
    allocator.free(b)


def test_out_of_pages_takes_nothing(allocator):
    held = allocator.allocate(6)
    with pytest.raises(OutOfPagesError, match="asked for 3 pages but only 2 of 8 are free"):
        allocator.allocate(3)
    assert allocator.free_count == 2
    with pytest.raises(ValueError, match="cannot allocate -1 pages"):
        allocator.allocate(-1)
    assert allocator.allocate(0) == []
    allocator.free(held)


def test_shared_pages_stay_until_the_last_holder_frees(allocator):
    prefix = allocator.allocate(2)
    allocator.incref(prefix)  # a second request reads the same prefix
    own = allocator.allocate(1)
    allocator.check([prefix, prefix + own])
    assert [allocator.refcount(p) for p in prefix] == [2, 2]
    allocator.free(prefix)
    assert [allocator.refcount(p) for p in prefix] == [1, 1] and allocator.free_count == 5
    allocator.free(prefix + own)
    assert allocator.free_count == 8


def test_double_free_raises_and_changes_nothing(allocator):
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(PageError, match=rf"cannot free pages \[{min(pages)}, {max(pages)}\]: held \[0, 0\] times"):
        allocator.free(pages)
    other = allocator.allocate(1)
    with pytest.raises(PageError, match="held \\[1\\] times"):
        allocator.free(other + other)  # one holder cannot free twice in one call either
    assert allocator.refcount(other[0]) == 1, "a refused free changes nothing"
    allocator.free(other)


def test_bad_page_ids(allocator):
    with pytest.raises(PageError, match="page 0 is not an allocatable page"):
        allocator.free([SCRATCH_PAGE])
    with pytest.raises(PageError, match="page 9 is not an allocatable page"):
        allocator.refcount(9)
    with pytest.raises(PageError, match="cannot share pages \\[4\\]"):
        allocator.incref([4])
    with pytest.raises(ValueError, match="need the scratch page"):
        PageAllocator(1)


def test_check_catches_a_leak():
    allocator = PageAllocator(9)
    kept = allocator.allocate(2)
    lost = allocator.allocate(1)  # its owner forgets to free it
    allocator.check([kept, lost])
    with pytest.raises(PageError, match=rf"leaked \(count above holders\): page {lost[0]} count 1 holders 0"):
        allocator.check([kept])
    allocator.free(kept + lost)
    allocator.check()


def test_check_catches_a_double_free_hidden_by_reuse():
    """Owner A frees its page, B is given the same page, A frees it again: `free` cannot tell (the
    page is held once), but the check against the owners' page lists can."""
    allocator = PageAllocator(5)
    a = allocator.allocate(1)
    allocator.free(a)
    b = allocator.allocate(1)
    assert b == a
    allocator.free(a)  # A's stale id: looks legal
    with pytest.raises(PageError, match=rf"freed while held \(count below holders\): page {b[0]} count 0 holders 1"):
        allocator.check([b])
    allocator.check()


def test_pages_needed_and_page_table_array():
    assert [pages_needed(n, 16) for n in (0, 1, 16, 17, 40)] == [0, 1, 1, 2, 3]
    table = page_table_array([[7, 3], None, [5]], width=4, rows=4)
    np.testing.assert_array_equal(table, [[7, 3, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0], [0, 0, 0, 0]])
    assert table.dtype == np.int32
    with pytest.raises(ValueError, match="slot 0 holds 3 pages; the page table is 2 wide"):
        page_table_array([[1, 2, 3]], width=2)
    with pytest.raises(ValueError, match="3 page tables for 2 batch slots"):
        page_table_array([[1], [2], [3]], width=2, rows=2)


def test_check_extend_batch_names_the_slot_at_fault():
    tokens, logits_at = np.zeros((2, 4), np.int32), np.zeros((2, 1), np.int32)
    table = page_table_array([[3, 5], None], width=3)

    def check(starts, counts, table=table, logits_at=logits_at):
        check_extend_batch(tokens, np.array(starts), np.array(counts), table, logits_at, page_size=4, num_pages=8)

    check([4, 0], [4, 0])  # 8 tokens in 2 pages; slot 1 idle
    with pytest.raises(ValueError, match=r"slot 0: 9 tokens need 3 pages of 4; its table \[3, 5, 0\]"):
        check([5, 0], [4, 0])
    with pytest.raises(ValueError, match="slot 1: 1 tokens need 1 pages"):
        check([0, 0], [1, 1])
    with pytest.raises(ValueError, match=r"counts \[5, 0\] must be within \[0, 4\]"):
        check([0, 0], [5, 0])
    with pytest.raises(ValueError, match=r"page ids must be within \[0, 8\)"):
        check([0, 0], [1, 0], table=table + 8)
    with pytest.raises(ValueError, match=r"logits_at must index the chunk \[0, 4\)"):
        check([0, 0], [1, 0], logits_at=logits_at + 4)
    with pytest.raises(ValueError, match=r"starts has leading shape \(1,\), expected \(2,\)"):
        check([0], [1, 0])


def test_a_ranks_share_hands_out_its_own_ids():
    """Under attention data parallelism each rank's allocator covers its share of the pool: ids
    `first + 1 ..`, its first page its scratch page; the checks name the share's ids."""
    share = PageAllocator(5, first=10)
    assert share.allocate(4) == [11, 12, 13, 14] and share.free_count == 0
    assert share.refcounts([11, 14]).tolist() == [1, 1]
    with pytest.raises(PageError, match=r"11 \.\. 14; 10 is the scratch page"):
        share.free([3])
    share.free([12])
    share.check([[11, 13, 14]])
    with pytest.raises(PageError, match="leaked"):
        share.check([[11, 13]])
    share.free([11, 13, 14])
    share.check()
