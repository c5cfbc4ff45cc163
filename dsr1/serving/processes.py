"""The engine's JAX processes: process 0 leads (it decides each step and sends the step's work), the
others follow (they receive and dispatch it), over the host (`control.HostChannel`) or the devices
(`broadcast.StepChannel`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .broadcast import StepChannel
from .control import HostChannel
from .work import StepWork

__all__ = ["CONTROLS", "Processes"]

CONTROLS = ("host", "device")  # how process 0's step work reaches the other processes


class Processes:
    """This process's part in an engine over every JAX process: `is_leader` (process 0) decides and
    `send`s each step's work; the others `follow` it until the leader `close`s. One process: nothing
    to send, and `close` only ends the engine."""

    def __init__(self, control: str = "host"):
        if control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
        self.is_leader = jax.process_index() == 0
        self.closed = False
        self._channel = None
        if jax.process_count() > 1:
            self._channel = (HostChannel(jax.process_index(), jax.process_count()) if control == "host"
                             else StepChannel())

    def require_leader(self, action: str) -> None:
        """Raise unless this is process 0 and the followers still follow."""
        if not self.is_leader:
            raise RuntimeError(f"{action}() runs on process 0 only; process {jax.process_index()} calls follow()")
        if self.closed and self._channel is not None:
            raise RuntimeError(f"{action}() after close(): the other processes no longer follow")

    def send(self, work: StepWork) -> None:
        """(Process 0) The step's work to the followers, before this process dispatches it."""
        if self._channel is not None:
            self._channel.send(work)

    def follow(self, run: Callable[[StepWork], Any]) -> None:
        """(Processes other than 0) `run` each step's work process 0 sends, until it closes."""
        if self.is_leader:
            raise RuntimeError("process 0 decides the steps: call step() or run(), not follow()")
        while (work := self._channel.receive()) is not None:
            run(work)
        self._channel.close()

    def close(self) -> None:
        """(Process 0) Release the followers; no step can be sent afterwards."""
        if self._channel is not None and not self.closed:
            self._channel.send(None)
            self._channel.close()
        self.closed = True
