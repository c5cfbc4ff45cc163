"""How fast weights moved: bytes over seconds, reported by `dsr1.load` and the converter."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Throughput:
    """`bytes` moved in `seconds` of wall time; `gbps` is decimal GB (1e9 bytes) per second."""

    bytes: int
    seconds: float
    # What a load read (`safetensors_io.ReadLog`: the tensor regions this process asked the disk for).
    reads: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        return f"{self.bytes / 1e9:.3f} GB in {self.seconds:.2f} s ({self.gbps:.2f} GB/s)"


def rate(nbytes: int, seconds: float) -> str:
    """A progress bar's postfix: "0.42 GB/s"."""
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


def path_bytes(paths: Iterable[Path]) -> int:
    """Bytes of every file among or under `paths` (what reading or writing them moves)."""
    return sum(os.path.getsize(p) if Path(p).is_file() else
               sum(os.path.getsize(Path(root) / f) for root, _, files in os.walk(p) for f in files) for p in paths)
