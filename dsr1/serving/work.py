"""One engine step's device work as data, and the runner that dispatches it.

`StepWork` is everything a step asks of the device, as host arrays, in the order it runs: a new
expert placement when the engine rebalances redundant experts, the prefix cache's page copies
(`PageOp`s recorded by the `PageLog`), slot admissions (a request's slot, sampling row and prompt)
and the `serve_step` calls (their `StepRows` and the slots' page table). Process 0's scheduler
decides it; with several JAX processes it is broadcast (`dsr1.serving.broadcast`) and every process
hands the same `StepWork` to its `DeviceRunner`, so all of them dispatch the same programs with the
same inputs in the same order.

The runner owns what the programs carry from step to step on device: the page pool (`PagePool`,
with this process's host copies of offloaded pages), the per-slot `SlotState` (with the routing
statistics when the model holds redundant experts) and the model, whose expert placement a
rebalance replaces.

With MTP drafts (`draft_tokens=k`) the runner carries a `DraftSlotState` and the pool's MTP pages,
and runs the draft programs instead: a call of one-token rows is a decode call
(`draft_step.serve_draft_step`), any wider one a prefill call whose rows carry one lookahead token
(`draft_step.serve_draft_prefill`). The call's shape alone decides, so the broadcast `StepWork`
needs nothing more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from ..api import Model
from ..core.eplb import ExpertPlacement, placement_of
from ..core.params import without_mtp
from ..core.sharding import put_replicated, to_host
from ..generation.sampling import Sampling, host_sampling_arrays, host_token_rules
from ..programs import draft_step, step
from ..programs.eplb import moved_to
from ..programs.sampling import KEY_IMPL, SamplingArrays, TokenRuleRows
from ..programs.step import StepRows
from .page_pool import PageOp, PagePool

__all__ = ["Admission", "DeviceRunner", "StepWork", "device_sampling", "host_rules", "host_sampling"]

@dataclasses.dataclass(frozen=True)
class Admission:
    """A slot given to a new request: its sampling row (`host_sampling`, one row) and its prompt."""

    slot: int
    sampling: SamplingArrays
    prompt: np.ndarray  # int32 [n]
    rules: TokenRuleRows  # its token rules (`slot_rule_rows` of `host_token_rules`, one row)


@dataclasses.dataclass(frozen=True)
class StepWork:
    """One step's device work in dispatch order: page copies, admissions, then `serve_step` calls
    (host `StepRows`) against `page_table` `[slots, table_width]` (None when there are no calls)."""

    page_ops: tuple[PageOp, ...] = ()
    admissions: tuple[Admission, ...] = ()
    calls: tuple[StepRows, ...] = ()
    page_table: np.ndarray | None = None
    masks: tuple[np.ndarray | None, ...] = ()  # per call: its grammar bitmasks `[rows, words]`, or None
    placement: np.ndarray | None = None  # a new expert placement `[L_moe, P]` (`ExpertPlacement.physical`)

    @property
    def empty(self) -> bool:
        return not (self.page_ops or self.admissions or self.calls or self.placement is not None)


def host_sampling(settings: Sequence[Sampling]) -> SamplingArrays:
    """Sampling rows for the slot state as numpy arrays (keys as their uint32 key data, so they can
    be broadcast). Stops are checked on the host, so none go to the device (one fixed column: the
    arrays' shapes never change)."""
    return host_sampling_arrays([dataclasses.replace(s, stop_token_ids=()) for s in settings], stop_width=1)


def host_rules(settings: Sequence[Sampling]) -> TokenRuleRows:
    """Token rules for the slot state as numpy arrays (`host_token_rules`, bad words padded to the
    slot state's width; ValueError for more than it holds)."""
    return step.slot_rule_rows(host_token_rules(settings))


def device_sampling(host: SamplingArrays, mesh: jax.sharding.Mesh) -> SamplingArrays:
    """`host_sampling` rows replicated over the mesh, with typed keys again."""
    arrays = put_replicated(host, mesh)
    return dataclasses.replace(arrays, keys=jax.random.wrap_key_data(arrays.keys, impl=KEY_IMPL))


class DeviceRunner:
    """Dispatches `StepWork` on this process's devices; holds the page pool and the slot state."""

    def __init__(self, model: Model, pool: PagePool, *, slots: int, max_seq_len: int, decode_steps: int = 1,
                 draft_tokens: int = 0):
        self.model = model
        self.pool = pool
        self.max_seq_len = max_seq_len
        self.decode_steps = decode_steps
        self.draft_tokens = draft_tokens
        idle = device_sampling(host_sampling([Sampling(seed=0)] * slots), model.mesh)
        # Redundant experts: the steps count each expert's pairs, from which the engine rebalances.
        load = (model.cfg.num_moe_layers, model.cfg.n_routed_experts) if placement_of(model.params) else None
        if draft_tokens:
            self.state = draft_step.draft_slot_state(idle, mesh=model.mesh, vocab_size=model.cfg.vocab_size,
                                                   hidden_size=model.cfg.hidden_size, expert_load=load)
        else:
            self.state = step.slot_state(idle, mesh=model.mesh, vocab_size=model.cfg.vocab_size, expert_load=load)

    def run(self, work: StepWork) -> tuple[jax.Array, ...]:
        """Dispatch the step (returns at once); the sampled tokens `[rows]` of each call, on device."""
        if work.placement is not None:
            self.place_experts(work.placement)
        for op in work.page_ops:
            self.pool.apply(op)
        # One transfer for the step: each admission, the page table and each call's rows packed in
        # one int32 array apiece (every array put costs a fraction of a millisecond on the host).
        admissions = [step.pack_admission(a.slot, a.sampling, a.prompt, self.max_seq_len) for a in work.admissions]
        calls = [work.page_table, *(rows.pack() for rows in work.calls)] if work.calls else []
        rules = [a.rules for a in work.admissions]
        placed = put_replicated([*admissions, *calls, *rules], self.model.mesh) if admissions or calls else []
        self.admit_placed(placed[:len(admissions)], placed[len(admissions) + len(calls):])
        if not work.calls:
            return ()
        table, *rows = placed[len(admissions):len(admissions) + len(calls)]
        masks = work.masks or (None,) * len(work.calls)
        return tuple(self.serve(call, packed, table, m) for packed, call, m in zip(rows, work.calls, masks))

    def admit(self, admissions: Sequence[Admission]) -> None:
        """Give each admission its slot (one transfer for them all)."""
        if admissions:
            packed = [step.pack_admission(a.slot, a.sampling, a.prompt, self.max_seq_len) for a in admissions]
            placed = put_replicated([*packed, *(a.rules for a in admissions)], self.model.mesh)
            self.admit_placed(placed[:len(admissions)], placed[len(admissions):])

    def admit_placed(self, packed: Sequence[jax.Array], rules: Sequence[TokenRuleRows]) -> None:
        """`admit` of admissions already on the devices (`step.pack_admission`, token rule rows)."""
        admit = draft_step.admit_draft_slot if self.draft_tokens else step.admit_slot
        for one, rule_rows in zip(packed, rules):
            with jax.named_scope("admit"):  # a slot's sampling settings, prompt (for penalties) and token rules
                self.state = admit(self.state, one, rule_rows, mesh=self.model.mesh)

    def serve(self, call: StepRows, packed: jax.Array, table: jax.Array, mask: np.ndarray | None) -> jax.Array:
        """Dispatch one call (`packed`: `call.pack()` on the devices, `table`: the page table there)."""
        return self._serve(packed, table, self.call_steps(call), decode=call.tokens.shape[1] == 1,
                           masks=None if mask is None else put_replicated(mask, self.model.mesh),
                           prompt_logprobs=bool(np.any(call.prompt_logprobs)) and not self.draft_tokens)

    def warm_up(self) -> None:
        """Compile what the runner dispatches besides the step's calls and page operations: nothing."""

    def expert_load(self) -> np.ndarray | None:
        """The pairs the steps so far routed to each logical expert, `[L_moe, E]` on the host (waits for
        the steps dispatched); None unless the model holds an expert placement."""
        load = (self.state.slots if self.draft_tokens else self.state).expert_load
        return None if load is None else to_host(load)

    def place_experts(self, physical: np.ndarray) -> None:
        """Move the model's routed experts to the placement `physical [L_moe, P]` (same slots, same
        tokens: `dsr1.programs.eplb.moved_to`), in place: the routed-expert arrays of the model it was
        given are deleted (steps already dispatched finish with them first)."""
        placement = ExpertPlacement(np.asarray(physical, np.int32), placement_of(self.model.params).devices)
        self.model = dataclasses.replace(self.model, params=moved_to(self.model.params, placement, donate=True))

    def call_steps(self, rows: StepRows) -> int:
        """The call's decode steps: `decode_steps` for a multi-step call (some row runs more than one;
        every process derives the same from the same rows), else 1."""
        return self.decode_steps if int(np.max(rows.steps)) > 1 else 1

    def _serve(self, packed_rows: jax.Array, table: jax.Array, steps: int, decode: bool, masks: jax.Array | None,
               prompt_logprobs: bool) -> jax.Array:
        if self.draft_tokens:
            return self._serve_drafts(packed_rows, table, steps, decode, masks)
        with jax.named_scope("serve"):
            tokens, self.pool.cache, self.state = step.serve_step(
                without_mtp(self.model.params), self.pool.cache, self.state, packed_rows, table, masks, steps=steps,
                prompt_logprobs=prompt_logprobs, **self.model.program_kwargs)
        return tokens

    def _serve_drafts(self, packed_rows: jax.Array, table: jax.Array, steps: int, decode: bool,
                      masks: jax.Array | None) -> jax.Array:
        """A call with drafts on: `decode` (one-token rows) drafts, verifies and accepts; else a prefill."""
        pool, kwargs = self.pool, self.model.program_kwargs
        if decode:
            with jax.named_scope("serve_drafts"):
                tokens, pool.cache, pool.mtp_cache, self.state = draft_step.serve_draft_step(
                    self.model.params, pool.cache, pool.mtp_cache, self.state, packed_rows, table,
                    masks, draft_tokens=self.draft_tokens, steps=steps, **kwargs)
            return tokens
        with jax.named_scope("serve_prefill"):
            tokens, pool.cache, pool.mtp_cache, self.state = draft_step.serve_draft_prefill(
                self.model.params, pool.cache, pool.mtp_cache, self.state, packed_rows, table, **kwargs)
        return tokens
