"""C++ built on first use into a shared library, cached under `$DSR1_KERNEL_CACHE` (default
`~/.cache/dsr1/kernels`) by its sources, the compiler, the flags, jaxlib and the CPU.

Processes that start together on a host (a local cluster's, a pytest and its subprocesses) build a
library once: the first holds the cache folder's lock while it compiles, the others wait for it.
Without a compiler, or off x86-64, there is no library (the callers compute with numpy or XLA).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax


def build(stem: str, sources: dict[str, bytes], flags: list[str], unsupported: str | None = None) -> Path | None:
    """The library `stem-<key>.so` compiled from `sources` (file name: text) with `flags`, built into
    the cache if not there yet, under the cache's lock (`_cache_lock`), in a temporary folder renamed
    into place. None: no compiler, not an x86-64 CPU, or a compiler error containing `unsupported` (the
    sources' own `#error` for a CPU they do not support); any other compiler error raises OSError."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join(s if isinstance(s, bytes) else s.encode() for s in (
        *sources.values(), version, " ".join(flags), jax.__version__, _cpu_flags()))).hexdigest()[:16]
    cache = Path(os.environ.get("DSR1_KERNEL_CACHE", Path.home() / ".cache" / "dsr1" / "kernels"))
    library = cache / f"{stem}-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with _cache_lock(cache):
        if library.exists():  # built by another process while this one waited for the lock
            return library
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            for name, text in sources.items():
                (Path(tmp) / name).write_bytes(text)
            built = Path(tmp) / library.name
            result = subprocess.run([compiler, *flags, *sources, "-o", str(built)], capture_output=True, text=True,
                                    cwd=tmp)
            if result.returncode != 0:
                if unsupported is not None and unsupported in result.stderr:
                    return None
                raise OSError(f"{compiler} failed on {', '.join(sources)}: {result.stderr[-2000:]}")
            os.replace(built, library)
    return library


@contextlib.contextmanager
def _cache_lock(cache: Path):
    """Hold the cache folder's lock: processes that start together on one host build once, the others
    waiting for the first's library instead of each compiling it. Where the lock cannot be taken (no
    `flock`, or a file system that refuses it) each builds its own, as they would without it; the
    rename keeps that safe."""
    fd = _locked(cache)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # which releases the lock


def _locked(folder: Path) -> int | None:
    """An open descriptor of `folder` holding its exclusive `flock` (None where that cannot be had)."""
    try:
        import fcntl  # POSIX only
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared by different machines keeps one build each."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
