"""The one place dsr1 reaches into JAX's private modules (``jax._src``); everything else calls these.

Why: the workbench must (1) refuse ``jax.distributed.initialize`` once JAX has started its devices
(it would then be silently ignored, or fail later), without starting them itself, and (2) recover
from a hung ``initialize`` without restarting the process: forget the client of a coordinator
that never answered and stop this process's coordinator service, so that ``initialize`` can run
again. JAX (0.7 to 0.10) has no public API for either: ``jax.distributed.shutdown()`` blocks in a
barrier with the other processes, and reading ``jax.devices()`` starts the backends.

tests/test_cluster.py checks that :data:`REQUIRED` still holds for the installed JAX, so an
upgrade that moves these names fails there, with a message naming this file, rather than in a
hung notebook.
"""

from __future__ import annotations

from jax._src import distributed as _distributed
from jax._src import xla_bridge as _xla_bridge

# What this module relies on, as (private module, attribute path). `global_state` is the
# `jax._src.distributed.State` behind jax.distributed.initialize / shutdown.
REQUIRED = (
    (_xla_bridge, "backends_are_initialized"),
    (_distributed, "global_state.client"),
    (_distributed, "global_state.service"),
    (_distributed, "global_state.preemption_sync_manager"),
)


def missing() -> list[str]:
    """The private JAX names this module needs that the installed JAX lacks ([] when all are there)."""
    return [f"{module.__name__}.{path}" for module, path in REQUIRED if not _has(module, path)]


def _has(obj: object, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def backends_are_initialized() -> bool:
    """Whether JAX has started its devices in this process (without starting them)."""
    return _xla_bridge.backends_are_initialized()


def has_distributed_state() -> bool:
    """Whether this process holds a ``jax.distributed`` client or coordinator service."""
    state = _distributed.global_state
    return state.client is not None or state.service is not None


def abandon_distributed_state(*, stop_service: bool) -> None:
    """Forget this process's ``jax.distributed`` client without the shutdown barrier (a thread
    stuck in ``initialize`` keeps its own reference), so that ``initialize`` can run again.

    ``stop_service``: also shut down the coordinator service (process 0) so its port is freed;
    without it the service is only forgotten (when its shutdown is already stuck elsewhere).
    """
    state = _distributed.global_state
    state.client = None
    state.preemption_sync_manager = None
    if stop_service and state.service is not None:
        state.service.shutdown()
    state.service = None
