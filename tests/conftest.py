"""Shared fixtures: tiny release-layout checkpoints with their HF float32 reference logits."""

from __future__ import annotations

import pytest

from .harness import Fixture, build_fixture
from .reference import CONFIGS


@pytest.fixture(scope="session")
def all_fixtures(tmp_path_factory) -> dict[str, Fixture]:
    """Every reference variant, built once per session; the R1-like one carries an MTP layer."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_fixture(root, name, mtp=name == "grouped_qlora") for name in sorted(CONFIGS)}


@pytest.fixture(params=sorted(CONFIGS))
def fixture(request, all_fixtures) -> Fixture:
    return all_fixtures[request.param]


@pytest.fixture
def grouped(all_fixtures) -> Fixture:
    """The R1-like variant: group-limited routing, q_lora, odd head dims, MTP layer in the folder."""
    return all_fixtures["grouped_qlora"]


@pytest.fixture(params=[True, False], ids=["kernel", "xla"])
def cpu_kernel(request, monkeypatch) -> bool:
    """Run a test with dsr1's CPU decode kernel (skipped where it is not built) and without it
    (`DSR1_CPU_KERNELS=0`: XLA's own products)."""
    from dsr1.cpu import ffi as cpu_kernels

    if request.param and not cpu_kernels.available():
        pytest.skip("dsr1's CPU kernel is not built on this machine (no C++ compiler, or no AVX2)")
    monkeypatch.setenv("DSR1_CPU_KERNELS", "1" if request.param else "0")
    return request.param
