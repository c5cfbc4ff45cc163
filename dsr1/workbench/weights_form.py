"""The form a checkpoint's weights are loaded in on the cluster's devices: full precision where it
fits, else int8 weights, else int8 weights and an int8 cache, as the capacity plan
(:mod:`dsr1.bench.plan`) counts them: each device's shard of every weight for the mesh, one row of
cache, and the plan's safety margin held back. Nothing is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
import os

from jax.sharding import AbstractMesh, Mesh

from ..bench.plan import GIB, SAFETY_MARGIN, cache_bytes_per_token, device_bytes
from ..core.config import Config
from ..core.params import abstract_params, param_specs
from ..core.sharding import DEFAULT_RULES
from .process import ClusterError

AUTO = "auto"
FORMS = ((None, None), ("int8", None), ("int8", "int8"))  # (quant, kv_cache_dtype), smallest change first
CACHE_CONTEXT = 4096  # positions of one row's cache the choice keeps room for


@dataclasses.dataclass(frozen=True)
class WeightsForm:
    """How to load: ``quant`` and ``kv_cache_dtype`` for :func:`dsr1.load`, and why."""

    quant: str | None
    kv_cache_dtype: str | None
    reason: str

    def describe(self) -> str:
        weights = "int8 weights" if self.quant else "full-precision weights"
        return f"{weights}, {'int8' if self.kv_cache_dtype else 'full-precision'} KV cache: {self.reason}"


def needed_bytes(cfg: Config, mesh: Mesh | AbstractMesh, quant: str | None, kv_cache_dtype: str | None, *,
                 dtype: str = "bfloat16", mtp: bool = False, context: int = CACHE_CONTEXT) -> int:
    """Bytes one device holds of the weights in this form (its shard of each, as the plan counts
    them) plus one row of ``context`` cached positions."""
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    specs = param_specs(cfg, quant, mtp=mtp and bool(cfg.num_nextn_predict_layers))
    weights = abstract_params(specs, abstract, DEFAULT_RULES, dtype)
    return device_bytes(weights) + context * cache_bytes_per_token(cfg, dtype, kv_cache_dtype)


def choose_form(cfg: Config, mesh: Mesh | AbstractMesh, device_memory: int | None, *, dtype: str = "bfloat16",
                mtp: bool = False) -> WeightsForm:
    """The first of :data:`FORMS` whose :func:`needed_bytes` fit ``device_memory`` bytes per device
    less the plan's safety margin. ``device_memory`` None (CPU devices, which report none): full
    precision. Raises a ClusterError when not even int8 weights and cache fit."""
    if device_memory is None:
        return WeightsForm(None, None, "the devices report no memory limit")
    budget = device_memory * (1 - SAFETY_MARGIN)
    needs = []
    for quant, kv in FORMS:
        need = needed_bytes(cfg, mesh, quant, kv, dtype=dtype, mtp=mtp)
        if need <= budget:
            return WeightsForm(quant, kv, f"{need / GIB:.1f} GiB per device of the {budget / GIB:.1f} GiB budget "
                                          f"({device_memory / GIB:.1f} GiB, {SAFETY_MARGIN:.0%} held back)")
        needs.append(f"{quant or dtype} weights + {kv or dtype} cache {need / GIB:.1f} GiB")
    raise ClusterError(f"the model does not fit {dict(mesh.shape)} devices of {device_memory / GIB:.1f} GiB "
                       f"(budget {budget / GIB:.1f} GiB each): {'; '.join(needs)}. Use more devices.")


def device_memory(mesh: Mesh) -> int | None:
    """The memory one device of ``mesh`` may use (``bytes_limit`` of this process's first device in
    it), or None where the platform reports none (CPU)."""
    import jax

    local = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)
    stats = local.memory_stats() if local is not None else None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def weights_form(checkpoint: str | os.PathLike, mesh: Mesh, quant: str | None = AUTO,
                 kv_cache_dtype: str | None = AUTO, *, mtp: bool = False) -> WeightsForm:
    """The form to load ``checkpoint`` (a folder with a config.json) in on ``mesh``: ``quant`` and
    ``kv_cache_dtype`` as given, or, where either is ``"auto"``, :func:`choose_form` for its config
    and the mesh's devices."""
    if quant != AUTO and kv_cache_dtype != AUTO:
        return WeightsForm(quant, kv_cache_dtype, "as asked")
    chosen = choose_form(Config.from_hf(checkpoint), mesh, device_memory(mesh), mtp=mtp)
    if quant == AUTO and kv_cache_dtype == AUTO:
        return chosen
    return WeightsForm(chosen.quant if quant == AUTO else quant,
                       chosen.kv_cache_dtype if kv_cache_dtype == AUTO else kv_cache_dtype,
                       f"{'quant' if quant != AUTO else 'kv_cache_dtype'} as asked, the other from the plan: "
                       f"{chosen.reason}")
