"""Process 0's step decisions to the other JAX processes: the wire format, and a device channel.

With several processes every process must run the same programs in the same order (their
collectives meet across processes), but only process 0 has requests, a scheduler and a prefix
cache. So process 0 sends each step's `StepWork` (host arrays only: page copies, admissions, the
`serve_step` calls' rows and page table) to the others, and every process then runs it
(`DeviceRunner.run`). The engine sends it over sockets (`dsr1.serving.control.HostChannel`);
`StepChannel` here sends it by device broadcasts instead (`Engine(control="device")`).

Wire format: the work is flattened into a list of numpy arrays (`work_arrays`; the page table as
the entries that changed since the previous step's, `table_delta`), packed into one uint8 buffer with a
small int32 header (dtype, rank and shape of each array). `StepChannel` sends it with
`jax.experimental.multihost_utils.broadcast_one_to_all` in two broadcasts: a fixed `[2]` header
(stop flag, payload bytes), then the payload zero-padded to a power of two (at least
`MIN_PAYLOAD`), so the broadcast programs see a handful of shapes and compile once each. Process 0
broadcasts before it dispatches: a broadcast is itself a program with a cross-process collective,
and a process that dispatched the step first would queue its collectives in another order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..programs.sampling import SamplingArrays, TokenRuleRows
from ..programs.step import StepRows
from .page_pool import PAGE_OP_KINDS, PageOp
from .work import Admission, StepWork

__all__ = ["MIN_PAYLOAD", "StepChannel", "decode_work", "encode_work", "table_delta", "table_from_delta"]

MIN_PAYLOAD = 1 << 12  # bytes: the smallest payload bucket
_DTYPES = ("int32", "uint32", "float32", "bool")


def _treedef(cls: type) -> jax.tree_util.PyTreeDef:
    """The pytree structure of a registered dataclass whose fields are all arrays."""
    return jax.tree.structure(cls(*range(len(dataclasses.fields(cls)))))


def table_delta(base: np.ndarray | None, table: np.ndarray) -> list[np.ndarray]:
    """`table` as the entries that differ from `base`: `[shape, flat indices, values]`; without a
    base of its shape, the whole table (no indices, every value). A decode step changes an entry
    when a sequence takes a new page."""
    if base is None or base.shape != table.shape:
        return [np.array(table.shape, np.int32), np.zeros(0, np.int32), table.reshape(-1)]
    changed = np.flatnonzero(base != table).astype(np.int32)
    return [np.array(table.shape, np.int32), changed, table.reshape(-1)[changed]]


def table_from_delta(base: np.ndarray | None, shape: np.ndarray, indices: np.ndarray,
                     values: np.ndarray) -> np.ndarray:
    """The inverse of `table_delta`."""
    shape = tuple(int(n) for n in shape)
    if indices.size == 0 and values.size == int(np.prod(shape)):
        return values.reshape(shape).copy()
    table = base.copy()
    table.reshape(-1)[indices] = values
    return table


def work_arrays(work: StepWork, base_table: np.ndarray | None = None) -> list[np.ndarray]:
    """`work` as a flat list of arrays: a header `[ops, admissions, calls, placement?, op kinds...]`,
    then the expert placement if any, each op's pages and ids, each admission's slot, prompt,
    sampling and rule leaves, each call's rows and grammar masks, and when there are calls the page
    table, as its rows that differ from `base_table` (the receiver's table as of the last step with
    calls: `table_delta`)."""
    head = [len(work.page_ops), len(work.admissions), len(work.calls), work.placement is not None]
    head += [PAGE_OP_KINDS.index(op.kind) for op in work.page_ops]
    arrays = [np.array(head, np.int32)]
    if work.placement is not None:
        arrays.append(work.placement)
    for op in work.page_ops:
        arrays += [op.pages, op.ids]
    for admission in work.admissions:
        arrays += [np.array([admission.slot], np.int32), admission.prompt, *jax.tree.leaves(admission.sampling),
                   *jax.tree.leaves(admission.rules)]
    for rows, masks in zip(work.calls, work.masks or (None,) * len(work.calls)):
        arrays += [*jax.tree.leaves(rows), np.array([masks is not None], np.int32)]
        arrays += [] if masks is None else [masks]
    if work.calls:
        arrays += table_delta(base_table, np.asarray(work.page_table, np.int32))
    return [np.asarray(a) for a in arrays]


def work_from_arrays(arrays: Sequence[np.ndarray], base_table: np.ndarray | None = None) -> StepWork:
    """The inverse of `work_arrays` (with the same `base_table`)."""
    it: Iterator[np.ndarray] = iter(arrays)
    head = next(it).tolist()
    n_ops, n_admissions, n_calls, placed, kinds = head[0], head[1], head[2], head[3], head[4:]
    placement = next(it) if placed else None
    sampling, rows, rules = _treedef(SamplingArrays), _treedef(StepRows), _treedef(TokenRuleRows)
    ops = tuple(PageOp(PAGE_OP_KINDS[kind], next(it), next(it)) for kind in kinds[:n_ops])

    def admission() -> Admission:
        slot, prompt = int(next(it)[0]), next(it)
        settings = jax.tree.unflatten(sampling, [next(it) for _ in range(sampling.num_leaves)])
        return Admission(slot, settings, prompt, jax.tree.unflatten(rules, [next(it) for _ in range(rules.num_leaves)]))

    admissions = tuple(admission() for _ in range(n_admissions))
    calls, masks = [], []
    for _ in range(n_calls):
        calls.append(jax.tree.unflatten(rows, [next(it) for _ in range(rows.num_leaves)]))
        masks.append(next(it) if next(it)[0] else None)
    table = table_from_delta(base_table, next(it), next(it), next(it)) if calls else None
    return StepWork(ops, admissions, tuple(calls), table, tuple(masks), placement)


def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Arrays as one uint8 buffer: `[header length] [header: count, (dtype, rank, *shape) each] [data]`."""
    head = [len(arrays)]
    for a in arrays:
        head += [_DTYPES.index(a.dtype.name), a.ndim, *a.shape]
    parts = [np.array([len(head)], np.int32), np.array(head, np.int32), *arrays]
    return np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts])


