"""dsr1's CPU decode kernel (`dsr1.cpu.ffi`): its products against float64, its build and
cache, and the einsums that read weights laid out for it (`layouts.kernel_layout`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.core import attention, products
from dsr1.core import model as core
from dsr1.core.attention import DECODE_PRODUCTS
from dsr1.core.cache import PagedKVCache
from dsr1.cpu import ffi as cpu_kernels
from dsr1.cpu import layouts

from .harness import TINY

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="dsr1's CPU kernel is not built here (no C++ compiler, or no AVX2)")


def _weights(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if dtype == "int8":
        return rng.integers(-127, 128, shape, dtype=np.int8)
    return rng.standard_normal(shape, np.float32).astype(jnp.bfloat16).view(np.uint16)


def _values(w: np.ndarray) -> np.ndarray:
    """The float64 values of int8 values or bf16 bits."""
    return w.astype(np.float64) if w.dtype == np.int8 else w.view(jnp.bfloat16).astype(np.float64)


@needs_kernel
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17])
def test_rows_dot_equals_float64_for_every_block_size(dtype, rows):
    """Blocks of 1 to 8 rows and a remainder; an input size with a tail past the 16-lane vectors
    (72 = 4 x 16 + 8); the matrix picked by its index in a `[2, 3, out, in]` stack, in place."""
    rng = np.random.default_rng(rows)
    w = _weights(dtype, (2, 3, 37, 72), rng)
    x = rng.standard_normal((rows, 72)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_kernels.rows_dot)(jnp.asarray(x), jnp.asarray(w), 4))
    want = x.astype(np.float64) @ _values(w.reshape(6, 37, 72)[4]).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
def test_rows_dot_splits_a_large_matrix_over_threads_and_clamps_the_index():
    """A matrix large enough to be split into parts (threads) gives the same product; an index past
    the stack reads its last matrix (as XLA clamps a dynamic slice)."""
    rng = np.random.default_rng(0)
    w = _weights("bf16", (2, 1000, 256), rng)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_kernels.rows_dot)(jnp.asarray(x), jnp.asarray(w), 7))
    want = x.astype(np.float64) @ _values(w[1]).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
def test_rows_dot_groups_multiply_each_by_its_own_rows():
    """`x [g, rows, in]` against `w [..., g, out, in]`: one product per group (attention heads)."""
    rng = np.random.default_rng(1)
    w = _weights("int8", (2, 4, 24, 40), rng)
    x = rng.standard_normal((4, 3, 40)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_kernels.rows_dot)(jnp.asarray(x), jnp.asarray(w), 1))
    want = np.einsum("gri,goi->gro", x.astype(np.float64), _values(w[1]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_rows_dot_with_an_index_per_group_reads_each_groups_own_matrix(dtype):
    """`index [g]`: group g against matrix `index[g]` of a `[2, 3, out, in]` stack, in place (an expert
    loop's blocks); a negative index gives zeros, one past the stack reads its last matrix; groups large
    enough to be split over threads too."""
    rng = np.random.default_rng(3)
    for out, inputs in ((37, 72), (300, 256)):
        w = _weights(dtype, (2, 3, out, inputs), rng)
        x = rng.standard_normal((5, 2, inputs)).astype(np.float32)
        index = np.array([4, -1, 0, 4, 9], np.int32)
        got = np.asarray(jax.jit(cpu_kernels.rows_dot)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(index)))
        matrices = _values(w.reshape(6, out, inputs))
        want = np.einsum("gri,goi->gro", x.astype(np.float64), matrices[np.clip(index, 0, 5)])
        want[index < 0] = 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _past_used_zeroed(want: np.ndarray, used: np.ndarray) -> np.ndarray:
    """`want [g, rows, out]` with each group's rows from `used[g]` on zeroed (counts clamped to the rows)."""
    return np.where(np.arange(want.shape[1])[None, :, None] < np.asarray(used)[:, None, None], want, 0)


@needs_kernel
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_rows_dot_computes_only_the_used_rows_of_each_group(dtype):
    """`used [g]`: group g's first `used[g]` rows against its matrix, the rest of its output zeros (a
    prefill's expert blocks padded to a whole block): none, part of an 8-row block, past the rows
    (clamped), with a negative index, and split over threads."""
    rng = np.random.default_rng(4)
    for out, inputs in ((37, 72), (300, 256)):
        w = _weights(dtype, (2, 3, out, inputs), rng)
        x = rng.standard_normal((5, 11, inputs)).astype(np.float32)
        index, used = np.array([4, -1, 0, 4, 9], np.int32), np.array([0, 5, 3, 11, 30], np.int32)
        got = np.asarray(jax.jit(cpu_kernels.rows_dot)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(index),
                                                       jnp.asarray(used)))
        want = np.einsum("gri,goi->gro", x.astype(np.float64), _values(w.reshape(6, out, inputs))[np.clip(index, 0, 5)])
        want[index < 0] = 0
        want = _past_used_zeroed(want, used)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
def test_swiglu_and_combine_rows_dot_equal_float64():
    """An expert loop's blocks in two calls: SiLU(x . gate) * (x . up) for each group's own expert, then
    down, each row times its weight summed into its token; a negative index gives a group zeros and
    skips it, a token outside [0, tokens) skips a row; outputs large enough to split over threads."""
    rng = np.random.default_rng(5)
    groups, rows, inputs, hidden, tokens = 5, 2, 72, 300, 4
    gate, up = _weights("bf16", (2, 3, hidden, inputs), rng), _weights("bf16", (2, 3, hidden, inputs), rng)
    down = _weights("bf16", (2, 3, inputs, hidden), rng)
    x = rng.standard_normal((groups, rows, inputs)).astype(np.float32)
    index = np.array([4, -1, 0, 9, 4], np.int32)
    token = np.array([[0, 3], [1, 2], [2, -1], [3, 0], [4, 1]], np.int32)
    weight = rng.uniform(0.1, 1, (groups, rows)).astype(np.float32)
    h = np.asarray(jax.jit(cpu_kernels.swiglu_rows_dot)(*map(jnp.asarray, (x, gate, up, index))))
    pick = np.clip(index, 0, 5)
    g = np.einsum("gri,goi->gro", x.astype(np.float64), _values(gate.reshape(6, hidden, inputs))[pick])
    u = np.einsum("gri,goi->gro", x.astype(np.float64), _values(up.reshape(6, hidden, inputs))[pick])
    want_h = g / (1 + np.exp(-g)) * u
    want_h[index < 0] = 0
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    used = np.array([1, 2, 2, 0, 5], np.int32)  # part of a block, all of it, skipped, none, clamped
    got_h = np.asarray(jax.jit(cpu_kernels.swiglu_rows_dot)(*map(jnp.asarray, (x, gate, up, index, used))))
    np.testing.assert_allclose(got_h, _past_used_zeroed(want_h, used), rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    combine = jax.jit(cpu_kernels.combine_rows_dot, static_argnums=5)
    got = np.asarray(combine(*map(jnp.asarray, (h, down, index, token, weight)), tokens))
    y = np.einsum("gri,goi->gro", h.astype(np.float64), _values(down.reshape(6, inputs, hidden))[pick])
    want = np.zeros((tokens, inputs))
    for gi, r in np.ndindex(groups, rows):
        if index[gi] >= 0 and 0 <= token[gi, r] < tokens:
            want[token[gi, r]] += weight[gi, r] * y[gi, r]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"token \(5, 3\)"):
        cpu_kernels.combine_rows_dot(jnp.asarray(h), jnp.asarray(down), index, np.zeros((5, 3)), weight, tokens)
    with pytest.raises(ValueError, match=r"up \(2, 3, 300, 64\)"):
        cpu_kernels.swiglu_rows_dot(jnp.asarray(x), jnp.asarray(gate), jnp.zeros((2, 3, 300, 64), jnp.uint16), index)


