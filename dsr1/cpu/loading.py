"""How the CPU backend's weights are built while they load (a `dsr1.weights.loading.HostLayout`).

The loader fills a layer stack on the host layer by layer; for this backend it fills huge pages, and
writes the transposed copies that `layouts` holds as each layer is read, while the disk reads the
next (made after the load, by `view`, they would wait on an idle disk).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..host import huge_pages
from . import enabled
from .layouts import as_bits, holds_transposed_bits


class CpuHostLayout:
    """Weights loaded for the backend: in huge pages, the matrices of `x @ W` products and the output
    heads with their bits transposed (`layouts.holds_transposed_bits`), as `view` would hold them."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return huge_pages.empty(shape, dtype)

    def keeps_transposed(self, name: str | None, spec: Any, dtype: Any) -> bool:
        return holds_transposed_bits(name, spec, dtype)

    def with_transposed(self, w: jax.Array, copy: np.ndarray) -> Any:
        device = next(iter(w.sharding.device_set))
        return as_bits(w, keep_transposed=True, transposed=jax.device_put(copy.view(np.uint16), device))


def host_layout(mesh: Mesh) -> CpuHostLayout | None:
    """How loading builds weights on the host for programs on `mesh`: the backend's way where
    `enabled(mesh)`, else None (the loader's default: plain arrays)."""
    return CpuHostLayout() if enabled(mesh) else None
