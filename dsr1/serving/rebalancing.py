"""Redundant experts placed again while serving: the engine's steps count the (token, expert) pairs
each MoE layer routes, and every `every` steps (or when asked) the copies go to the hottest experts
(`dsr1.core.eplb.balance`) and their weights move there (`DeviceRunner.run` of a placement)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core import eplb
from ..core.eplb import ExpertPlacement, placement_of

__all__ = ["Rebalancing", "check_rebalance"]


@dataclasses.dataclass
class Rebalancing:
    """When the engine places its redundant experts again, and the counts since the last placement."""

    every: int = 0  # steps between placements (0: only when asked)
    placed_at: int = 0  # the step of the last placement
    counted: np.ndarray | int = 0  # the pairs counted by then, `[L_moe, E]`

    def due(self, steps: int) -> bool:
        """Whether `steps` steps in, a placement is due."""
        return bool(self.every) and steps - self.placed_at >= self.every

    def since(self, total: np.ndarray | None) -> np.ndarray | None:
        """The pairs counted since the last placement, of all counted so far (`total`)."""
        return None if total is None else total - self.counted

    def placement(self, params: dict, total: np.ndarray) -> ExpertPlacement:
        """The new placement of the experts `params` hold copies of, from the pairs since the last one."""
        current = placement_of(params)
        if current is None:
            raise ValueError("rebalance() needs a model with redundant experts (Model.with_expert_placement)")
        redundant = current.physical.shape[1] - current.num_experts
        return eplb.balance(self.since(total), current.devices, redundant)

    def placed(self, steps: int, total: np.ndarray) -> None:
        """A placement was made `steps` steps in, with `total` pairs counted by then."""
        self.placed_at, self.counted = steps, total


def check_rebalance(params: dict, every: int, disaggregate: tuple[int, int] | None) -> None:
    """`rebalance_every` is an integer >= 0, > 0 only for a model with redundant experts; those do not run
    disaggregated (each side would need its own placement over its own devices)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"rebalance_every must be an integer >= 0 (0 = only when asked), got {every!r}")
    placed = placement_of(params) is not None
    if every and not placed:
        raise ValueError("rebalance_every > 0 needs a model with redundant experts: "
                         "model.with_expert_placement(dsr1.core.eplb.balance(load, devices, redundant))")
    if placed and disaggregate is not None:
        raise ValueError("a model with redundant experts does not run disaggregated: use one without "
                         "(dsr1.init_random / dsr1.load) with disaggregate")