@needs_kernel
def test_swiglu_and_combine_pairs_equal_float64():
    """A decode step's token-expert pairs as routed (`matrix [tokens, k]`, negative: another device's
    expert), grouped by the kernel: experts hit by one token and by many (more than a block of 8 rows),
    outputs large enough to split over threads; skipped pairs give zeros and add nothing."""
    rng = np.random.default_rng(6)
    tokens, k, inputs, hidden = 11, 3, 72, 300
    gate, up = _weights("bf16", (2, 3, hidden, inputs), rng), _weights("bf16", (2, 3, hidden, inputs), rng)
    down = _weights("bf16", (2, 3, inputs, hidden), rng)
    x = rng.standard_normal((tokens, inputs)).astype(np.float32)
    matrix = rng.integers(-1, 6, (tokens, k)).astype(np.int32)
    matrix[:, 0] = 4  # one expert for every token: two passes of 8 rows
    weight = rng.uniform(0.1, 1, (tokens, k)).astype(np.float32)
    h = np.asarray(jax.jit(cpu_kernels.swiglu_pairs)(*map(jnp.asarray, (x, matrix, gate, up))))
    pick = np.clip(matrix, 0, 5)
    g = np.einsum("ti,tjoi->tjo", x.astype(np.float64), _values(gate.reshape(6, hidden, inputs))[pick])
    u = np.einsum("ti,tjoi->tjo", x.astype(np.float64), _values(up.reshape(6, hidden, inputs))[pick])
    want_h = np.where((matrix >= 0)[..., None], g / (1 + np.exp(-g)) * u, 0)
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    got = np.asarray(jax.jit(cpu_kernels.combine_pairs)(*map(jnp.asarray, (h, matrix, weight, down))))
    y = np.einsum("tji,tjoi->tjo", h.astype(np.float64), _values(down.reshape(6, inputs, hidden))[pick])
    want = (np.where(matrix >= 0, weight, 0)[..., None] * y).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"matrix \(11, 2\)"):
        cpu_kernels.combine_pairs(jnp.asarray(h), matrix[:, :2], weight, jnp.asarray(down))
    with pytest.raises(ValueError, match=r"up \(2, 3, 300, 64\)"):
        cpu_kernels.swiglu_pairs(jnp.asarray(x), matrix, jnp.asarray(gate), jnp.zeros((2, 3, 300, 64), jnp.uint16))


def _bf16_rows_built() -> bool:
    return cpu_kernels.available() and cpu_kernels._bf16_dot_rate() > 0


needs_bf16_rows = pytest.mark.skipif(not _bf16_rows_built(), reason="no AVX-512 BF16 on this CPU (or no kernel build)")


@needs_bf16_rows
@pytest.mark.parametrize("bf16", [False, True])
def test_combine_rows_dot_sums_only_the_used_rows(bf16, monkeypatch):
    """A prefill's blocks (20 rows, the first `used[g]` of each its expert's): bf16 rows with
    `vdpbf16ps` or float32 rows, only the used rows multiplied and summed into their tokens."""
    monkeypatch.setenv("DSR1_BF16_ROWS", "1")
    jax.clear_caches()
    rng = np.random.default_rng(6)
    groups, rows, inputs, hidden, tokens = 4, 20, 72, 300, 7
    down = _weights("bf16", (2, 3, inputs, hidden), rng)
    h = jnp.asarray(rng.standard_normal((groups, rows, hidden)), jnp.bfloat16 if bf16 else jnp.float32)
    index, used = np.array([4, 0, -1, 2], np.int32), np.array([20, 3, 20, 0], np.int32)
    token = rng.integers(0, tokens, (groups, rows)).astype(np.int32)
    weight = rng.uniform(0.1, 1, (groups, rows)).astype(np.float32)
    combine = jax.jit(cpu_kernels.combine_rows_dot, static_argnums=5)
    args = (h, jnp.asarray(down), jnp.asarray(index), jnp.asarray(token), jnp.asarray(weight))
    assert ("dsr1_bf16_combine_rows_dot" in combine.lower(*args, tokens, jnp.asarray(used)).as_text()) == bf16
    got = np.asarray(combine(*args, tokens, jnp.asarray(used)))
    y = np.einsum("gri,goi->gro", np.asarray(h.astype(jnp.float32), np.float64),
                  _values(down.reshape(6, inputs, hidden))[np.clip(index, 0, 5)])
    want = np.zeros((tokens, inputs))
    for gi, r in np.ndindex(groups, rows):
        if index[gi] >= 0 and r < used[gi]:
            want[token[gi, r]] += weight[gi, r] * y[gi, r]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_bf16_rows