def unpack(data: np.ndarray) -> list[np.ndarray]:
    """The inverse of `pack`."""
    n_head = int(data[:4].view(np.int32)[0])
    head = iter(data[4:4 + 4 * n_head].view(np.int32).tolist())
    pos, out = 4 + 4 * n_head, []
    for _ in range(next(head)):
        dtype = np.dtype(_DTYPES[next(head)])
        shape = tuple(next(head) for _ in range(next(head)))
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out.append(data[pos:pos + size].view(dtype).reshape(shape).copy())
        pos += size
    return out


def encode_work(work: StepWork, base_table: np.ndarray | None = None) -> np.ndarray:
    """`work` as one uint8 buffer, its page table relative to `base_table` (see `work_arrays`)."""
    return pack(work_arrays(work, base_table))


def decode_work(data: np.ndarray, base_table: np.ndarray | None = None) -> StepWork:
    """The inverse of `encode_work` (with the same `base_table`)."""
    return work_from_arrays(unpack(data), base_table)


def payload_bucket(size: int) -> int:
    """The padded payload size: a power of two, at least `MIN_PAYLOAD` bytes."""
    return max(MIN_PAYLOAD, 1 << (size - 1).bit_length())


class StepChannel:
    """Process 0 sends each step's `StepWork` (or a stop) to every other process by device broadcasts
    (`Engine(control="device")`; the default is `control.HostChannel`, over sockets). Every process
    must make the matching call: `send` on process 0, `receive` on the others."""

    def __init__(self) -> None:
        self._table: np.ndarray | None = None  # the page table as of the last step with calls

    def send(self, work: StepWork | None) -> None:
        """(Process 0) Broadcast `work`, or None to end the followers' loop."""
        payload = np.zeros(0, np.uint8) if work is None else encode_work(work, self._table)
        multihost_utils.broadcast_one_to_all(np.array([work is None, payload.size], np.int32))
        if work is not None:
            padded = np.zeros(payload_bucket(payload.size), np.uint8)
            padded[:payload.size] = payload
            multihost_utils.broadcast_one_to_all(padded)
            if work.calls:
                self._table = work.page_table

    def receive(self) -> StepWork | None:
        """(Other processes) The next step's work, or None when process 0 stopped."""
        stop, size = (int(v) for v in multihost_utils.broadcast_one_to_all(np.zeros(2, np.int32)))
        if stop:
            return None
        data = multihost_utils.broadcast_one_to_all(np.zeros(payload_bucket(size), np.uint8))
        work = decode_work(np.asarray(data)[:size], self._table)
        if work.calls:
            self._table = work.page_table
        return work

    def close(self) -> None:
        pass
