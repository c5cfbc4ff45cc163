"""TPU chips and slices: memory, bandwidth and topology, in one place (what `plan --compiler tpu`
compiles for and measures against)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip as JAX sees it (one device per chip: v5p's two TensorCores run as one, megacore)."""

    name: str
    hbm_gib: float  # HBM per chip
    hbm_bytes_per_s: float  # HBM bandwidth per chip


# Google Cloud's published figures per chip.
CHIPS = {c.name: c for c in (
    Chip("v5e", 16, 819e9),
    Chip("v5p", 95, 2765e9),
    Chip("v6e", 32, 1640e9),
)}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: its chip, `jax.experimental.topologies` topology name and chips per host."""

    name: str
    chip: Chip
    topology: str
    chips_per_host: tuple[int, int, int]

    @property
    def devices(self) -> int:
        n = 1
        for d in self.topology.split(":")[1].split("x"):
            n *= int(d)
        return n


# A slice's name counts TensorCores for v5p (v5p-64: 32 chips), chips for v5e and v6e.
SLICES = {s.name: s for s in (
    Slice("v5e-4", CHIPS["v5e"], "v5e:2x2", (2, 2, 1)),
    Slice("v5e-8", CHIPS["v5e"], "v5e:2x4", (2, 4, 1)),
    Slice("v5e-64", CHIPS["v5e"], "v5e:8x8", (2, 2, 1)),
    Slice("v5p-8", CHIPS["v5p"], "v5p:2x2x1", (2, 2, 1)),
    Slice("v5p-64", CHIPS["v5p"], "v5p:2x4x4", (2, 2, 1)),
    Slice("v6e-8", CHIPS["v6e"], "v6e:2x4", (2, 4, 1)),
    Slice("v6e-64", CHIPS["v6e"], "v6e:8x8", (2, 2, 1)),
)}