@pytest.mark.parametrize("rows", [4, 5, 8, 9, 17])
@pytest.mark.parametrize("inputs", [64, 72, 100])
def test_bf16_rows_equal_float64(rows, inputs, monkeypatch):
    """bf16 rows against bf16 bits with `vdpbf16ps` (`DSR1_BF16_ROWS=1`: on wherever it is built):
    blocks of 4-8 rows and a remainder, inputs a multiple of 32 or not (72, 100: the masked tail),
    one matrix of a stack or each group's own (a negative index: zeros; past the stack: the last),
    against float64 of the same bf16 values; the compiled program calls the bf16-rows handler."""
    monkeypatch.setenv("DSR1_BF16_ROWS", "1")
    jax.clear_caches()
    rng = np.random.default_rng(rows * inputs)
    w = _weights("bf16", (2, 3, 37, inputs), rng)
    matrices = _values(w.reshape(6, 37, inputs))
    x = jnp.asarray(rng.standard_normal((rows, inputs)), jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    program = jax.jit(cpu_kernels.rows_dot)
    assert "dsr1_bf16_rows_dot_bf16" in program.lower(x, jnp.asarray(w), 4).as_text()
    want = x64 @ matrices[4].T
    np.testing.assert_allclose(program(x, jnp.asarray(w), 4), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    xg = jnp.asarray(rng.standard_normal((4, rows, inputs)), jnp.bfloat16)
    index = np.array([4, -1, 0, 9], np.int32)
    want = np.einsum("gri,goi->gro", np.asarray(xg.astype(jnp.float32), np.float64), matrices[np.clip(index, 0, 5)])
    want[index < 0] = 0
    got = program(xg, jnp.asarray(w), jnp.asarray(index))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    used = np.array([rows - 1, rows, 2, 0], np.int32)
    got = program(xg, jnp.asarray(w), jnp.asarray(index), jnp.asarray(used))
    np.testing.assert_allclose(got, _past_used_zeroed(want, used), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
def test_bf16_rows_only_for_bf16_rows_of_a_bf16_weight_where_switched_on(monkeypatch):
    """float32 rows, fewer than `BF16_ROWS_MIN` rows, int8 weights, or `DSR1_BF16_ROWS=0`: the float32
    handlers; the choice follows the CPU's measured `vdpbf16ps` rate (0 where not built)."""
    def handler(x, w, env):
        monkeypatch.setenv("DSR1_BF16_ROWS", env)
        jax.clear_caches()
        text = jax.jit(cpu_kernels.rows_dot).lower(x, w).as_text()
        return "dsr1_bf16_rows_dot" in text

    bits, int8 = jnp.zeros((16, 64), jnp.uint16), jnp.zeros((16, 64), jnp.int8)
    x = jnp.zeros((8, 64), jnp.bfloat16)
    few = jnp.zeros((cpu_kernels.BF16_ROWS_MIN - 1, 64), jnp.bfloat16)
    assert not handler(x.astype(jnp.float32), bits, "1")
    assert not handler(few, bits, "1")
    assert not handler(x, int8, "1")
    assert not handler(x, bits, "0")
    rate = cpu_kernels._bf16_dot_rate()
    assert handler(x, bits, "1") == (rate > 0)
    assert handler(x, bits, "") == (rate >= cpu_kernels.BF16_DOT_RATE)


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason="no AMX on this CPU (or no kernel build)")
@pytest.mark.parametrize("rows", [16, 24, 32, 40, 64])
@pytest.mark.parametrize("groups", [2, 5])
def test_amx_rows_dot_equals_float64_of_the_rows_rounded_to_bf16(rows, groups):
    """Blocks of 16-64 rows (one or two passes of 32, a part-full last tile of 16) against each group's
    own matrix of a `[2, 3, out, in]` stack of bf16 bits, in place: a negative index gives zeros, one
    past the stack the last matrix; 2 groups split each matrix's outputs over threads, 5 do not."""
    rng = np.random.default_rng(rows + groups)
    w = _weights("bf16", (2, 3, 256, 288), rng)  # 2 x 256 x 288 elements: two parts
    x = rng.standard_normal((groups, rows, 288)).astype(np.float32)
    index = np.array([4, -1, 0, 9, 2][:groups], np.int32)
    got = np.asarray(jax.jit(cpu_kernels.amx_rows_dot)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(index)))
    rounded = x.astype(jnp.bfloat16).astype(np.float64)
    want = np.einsum("gri,goi->gro", rounded, _values(w.reshape(6, 256, 288))[np.clip(index, 0, 5)])
    want[index < 0] = 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    used = np.array([rows - 1, 17, 0, 3, rows][:groups], np.int32)
    got = np.asarray(jax.jit(cpu_kernels.amx_rows_dot)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(index),
                                                       jnp.asarray(used)))
    np.testing.assert_allclose(got, _past_used_zeroed(want, used), rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_amx_rows_dot_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"multiples of 32"):
        cpu_kernels.amx_rows_dot(jnp.zeros((2, 16, 48)), jnp.zeros((4, 64, 48), jnp.uint16), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"index \(3,\)"):
        cpu_kernels.amx_rows_dot(jnp.zeros((2, 16, 64)), jnp.zeros((4, 64, 64), jnp.uint16), jnp.zeros(3, jnp.int32))


def test_rows_dot_names_what_is_wrong():
    with pytest.raises(TypeError, match="float32"):
        cpu_kernels.rows_dot(jnp.zeros((1, 8)), jnp.zeros((4, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"\(1, 8\).*\(4, 6\)"):
        cpu_kernels.rows_dot(jnp.zeros((1, 8)), jnp.zeros((4, 6), jnp.int8))
    with pytest.raises(ValueError, match=r"index \(2,\)"):
        cpu_kernels.rows_dot(jnp.zeros((3, 1, 8)), jnp.zeros((4, 6, 8), jnp.int8), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"used rows \(2,\)"):
        cpu_kernels.rows_dot(jnp.zeros((3, 1, 8)), jnp.zeros((4, 6, 8), jnp.int8), jnp.zeros(3, jnp.int32),
                             jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"used rows \(\)"):
        cpu_kernels.rows_dot(jnp.zeros((1, 8)), jnp.zeros((4, 6, 8), jnp.int8), 0, jnp.int32(1))


def _stand_in_compiler(tmp_path, monkeypatch, seconds: float = 0) -> Path:
    """A compiler for `cpu_kernels._build` that takes `seconds`, writes an empty output, and logs each
    build to the file returned; the cache is `tmp_path / "cache"`."""
    compiler, log = tmp_path / "stand-in-c++", tmp_path / "builds.log"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "stand-in $VERSION"; exit 0; }\n'
                        f'sleep {seconds}\n'
                        'while [ $# -gt 0 ]; do [ "$1" = -o ] && { echo "$2" >> "$LOG"; : > "$2"; }; shift; done\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("DSR1_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.setenv("VERSION", "1")
    return log


@pytest.mark.slow
def test_switch_off_and_build_cache(tmp_path, monkeypatch):
    """`DSR1_CPU_KERNELS=0` turns the kernel off; a build lands in `$DSR1_KERNEL_CACHE` under a name
    keyed by source, compiler, jaxlib and CPU, and is found there the next time; without a compiler
    there is no build (dsr1 computes with XLA's products). The compiler here is a stand-in that
    writes its output and logs each build: the real build is the AVX2 test's (`avx2_library`)."""
    monkeypatch.setenv("DSR1_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    monkeypatch.setenv("DSR1_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # nor g++ / c++
    assert cpu_kernels._build() is None
    monkeypatch.undo()
    log = _stand_in_compiler(tmp_path, monkeypatch)
    library = cpu_kernels._build()
    if library is None:
        pytest.skip("not an x86-64 CPU: no kernel build")
    assert library.parent == tmp_path / "cache" and library.name.startswith("rows_dot-") and library.suffix == ".so"
    mtime = library.stat().st_mtime_ns
    assert cpu_kernels._build() == library and library.stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert len(log.read_text().splitlines()) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [library.name]  # no temporary left behind
    monkeypatch.setenv("VERSION", "2")  # another compiler: a build of its own, beside the first
    other = cpu_kernels._build()
    assert other != library and sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [library.name, other.name])
    assert len(log.read_text().splitlines()) == 2


def test_builds_starting_together_compile_once(tmp_path, monkeypatch):
    """Processes that start together on a host (a local cluster's) build the library once: the first
    holds the cache's lock while it compiles, the others wait and load its library."""
    log = _stand_in_compiler(tmp_path, monkeypatch, seconds=0.5)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # separate opens: flock's locks exclude each other
        built = list(pool.map(lambda _: cpu_kernels._build(), range(3)))
    if built[0] is None:
        pytest.skip("not an x86-64 CPU: no kernel build")
    assert len(set(built)) == 1 and len(log.read_text().splitlines()) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built[0].name]  # no temporary left behind


