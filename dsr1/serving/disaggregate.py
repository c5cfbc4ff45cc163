"""Prefill/decode disaggregation: prompts prefill on one set of devices while requests decode on another.

`Engine(model, disaggregate=(p, d))` splits the model's devices in two meshes, the first `p` for
prefill and the next `d` for decode, each holding the whole model (sharded over its own devices as
the model is over its mesh) and a page pool under the same page ids. The scheduler, the prefix
cache and the page allocator do not change: one plan per step, whose prefill call runs on the
prefill side and whose decode call runs on the decode side, so a long prompt's chunks no longer
stall the decode rows' steps (they run at once, on other chips).

The decode side's pool is the store: every page's latents are there. A prefill call's pages
(both pools' with MTP drafts) move to it as soon as the call is dispatched, a copy program on the
prefill devices, a transfer and a write on the decode devices, all queued behind their side's
work, so the move overlaps both sides' computing; the decode call that first reads them is
queued after the write. The prefill side borrows what it reads and did not write itself: a
request's prefix-cache pages move the other way before its first chunk. Page copies to host
memory (the prefix cache's offload) run on the decode side. With drafts, the MTP module's output
after a prompt's last chunk (the first draft's input) moves with the pages.

One JAX process: the two sides exchange arrays by `jax.device_put` between meshes of this process's
devices (a host's chips); disaggregation across processes is not supported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import cpu, programs
from ..api import Model
from ..core.cache import SCRATCH_PAGE
from ..core.sharding import make_mesh, put_replicated, replicated_sharding
from ..programs.draft_step import DraftSlotState, mtp_paged_cache, take_mtp_hidden
from ..programs.step import SlotState, StepRows
from .page_pool import PagePool, page_batches
from .shapes import SchedulerConfig
from .work import Admission, DeviceRunner, StepWork

__all__ = ["SplitRunner", "check_split", "model_on", "split_devices"]


def check_split(split: Sequence[int], devices: int) -> tuple[int, int]:
    """`(prefill, decode)` device counts, both >= 1 and together at most `devices`; ValueError otherwise."""
    if len(split) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
        raise ValueError(f"disaggregate must be (prefill devices, decode devices), each >= 1, got {split!r}")
    if split[0] + split[1] > devices:
        raise ValueError(f"disaggregate={tuple(split)} asks for {split[0] + split[1]} devices; the model's mesh "
                         f"has {devices}")
    if jax.process_count() > 1:
        raise ValueError("disaggregate runs within one JAX process (its devices); this run has "
                         f"{jax.process_count()} processes")
    return split[0], split[1]


def split_devices(mesh: Mesh, prefill: int, decode: int) -> tuple[Mesh, Mesh]:
    """Two meshes (`make_mesh`'s layout) from `mesh`'s devices: the first `prefill` of them, then the
    next `decode`."""
    devices = list(mesh.devices.flat)
    return make_mesh(devices=devices[:prefill]), make_mesh(devices=devices[prefill:prefill + decode])


def model_on(model: Model, mesh: Mesh) -> Model:
    """`model` with its weights copied to `mesh`, each sharded by the same axes as on its own mesh."""
    def move(x: jax.Array) -> jax.Array:
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return dataclasses.replace(model, params=cpu.view(jax.tree.map(move, model.params), model.cfg, mesh),
                               mesh=mesh)


class SplitRunner:
    """`DeviceRunner`'s interface over two runners, `prefill` and `decode`, each on its own mesh (see
    the module docstring). `pool` is the decode side's (the store: the prefix cache's host copies)."""

    def __init__(self, prefill: DeviceRunner, decode: DeviceRunner, page_size: int):
        self.prefill, self.decode = prefill, decode
        self.page_size = page_size
        self.pool = decode.pool
        self._fresh: set[int] = set()  # slots admitted whose first prompt chunk has not run yet

    @property
    def state(self) -> SlotState | DraftSlotState:
        """The decode side's slot state (where requests sample)."""
        return self.decode.state

    def run(self, work: StepWork) -> tuple[jax.Array, ...]:
        """`DeviceRunner.run` with the prefill call on the prefill side and the decode call on the decode side."""
        for op in work.page_ops:
            self.pool.apply(op)
        self._admit(work.admissions)
        if not work.calls:
            return ()
        masks = work.masks or (None,) * len(work.calls)
        out = []
        for call, mask in zip(work.calls, masks):  # at most one call per side
            side = self.decode if call.tokens.shape[1] == 1 else self.prefill
            if side is self.prefill:
                self._borrow(call, work.page_table)
            packed, table = put_replicated([call.pack(), work.page_table], side.model.mesh)
            out.append(side.serve(call, packed, table, mask))
            if side is self.prefill:
                self._hand_over(call, work.page_table)
        return tuple(out)

    def _admit(self, admissions: Sequence[Admission]) -> None:
        self.prefill.admit(admissions)
        self.decode.admit(admissions)
        self._fresh |= {a.slot for a in admissions}

    def _borrow(self, call: StepRows, table: np.ndarray) -> None:
        """Before a prefill call: the pages its rows' first chunks read from the prefix cache, from the store."""
        pages = []
        for slot, start, count in zip(call.slots.tolist(), call.starts.tolist(), call.counts.tolist()):
            if count and slot in self._fresh:
                self._fresh.discard(slot)
                pages += table[slot, :-(-start // self.page_size)].tolist()
        _move(self.decode.pool, self.prefill.pool, pages)

    def _hand_over(self, call: StepRows, table: np.ndarray) -> None:
        """After a prefill call: the pages it wrote to the store (and, with drafts, the MTP outputs)."""
        pages = []
        for slot, start, count in zip(call.slots.tolist(), call.starts.tolist(), call.counts.tolist()):
            if count:
                pages += table[slot, start // self.page_size:(start + count - 1) // self.page_size + 1].tolist()
        _move(self.prefill.pool, self.decode.pool, pages)
        if self.decode.draft_tokens:
            self._take_mtp_hidden(call.slots)

    def _take_mtp_hidden(self, slots: np.ndarray) -> None:
        """The decode side's MTP outputs of `slots` (out of range: none) from the prefill side's."""
        mesh, num_slots = self.decode.model.mesh, self.decode.state.mtp_hidden.shape[0]
        taken = np.zeros(num_slots, bool)
        taken[slots[slots < num_slots]] = True
        hidden = jax.device_put(self.prefill.state.mtp_hidden, replicated_sharding(mesh))
        self.decode.state = take_mtp_hidden(self.decode.state, hidden, put_replicated(taken, mesh), mesh=mesh)

    def warm_up(self) -> None:
        """Compile the moves both ways (the scratch page) and, with drafts, the MTP outputs' hand-over."""
        _move(self.decode.pool, self.prefill.pool, [SCRATCH_PAGE])
        _move(self.prefill.pool, self.decode.pool, [SCRATCH_PAGE])
        if self.decode.draft_tokens:
            self._take_mtp_hidden(np.zeros(0, np.int32))


def _move(source: PagePool, target: PagePool, pages: Sequence[int]) -> None:
    """Copy `pages` (every layer, both pools with drafts) from `source`'s devices to `target`'s."""
    for batch in page_batches(list(dict.fromkeys(pages))):
        contents = jax.device_put(source.take(np.asarray(batch, np.int32)), replicated_sharding(target.mesh))
        target.put(np.asarray(batch, np.int32), contents)


def runner_for(model: Model, config: SchedulerConfig, disaggregate: tuple[int, int] | None = None
               ) -> DeviceRunner | SplitRunner:
    """The engine's device side for `config` (its page pool, with the MTP module's beside it where it
    drafts, and its slot state): on the model's mesh, or split `(p, d)` into prefill and decode
    devices, each with its own copy of the weights and of the pool."""
    def on(part: Model) -> DeviceRunner:
        sizes = dict(cfg=part.cfg, mesh=part.mesh, num_pages=config.num_pages, page_size=config.page_size,
                     dtype=part.dtype, kv_cache_dtype=part.kv_cache_dtype, rules=part.rules)
        pool = PagePool(programs.paged_cache(**sizes), part.mesh,
                        mtp_cache=mtp_paged_cache(**sizes) if config.draft_tokens else None, rules=part.rules)
        return DeviceRunner(part, pool, slots=config.slots, max_seq_len=config.max_seq_len,
                            decode_steps=config.decode_steps, draft_tokens=config.draft_tokens)

    if disaggregate is None:
        return on(model)
    meshes = split_devices(model.mesh, *check_split(disaggregate, model.mesh.size))
    return SplitRunner(*(on(model_on(model, mesh)) for mesh in meshes), config.page_size)
