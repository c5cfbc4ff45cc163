"""What one step of the serving engine runs, as the scheduler plans it (`StepPlan`): the requests
holding batch slots (`Running`) and the rows of each call (`Lane`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .pages import pages_needed
from .request import Request

__all__ = ["Lane", "Lanes", "Running", "StepPlan", "reserved_pages"]


def reserved_pages(prompt_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """The pages a request may ever hold: its prompt and every sampled token but the last (which is
    never fed back)."""
    return pages_needed(prompt_tokens + max_new_tokens - 1, page_size)


@dataclasses.dataclass(eq=False)
class Running:
    """A request holding a batch slot: its pages and how far it got. `fed` counts the tokens whose
    latents are written or being written; `sampled` the tokens sampled by dispatched steps;
    `tokens` is the prompt followed by every sampled token read back so far."""

    request: Request
    slot: int
    rank: int  # the data-parallel rank holding its slot and pages
    pages: list[int]
    reserved: int
    fed: int
    tokens: list[int]
    prefill_end: int  # the prompt tokens prefill calls run: all but the last
    sampled: int = 0
    finished: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prefill_end

    @property
    def decoding(self) -> bool:
        """Prefilled, and budget left for another token."""
        return not self.prefilling and self.sampled < self.request.sampling.max_new_tokens


@dataclasses.dataclass(frozen=True)
class Lane:
    """One row of a `serve_step` call: `count` new tokens of `seq` from position `start` (`tokens`
    for a prompt chunk; a decode row feeds its slot's last sampled token instead)."""

    seq: Running
    start: int
    count: int
    tokens: tuple[int, ...]
    sample: bool  # a token is sampled after the last new token
    sample_index: int  # tokens the request sampled before this one
    feed_last: bool
    steps: int = 1  # decode steps of a multi-step call (a token sampled after each)
    mask: np.ndarray | None = None  # the grammar's bitmask for the sampled token (one step only)

    @property
    def prompt_logprobs(self) -> bool:
        """A prompt chunk whose request wants its prompt tokens' log-probabilities."""
        return not self.feed_last and self.seq.request.prompt_top_logprobs is not None


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step runs: requests newly given slots, the prefill call's lanes, the decode call's lanes,
    and the page tables of every slot `[slots, table_width]` as they are for this step."""

    admitted: tuple[Running, ...]
    prefill: tuple[Lane, ...]
    decode: tuple[Lane, ...]
    page_table: np.ndarray

    @property
    def empty(self) -> bool:
        return not (self.admitted or self.prefill or self.decode)


Lanes = Sequence[Lane | None]  # a call's lanes by row (None: an idle row between ranks' lanes)