@pytest.mark.parametrize("spec,expected", [
    ("btq,qhk->bthk", ("", "hk", "q", "bt")),
    ("bthn,hnr->bthr", ("h", "r", "n", "bt")),
    ("bhtv,hvd->btd", ("", "d", "hv", "bt")),
    ("...d,dv->...v", None),  # `x @ W` weights keep their own copy
    ("bii,ij->bj", None),
])
def test_product_axes(spec, expected):
    assert layouts.product_axes(spec) == expected


@needs_kernel
@pytest.mark.parametrize("name", sorted(DECODE_PRODUCTS))
@pytest.mark.slow
def test_attention_weights_are_laid_out_for_their_decode_products(name, monkeypatch):
    """With the kernel the attention weights of `DECODE_PRODUCTS` hold their bits laid out for those
    products (per layer), which a decode product reads through the kernel and a product of many rows
    (prefill) does not; both equal the float64 einsum of the bf16 values."""
    monkeypatch.setenv("DSR1_CPU_KERNELS", "1")
    w = dsr1.init_random(TINY, seed=0).params["moe_layers"][name]
    assert w.kernel_spec == DECODE_PRODUCTS[name] and w.transposed.shape[0] == w.shape[0]
    # W_UV `[L, heads, v, r]` is stored as the kernel reads it: the bits themselves, counted once.
    assert (w.transposed is w.bits) == (name == "wv_b")
    assert w.nbytes == w.bits.nbytes * (1 if name == "wv_b" else 2)
    w = jax.tree.map(lambda a: a[1], w)  # one layer, as the layer scan slices it
    x_sub = DECODE_PRODUCTS[name].split(",")[0]
    sizes = {**dict(zip(DECODE_PRODUCTS[name].split(",")[1].split("-")[0], w.shape)), "b": 2}
    rng = np.random.default_rng(0)
    for t, kernel in ((1, True), (5, False)):
        x = jnp.asarray(rng.standard_normal([sizes.get(c, t) for c in x_sub]), jnp.float32)
        product = jax.jit(lambda x, w: products.einsum(DECODE_PRODUCTS[name], x, w, preferred_element_type=jnp.float32))
        assert ("dsr1_rows_dot_bf16" in product.lower(x, w).as_text()) == kernel, t
        want = np.einsum(DECODE_PRODUCTS[name], np.asarray(x, np.float64), np.asarray(w, np.float64))
        np.testing.assert_allclose(np.asarray(product(x, w)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("dtype,quant_mode", [("bfloat16", None), ("float32", "int8"), ("bfloat16", "int8")])
@pytest.mark.slow
def test_decode_with_the_kernel_equals_decode_without(dtype, quant_mode, monkeypatch):
    """A whole model (MLA, dense and MoE layers, the lm_head) decodes the same logits with the kernel
    as with XLA's own products (`DSR1_CPU_KERNELS=0`), at batch 1 and 3, prefill included: every copy
    the kernel reads (in place from its layer stack, or laid out for an attention product) holds the
    weight's values. With float32 activations to float32 rounding; with bf16 ones a summation order
    that differs flips a few roundings of the activations, which the layers carry on (to 1-2% here),
    and now and then an expert choice of a random model's near-tied router (int8 at batch 5: one
    sequence's logits off by 6% at every step): so the median position within 2% and the greedy
    token where it leads by more than 2% (the rest: near ties, 0.2% apart at batch 3). At batch 5
    bf16 rows take `vdpbf16ps` where it is built (`DSR1_BF16_ROWS=1`)."""
    monkeypatch.setenv("DSR1_BF16_ROWS", "1")
    cfg = TINY
    models = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("DSR1_CPU_KERNELS", switch)
        models[switch] = dsr1.init_random(cfg, seed=3, dtype=dtype, quant=quant_mode)
    rng = np.random.default_rng(0)
    for batch in (1, 3, 5):
        prompt = rng.integers(2, cfg.vocab_size, (batch, 5))
        logits = {}
        for switch, model in models.items():
            monkeypatch.setenv("DSR1_CPU_KERNELS", switch)
            first, cache = model.prefill(prompt, max_len=8)
            steps = [first]
            for token in (7, 9):
                out, cache = model.decode(cache, np.full(batch, token))
                steps.append(out)
            logits[switch] = np.stack([np.asarray(s, np.float32).reshape(batch, -1) for s in steps])
        if dtype == "float32":  # float32 activations: the same products up to float32 summation order
            np.testing.assert_allclose(logits["1"], logits["0"], rtol=2e-4, atol=2e-4 * np.abs(logits["0"]).max())
        else:  # bf16 activations: a different summation order flips some roundings (one ulp: 2^-8)
            scale = np.abs(logits["0"]).max()
            error = np.abs(logits["1"] - logits["0"]).max(-1) / scale
            top2 = np.sort(logits["0"], -1)[..., -2:]
            decisive = (top2[..., 1] - top2[..., 0]) / scale > 2e-2
            assert np.median(error) < 2e-2, error
            np.testing.assert_array_equal(logits["1"].argmax(-1)[decisive], logits["0"].argmax(-1)[decisive])


def _bf16(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)


def _attention_inputs(rank: int, heads: int, rng: np.random.Generator, rope: int = 16, s: int = 40) -> tuple:
    """bf16 queries, a `[3, 5, s, ...]` cache and own keys; rows holding none, one, some and all of
    the cache's positions (keys scored two at a time: odd and even counts; summed 32 at a time: one
    tile and two)."""
    b = 5
    return (_bf16((b, heads, rank), rng), _bf16((b, heads, rope), rng), _bf16((3, b, s, rank), rng),
            _bf16((3, b, s, rope), rng), _bf16((b, rank), rng), _bf16((b, rope), rng), np.array([0, 1, 17, s, s - 7]))


def _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths, layer: int, scale: float,
                       c_scale: np.ndarray | None = None) -> np.ndarray:
    """`mla_decode_context`'s steps in float64, the probabilities rounded to bf16 from float32 (an int8
    cache's scales multiply the latent products, and the probabilities before they are rounded)."""
    f64 = np.float64

    def bf16(x):
        return x.astype(np.float32).astype(jnp.bfloat16).astype(f64)

    want = np.zeros(q.shape)
    for row, n in enumerate(lengths):
        keys = np.concatenate([c_kv[layer, row, :n], own_c[row][None]]).astype(f64)
        rotary = np.concatenate([k_pe[layer, row, :n], own_pe[row][None]]).astype(f64)
        key_scale = np.ones(n + 1) if c_scale is None else np.append(c_scale[layer, row, :n], 1.0)
        scores = (q[row].astype(f64) @ keys.T * key_scale + q_pe[row].astype(f64) @ rotary.T) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        want[row] = bf16((probs / probs.sum(-1, keepdims=True)).astype(np.float32) * key_scale) @ keys
    return want


def _assert_attention_close(got: np.ndarray, want: np.ndarray) -> None:
    """To float32 summation order: within 1e-6 of the largest output but where a probability's float32
    value lay at a bf16 rounding tie (one bf16 ulp of it, 2^-8 at most)."""
    error = np.abs(got - want)
    assert np.quantile(error, 0.999) < 1e-6 * np.abs(want).max()
    assert error.max() < 2 ** -8 * np.abs(want).max()


def _bits(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x.view(np.uint16))


@needs_kernel
# Widths in vectors of 16 lanes: pairs only; a pair and one; one and single widths (rope too)
@pytest.mark.parametrize(("rank", "rope"), [(256, 16), (48, 16), (24, 12)])
@pytest.mark.parametrize("heads", [3, 11])  # one block of heads, or two (8 + 3)
# bf16 queries: scores (and, at widths of multiples of 32, value sums) with vdpbf16ps where it runs
@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
def test_mla_decode_context_equals_float64(rank, rope, heads, query_dtype):
    """The attention of one new token per row against layer 1 of a cache of bf16 bits, read in place,
    plus each row's own key, equals float64 of the same steps."""
    q, q_pe, c_kv, k_pe, own_c, own_pe, lengths = _attention_inputs(rank, heads, np.random.default_rng(rank + heads),
                                                                    rope)
    run = jax.jit(cpu_kernels.mla_decode_context, static_argnums=8)
    args = (*(jnp.asarray(x, query_dtype) for x in (q, q_pe)), _bits(c_kv), _bits(k_pe), 1, jnp.asarray(lengths),
            jnp.asarray(own_c), jnp.asarray(own_pe), 0.3)
    bf16_scores = query_dtype == "bfloat16" and cpu_kernels.bf16_rows()
    assert ("dsr1_bf16_mla_decode_context" in run.lower(*args).as_text()) == bf16_scores
    _assert_attention_close(np.asarray(run(*args)), _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths,
                                                                       1, 0.3))


