"""The serving engine's sizes and call shapes (`SchedulerConfig`): its slots and page pool, split over
the data-parallel ranks, and the bucketed shapes of its prefill and decode calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .pages import pages_needed

if TYPE_CHECKING:
    from .plan import Lane

__all__ = ["SchedulerConfig"]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The engine's fixed sizes: batch slots, page size and pool size, the prefill call's shape
    (`prefill_rows` x `prefill_chunk`) and the longest sequence (prompt + output) a slot can hold.
    With `ranks` > 1 (attention data parallelism) `max_seqs`, `prefill_rows` and `num_pages` are
    split evenly over the ranks, and every call has the same rows on each rank."""

    max_seqs: int
    page_size: int
    num_pages: int
    prefill_chunk: int
    prefill_rows: int
    max_seq_len: int
    decode_steps: int = 1  # decode steps per decode call
    draft_tokens: int = 0  # MTP drafts per decode iteration (0: none)
    batch_invariant: bool = False  # one shape per call kind (`prefill_shapes`, `decode_shapes`)
    ranks: int = 1  # data-parallel ranks: each holds its rows' slots and pages

    def __post_init__(self) -> None:
        for name in ("max_seqs", "page_size", "prefill_chunk", "prefill_rows", "max_seq_len", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {self.draft_tokens}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages}: need the scratch page and at least one more")
        if self.prefill_rows > self.max_seqs:
            raise ValueError(f"prefill_rows={self.prefill_rows} exceeds max_seqs={self.max_seqs}")
        for name in ("max_seqs", "prefill_rows", "num_pages"):
            if getattr(self, name) % self.ranks:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of the {self.ranks} "
                                 f"data-parallel ranks (each rank holds an equal share)")
        if self.num_pages // self.ranks < 2:
            raise ValueError(f"num_pages={self.num_pages}: each of the {self.ranks} ranks needs its scratch page "
                             f"and at least one more")

    @property
    def rank_slots(self) -> int:
        """Slots of each rank (rank r holds slots `r * rank_slots ..`)."""
        return self.slots // self.ranks

    @property
    def rank_pages(self) -> int:
        """Pages of each rank's share of the pool (rank r holds pages `r * rank_pages ..`; the first
        its scratch page)."""
        return self.num_pages // self.ranks

    @property
    def slots(self) -> int:
        """Batch slots: `max_seqs` decoding requests, and `prefill_rows` more whose prompts are
        prefilled ahead of a free decode row (docs/serving.md, "Slots")."""
        return self.max_seqs + self.prefill_rows

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """The prefill call's shapes `(rows, chunk)`, all compiled at warm-up: one row or
        `prefill_rows`, and chunks of `prefill_chunk` or a quarter of it (from 16 tokens up).
        `batch_invariant`: `(prefill_rows, prefill_chunk)` only, so a chunk's products never change
        shape with the requests prefilling beside it."""
        if self.batch_invariant:
            return ((self.prefill_rows, self.prefill_chunk),)
        rows = sorted({self.ranks, self.prefill_rows})  # one row per rank, or all of them
        chunks = sorted({self.prefill_chunk} | ({self.prefill_chunk // 4} if self.prefill_chunk >= 64 else set()))
        return tuple((r, c) for r in rows for c in chunks)

    def prefill_shape(self, lanes: Sequence[Lane]) -> tuple[int, int]:
        """The smallest prefill shape that holds `lanes` (a lone row or a short last chunk costs less)."""
        longest = max(lane.count for lane in lanes)
        per_rank = self.rows_per_rank(lanes)
        return min((r * c, r, c) for r, c in self.prefill_shapes
                   if r // self.ranks >= per_rank and c >= longest)[1:]

    def rows_per_rank(self, lanes: Sequence[Lane]) -> int:
        """The most lanes any one rank has (a call gives every rank as many rows)."""
        if self.ranks == 1:
            return len(lanes)
        counts = np.bincount([lane.seq.rank for lane in lanes], minlength=self.ranks)
        return int(counts.max())

    @property
    def decode_shapes(self) -> tuple[int, ...]:
        """The decode call's row counts, all compiled at warm-up: `max_seqs` and its halvings down to
        8 rows, and one row. A call reads every weight whatever its rows, but the lm_head's product,
        the sampling and the attention grow with them, so a lone request (a single user, the last
        long request of a busy period) gets a one-row call; two and four rows cost about as much as
        eight on CPU (XLA:CPU's lm_head product of a few rows), so they get no shape of their own.
        `batch_invariant`: `max_seqs` rows only, so a row's products never change shape with the
        number of requests running (docs/serving.md, "Draft numerics")."""
        if self.batch_invariant:
            return (self.max_seqs,)
        most = self.max_seqs // self.ranks  # per rank
        rows, half = {1, most}, most // 2
        while half >= 8:
            rows.add(half)
            half //= 2
        return tuple(sorted(r * self.ranks for r in rows))

    def decode_shape(self, lanes: Sequence[Lane]) -> int:
        """The fewest decode rows that hold `lanes`."""
        per_rank = self.rows_per_rank(lanes)
        return min(r for r in self.decode_shapes if r // self.ranks >= per_rank)

    @property
    def prefill_width(self) -> int:
        """Token columns a prefill row carries beyond its chunk: 1 with drafts (the prompt's token after
        the chunk, which the MTP module reads; docs/serving.md), else 0."""
        return 1 if self.draft_tokens else 0

    @property
    def table_width(self) -> int:
        """Pages in each slot's page table."""
        return pages_needed(self.max_seq_len, self.page_size)