@needs_kernel
@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
def test_mla_decode_context_over_many_tiles(query_dtype):
    """Rows of up to 150 keys: the value sums' tiles of 32 keys (float32 path) or 32 key pairs (the
    bf16 path's `vdpbf16ps`, latent width 64), odd and even key counts."""
    q, q_pe, c_kv, k_pe, own_c, own_pe, lengths = _attention_inputs(64, 11, np.random.default_rng(5), s=150)
    got = jax.jit(cpu_kernels.mla_decode_context, static_argnums=8)(
        *(jnp.asarray(x, query_dtype) for x in (q, q_pe)), _bits(c_kv), _bits(k_pe), 2, jnp.asarray(lengths),
        jnp.asarray(own_c), jnp.asarray(own_pe), 0.3)
    _assert_attention_close(np.asarray(got), _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths, 2, 0.3))


def _paged(cache: np.ndarray, page_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A contiguous cache `[layers, B, S, k]` as a shuffled page pool `[layers, pages, page_size, k]` (one
    page more, never in a table, holding noise) and each row's page table `[B, S / page_size]`."""
    layers, b, s, k = cache.shape
    per_row = s // page_size
    order = rng.permutation(b * per_row + 1)
    pool = rng.integers(0, 128, (layers, len(order), page_size, k)).astype(cache.dtype)  # noise of any dtype
    pool[:, order[:-1]] = cache.reshape(layers, b * per_row, page_size, k)
    return pool, order[:-1].reshape(b, per_row)


@needs_kernel
@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 8, 40])
def test_mla_decode_context_reads_a_page_pool(query_dtype, page_size):
    """A serving engine's cache: each row's positions in pages of the pool, in its page table's order;
    the same context as the contiguous cache the pages hold (a page of 40: one per row)."""
    rng = np.random.default_rng(page_size)
    q, q_pe, c_kv, k_pe, own_c, own_pe, lengths = _attention_inputs(64, 11, rng)
    c_pool, table = _paged(c_kv, page_size, np.random.default_rng(1))
    pe_pool, _ = _paged(k_pe, page_size, np.random.default_rng(1))
    got = jax.jit(cpu_kernels.mla_decode_context, static_argnums=8)(
        *(jnp.asarray(x, query_dtype) for x in (q, q_pe)), _bits(c_pool), _bits(pe_pool), 2, jnp.asarray(lengths),
        jnp.asarray(own_c), jnp.asarray(own_pe), 0.3, jnp.asarray(table, jnp.int32))
    _assert_attention_close(np.asarray(got), _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths, 2, 0.3))


@needs_kernel
# bf16 queries: int8 latents made bf16 for vdpbf16ps where it runs (latent width 64: the value sums too,
# over three tiles of key pairs; 48: a masked last part of the scores' widths)
@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("page_size", "rank"), [(None, 64), (8, 64), (None, 48)])
def test_mla_decode_context_reads_an_int8_cache(query_dtype, page_size, rank):
    """An int8 latent cache (a float32 scale per position; `k_pe` and the own key bf16), contiguous or in
    pages: the scales multiply the latent products and the probabilities, as XLA's path does."""
    rng = np.random.default_rng(11)
    q, q_pe, _, k_pe, own_c, own_pe, lengths = _attention_inputs(rank, 11, rng, s=152)
    c_kv = rng.integers(-128, 128, (3, 5, 152, rank)).astype(np.int8)
    c_scale = rng.uniform(0.005, 0.03, (3, 5, 152)).astype(np.float32)
    table = None
    cache = (c_kv, _bits(k_pe), c_scale)
    if page_size:
        (c_pool, table), (pe_pool, _) = (_paged(x, page_size, np.random.default_rng(1)) for x in (c_kv, k_pe))
        scale_pool, _ = _paged(c_scale[..., None], page_size, np.random.default_rng(1))
        cache = (c_pool, _bits(pe_pool), scale_pool[..., 0])
        table = jnp.asarray(table, jnp.int32)
    run = jax.jit(cpu_kernels.mla_decode_context, static_argnums=8)
    args = (*(jnp.asarray(x, query_dtype) for x in (q, q_pe)), jnp.asarray(cache[0]), cache[1], 2,
            jnp.asarray(lengths), jnp.asarray(own_c), jnp.asarray(own_pe), 0.3, table, jnp.asarray(cache[2]))
    handler = "bf16_int8" if query_dtype == "bfloat16" and cpu_kernels.bf16_rows() else "int8"
    assert f"dsr1_{handler}_mla_decode_context" in run.lower(*args).as_text()
    want = _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths, 2, 0.3, c_scale)
    _assert_attention_close(np.asarray(run(*args)), want)


@needs_kernel
# 20 heads: blocks of 8, 8 and 4, shared by the workers; 80: 10 blocks, in 3 parts or more (a part takes 4)
@pytest.mark.parametrize("heads", [20, 80])
@pytest.mark.parametrize("cache_dtype", ["bf16", "int8"])
def test_mla_decode_context_splits_one_rows_heads_between_workers(heads, cache_dtype):
    """One row's blocks of heads in parts, which the workers share, each reading the row's keys (an
    int8 cache's made bf16) itself; and an empty batch."""
    rng = np.random.default_rng(7)
    inputs = _attention_inputs(64, heads, rng)
    q, q_pe, c_kv, k_pe, own_c, own_pe, lengths = (x[:, 3:4] if x.ndim == 4 else x[3:4] for x in inputs)
    c_scale = cache = None
    if cache_dtype == "int8":
        c_kv = rng.integers(-128, 128, c_kv.shape).astype(np.int8)
        c_scale = rng.uniform(0.005, 0.03, c_kv.shape[:3]).astype(np.float32)
        cache = jnp.asarray(c_kv)
    run = jax.jit(cpu_kernels.mla_decode_context, static_argnums=8)
    got = run(*(jnp.asarray(x, jnp.bfloat16) for x in (q, q_pe)), _bits(c_kv) if cache is None else cache,
              _bits(k_pe), 1, jnp.asarray(lengths), jnp.asarray(own_c), jnp.asarray(own_pe), 0.3,
              c_scale=None if c_scale is None else jnp.asarray(c_scale))
    want = _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths, 1, 0.3, c_scale)
    _assert_attention_close(np.asarray(got), want)
    if cache_dtype == "bf16":
        empty = run(*(jnp.asarray(x[:0]) for x in (q, q_pe)), *(_bits(x[:, :0]) for x in (c_kv, k_pe)), 1,
                    *(jnp.asarray(x[:0]) for x in (lengths, own_c, own_pe)), 0.3)
        assert empty.shape == (0, heads, 64)


@needs_kernel
def test_mla_decode_context_names_what_is_wrong():
    q = jnp.zeros((2, 4, 32))
    cache = jnp.zeros((3, 2, 8, 32), jnp.uint16)
    with pytest.raises(ValueError, match="c_kv"):
        cpu_kernels.mla_decode_context(q, jnp.zeros((2, 4, 16)), cache.astype(jnp.float32), jnp.zeros((3, 2, 8, 16),
                                       jnp.uint16), 0, jnp.zeros(2, jnp.int32), jnp.zeros((2, 32)), jnp.zeros((2, 16)),
                                       1.0)
    with pytest.raises(ValueError, match=r"q \(4, 32\)"):
        cpu_kernels.mla_decode_context(q[0], jnp.zeros((2, 4, 16)), cache, jnp.zeros((3, 2, 8, 16), jnp.uint16), 0,
                                       jnp.zeros(2, jnp.int32), jnp.zeros((2, 32)), jnp.zeros((2, 16)), 1.0)
    with pytest.raises(ValueError, match="own_c"):
        cpu_kernels.mla_decode_context(q, jnp.zeros((2, 4, 16)), cache, jnp.zeros((3, 2, 8, 16), jnp.uint16), 0,
                                       jnp.zeros(2, jnp.int32), jnp.zeros((3, 32)), jnp.zeros((2, 16)), 1.0)
    with pytest.raises(ValueError, match=r"page_table \(3, 4\)"):  # a page pool: a table for each of 2 rows
        cpu_kernels.mla_decode_context(q, jnp.zeros((2, 4, 16)), cache, jnp.zeros((3, 2, 8, 16), jnp.uint16), 0,
                                       jnp.zeros(2, jnp.int32), jnp.zeros((2, 32)), jnp.zeros((2, 16)), 1.0,
                                       page_table=jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="int8 latents take a scale per position"):
        cpu_kernels.mla_decode_context(q, jnp.zeros((2, 4, 16)), cache.astype(jnp.int8),
                                       jnp.zeros((3, 2, 8, 16), jnp.uint16), 0, jnp.zeros(2, jnp.int32),
                                       jnp.zeros((2, 32)), jnp.zeros((2, 16)), 1.0)
    with pytest.raises(ValueError, match="contiguous cache"):  # no table: a cache of one row per query row
        cpu_kernels.mla_decode_context(q, jnp.zeros((2, 4, 16)), cache[:, :1], jnp.zeros((3, 1, 8, 16), jnp.uint16),
                                       0, jnp.zeros(2, jnp.int32), jnp.zeros((2, 32)), jnp.zeros((2, 16)), 1.0)


@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
@pytest.mark.slow
def test_decode_attention_by_the_kernel_equals_xlas(kv_cache_dtype):
    """`attend_decode` of a bf16 model on one device against its prefilled cache (bits, or int8 latents;
    rows of different lengths) computes the attention in one kernel call, with the XLA path's result:
    the same bf16 outputs but where float32 summation order flips a rounding. The cache on several
    devices (`one_device=False`) keeps the XLA path."""
    cfg = TINY
    model = dsr1.init_random(cfg, seed=1, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    tokens = np.random.default_rng(0).integers(2, cfg.vocab_size, (3, 6))
    _, cache = model.prefill(tokens, lengths=np.array([6, 2, 4]), max_len=9)
    assert (cache.c_scale is not None) == (kv_cache_dtype == "int8")
    p = jax.tree.map(lambda a: a[1], model.params["moe_layers"])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, cfg.hidden_size)), jnp.bfloat16)

    def attend(one_device: bool):
        return jax.jit(lambda p, x, cache: attention.attend_decode(p, x, cache.lengths, cache, jnp.int32(2), cfg,
                                                                   one_device=one_device))

    assert "mla_decode_context" in attend(True).lower(p, x, cache).as_text()
    assert "mla_decode_context" not in attend(False).lower(p, x, cache).as_text()
    (got, got_latents), (want, want_latents) = attend(True)(p, x, cache), attend(False)(p, x, cache)
    np.testing.assert_array_equal(np.asarray(got_latents[0], np.float32), np.asarray(want_latents[0], np.float32))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.mean(got == want) > 0.99  # (all equal here)
    np.testing.assert_allclose(got, want, rtol=0, atol=2 ** -8 * np.abs(want).max())  # a rounding flip at most


def _paged_cache(cache, page_size: int) -> tuple[PagedKVCache, np.ndarray]:
    """A contiguous cache's latents as a shuffled page pool (`_paged`), and the rows' page tables."""
    def pool(a):  # the same shuffle for every array (one seed): one page table
        a = np.asarray(a)
        pages, _ = _paged(a.reshape(*a.shape[:3], -1), page_size, np.random.default_rng(0))
        return jnp.asarray(pages.reshape(*pages.shape[:3], *a.shape[3:]))

    _, table = _paged(np.asarray(cache.k_pe), page_size, np.random.default_rng(0))
    scales = None if cache.c_scale is None else pool(cache.c_scale)
    return PagedKVCache(pool(cache.c_kv), pool(cache.k_pe), scales), table


@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
@pytest.mark.slow
def test_paged_decode_attention_by_the_kernel_equals_contiguous(kv_cache_dtype):
    """`attend_extend` with one new token per row (a serving engine's decode) of a bf16 model on one
    device (bf16 or int8 latents) reads the page pool in place in one kernel call: the contiguous
    kernel's result exactly (the same keys, found through the page table), so XLA's contiguous path's
    but where float32 summation order flips a rounding. (XLA's page-by-page fold, which more tokens per row or several
    devices keep, rounds the probabilities before they are normalized: ~0.1% off the contiguous path
    on average here.)"""
    cfg = TINY
    model = dsr1.init_random(cfg, seed=1, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    tokens = np.random.default_rng(0).integers(2, cfg.vocab_size, (3, 6))
    _, cache = model.prefill(tokens, lengths=np.array([6, 2, 4]), max_len=9)
    pool, table = _paged_cache(cache, page_size=3)
    p = jax.tree.map(lambda a: a[1], model.params["moe_layers"])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, cfg.hidden_size)), jnp.bfloat16)

    def extend(one_device: bool, chunk: int = 1):
        def run(p, x, pool, table, lengths):
            context = attention.PagedContext(pool, table, lengths, block_pages=2)
            positions = lengths[:, None] + jnp.arange(chunk)
            return attention.attend_extend(p, x[:, :chunk], positions, context, jnp.int32(2), cfg, absorbed=True,
                                           one_device=one_device)[0][:, 0]
        return jax.jit(run)

    def decode(one_device: bool):
        return jax.jit(lambda p, x, cache: attention.attend_decode(p, x[:, 0], cache.lengths, cache, jnp.int32(2), cfg,
                                                                   one_device=one_device)[0])

    args = (p, x, pool, jnp.asarray(table, jnp.int32), cache.lengths)
    assert "mla_decode_context" in extend(True).lower(*args).as_text()
    assert "mla_decode_context" not in extend(False).lower(*args).as_text()
    assert "mla_decode_context" not in extend(True, chunk=2).lower(*args).as_text()
    got = np.asarray(extend(True)(*args), np.float32)
    np.testing.assert_array_equal(got, np.asarray(decode(True)(p, x, cache), np.float32))
    want = np.asarray(decode(False)(p, x, cache), np.float32)
    assert np.mean(got == want) > 0.99  # (all equal here)
    np.testing.assert_allclose(got, want, rtol=0, atol=2 ** -8 * np.abs(want).max())  # a rounding flip at most


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory):
    """The kernel library built with AVX-512 turned off (once for the module: a build takes a while)."""
    import ctypes

    with pytest.MonkeyPatch.context() as m:
        m.setenv("DSR1_KERNEL_CACHE", str(tmp_path_factory.mktemp("avx2")))
        return ctypes.cdll.LoadLibrary(str(cpu_kernels._build(("-mno-avx512f",))))


@needs_kernel
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.slow
def test_the_avx2_build_computes_the_same(dtype, avx2_library):
    """The kernel's AVX2 variant (8-lane vectors: CPUs without AVX-512, e.g. AMD Zen 3), built here with
    AVX-512 turned off and registered under its own names, equals float64 for every block size (and
    in the decode attention, against a bf16 or an int8 cache)."""
    library = avx2_library
    target = f"dsr1_rows_dot_{dtype}"
    jax.ffi.register_ffi_target(f"{target}_avx2_test", jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    rng = np.random.default_rng(2)
    w = _weights(dtype, (3, 37, 72), rng)
    for rows in (1, 2, 5, 8, 11):
        x = rng.standard_normal((1, rows, 72)).astype(np.float32)
        call = jax.ffi.ffi_call(f"{target}_avx2_test", jax.ShapeDtypeStruct((1, rows, 37), jnp.float32))
        got = np.asarray(call(jnp.asarray(x), jnp.asarray(w), jnp.int32(2)))[0]
        want = x[0].astype(np.float64) @ _values(w[2]).T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(rows))
    # The decode attention too, against a cache of the same dtype: 8-lane vectors, single widths (rope 12)
    handler = "dsr1_mla_decode_context" if dtype == "bf16" else "dsr1_int8_mla_decode_context"
    jax.ffi.register_ffi_target(f"mla_{dtype}_avx2_test", jax.ffi.pycapsule(getattr(library, handler)), platform="cpu")
    q, q_pe, c_kv, k_pe, own_c, own_pe, lengths = _attention_inputs(36, 11, rng, rope=12)
    c_scale = None
    if dtype == "int8":
        c_kv = rng.integers(-127, 128, c_kv.shape).astype(np.int8)
        c_scale = rng.uniform(0.005, 0.03, c_kv.shape[:3]).astype(np.float32)
    call = jax.ffi.ffi_call(f"mla_{dtype}_avx2_test", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    got = call(*(jnp.asarray(a, jnp.float32) for a in (q, q_pe)), jnp.asarray(c_kv) if c_scale is not None else
               _bits(c_kv), _bits(k_pe), jnp.zeros(0, jnp.float32) if c_scale is None else jnp.asarray(c_scale),
               jnp.ones(1, jnp.int32), jnp.asarray(lengths, jnp.int32),
               jnp.arange(len(lengths), dtype=jnp.int32)[:, None], _bits(own_c), _bits(own_pe),
               jnp.full(1, 0.3, jnp.float32))
    want = _attention_float64(q, q_pe, c_kv, k_pe, own_c, own_pe, lengths, 1, 0.3, c_scale)
    _assert_attention_close(np.asarray(got), want)


@needs_kernel
@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(1, 96, 64), (3, 40, 37), (8, 24, 160)])
def test_rows_matmul_reads_a_float32_stack_in_place(rows, inputs, outputs):
    """`x @ w[index]` for a float32 stack `[L, in, out]` (the router's layout): blocks of 4 output
    vectors, single vectors and single outputs; 1-4 rows at a time; the index clamped to the stack."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3, inputs, outputs)).astype(np.float32)
    x = rng.standard_normal((rows, inputs)).astype(np.float32)
    run = jax.jit(cpu_kernels.rows_matmul)
    for index, matrix in ((1, 1), (7, 2)):
        want = x.astype(np.float64) @ w[matrix].astype(np.float64)
        np.testing.assert_allclose(np.asarray(run(jnp.asarray(x), jnp.asarray(w), index)), want, rtol=0,
                                   atol=1e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"rows_matmul: x \(3, 40\) against float32 w \(3, 41, 37\)"):
        cpu_kernels.rows_matmul(jnp.zeros((3, 40)), jnp.zeros((3, 41, 37)))


@needs_kernel
@pytest.mark.slow
def test_decode_reads_the_router_in_its_stack():
    """A one-device decode step computes each MoE layer's router logits with the kernel, reading the
    layer's router in its stack; a prefill (more than 8 rows) slices it out for XLA's product."""
    model = dsr1.init_random(TINY, seed=0, dtype="bfloat16")
    tokens = np.random.default_rng(0).integers(2, model.cfg.vocab_size, (2, 12))
    _, cache = model.prefill(tokens, max_len=16)
    decode = jax.jit(lambda params, cache, tok: core.decode(params, cache, tok, **model.program_kwargs))
    assert "dsr1_rows_matmul_f32" in decode.lower(model.params, cache, jnp.asarray(tokens[:, -1])).as_text()
    prefill = jax.jit(lambda params, tok: core.prefill(params, tok, jnp.full(2, 12), max_len=16,
                                                       **model.program_kwargs))
    assert "dsr1_rows_matmul_f32" not in prefill.lower(model.params, jnp.asarray(tokens)).as_text()


class _Device:
    """A stand-in for another platform's device (only `platform` is read)."""

    def __init__(self, platform: str):
        self.platform = platform


def test_backend_is_chosen_by_the_mesh_devices_platform(monkeypatch):
    """`dsr1.cpu.enabled` follows the devices it is given, not JAX's default backend: a TPU or GPU
    device list is never enabled and never reaches the compiler (a build would raise here); CPU devices
    are, unless `DSR1_CPU_KERNELS=0`."""
    from dsr1 import cpu

    def no_build(*args):
        raise AssertionError("built the CPU kernels for another platform's devices")

    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "_build", no_build)
        m.setattr(cpu_kernels, "_registered", functools.cache(lambda: no_build()))
        assert not cpu.enabled([_Device("tpu")] * 4)
        assert not cpu.enabled([_Device("gpu"), _Device("cpu")])
        assert not cpu.enabled([])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    assert cpu.enabled(mesh) == cpu_kernels.available()
    monkeypatch.setenv("DSR1_CPU_KERNELS", "0")
    assert not cpu.enabled(mesh)
    # The model's choices for a TPU mesh: the grouped-matmul experts; the attention kernel is the
    # backend's that holds the weights (none here: XLA's, `test_disabled_backend_holds_weights_as_their_dtype`).
    from dsr1.core import moe
    assert moe.default_kernel(8, 256, "tpu") is moe.grouped_experts
    assert attention.kernel_choice(mesh, True) == ("cpu", True)


@pytest.mark.slow
def test_disabled_backend_holds_weights_as_their_dtype(monkeypatch):
    """With `DSR1_CPU_KERNELS=0` a loaded bf16 (and int8) model holds every weight as a plain array of
    its dtype: no bit layouts, no transposed copies. The bytes held (the params' leaves, and the live
    device buffers they are) equal the declared shapes times their itemsize."""
    import dsr1
    from dsr1 import cpu
    from dsr1.core.backend import XLA, backend_of
    from dsr1.core.params import is_spec, param_specs

    monkeypatch.setenv("DSR1_CPU_KERNELS", "0")
    cfg = dataclasses.replace(TINY, num_nextn_predict_layers=1)
    for quant in (None, "int8"):
        model = dsr1.init_random(cfg, quant=quant, mtp=True)
        leaves = jax.tree.leaves(model.params)
        assert not any(cpu.is_laid(w) for w in jax.tree.leaves(model.params, is_leaf=cpu.is_laid))
        assert backend_of(model.params) is XLA  # the core computes every product with XLA
        declared = sum(math.prod(s.shape) * jnp.dtype(s.dtype or jnp.bfloat16).itemsize
                       for s in jax.tree.leaves(param_specs(cfg, quant, mtp=True), is_leaf=is_spec))
        assert sum(w.nbytes for w in leaves) == declared
        held = {id(b) for b in jax.live_arrays()}
        assert all(id(w) in held for w in leaves)  # the params are the device buffers, not views of others
    monkeypatch.setenv("DSR1_CPU_KERNELS", "1")
    if cpu_kernels.available():  # the backend's layouts hold more: the copies its kernels read
        model = dsr1.init_random(cfg)
        laid = [w for w in jax.tree.leaves(model.params, is_leaf=cpu.is_laid) if cpu.is_laid(w)]
        assert backend_of(model.params) is cpu.CPU
        assert laid and sum(w.nbytes for w in laid) > sum(w.bits.nbytes for w in laid if isinstance(w, cpu.Bf16Bits))
