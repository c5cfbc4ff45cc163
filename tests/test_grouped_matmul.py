"""The grouped matmul kernel for routed experts (`dsr1.core.grouped_matmul`): its visits, in Pallas'
TPU interpreter on CPU against `jax.lax.ragged_dot`, and compiled for a v5e chip by libtpu's
deviceless compile, where it reads the layer-stacked experts in place."""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsr1.core import grouped_matmul as gm

from .harness import TINY

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'dsr1[tpu-plan]')")

# Several groups in one tile, empty groups, a group over several tiles, rows of no group at the end.
SIZES = [5, 0, 20, 3, 0, 7]  # 35 of 40 rows; tiles of 32: tile 0 holds groups 0, 2, 3 and 5's start
STACKED_SIZES = [0, 150, 3, 0, 40, 1, 60, 0]  # 254 of 300 rows; tiles of 64: group 1 spans 3, tile 4 none


def _reference(lhs, rhs, sizes):
    """`ragged_dot` in float32 of the same values (bf16 and int8 are exact in float32)."""
    return np.asarray(jax.lax.ragged_dot(jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32),
                                         jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32))


def _close(got, want):
    """bf16 products summed in float32 in another order: 1e-5 of max|want|; rows past the groups exactly 0."""
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("sizes,m,tm", [(SIZES, 40, 32), (STACKED_SIZES, 300, 64), ([0, 0, 0], 50, 32),
                                        ([8, 8, 8, 8], 32, 32), ([0, 64, 0, 100], 128, 32)])
def test_visits_name_only_the_groups_with_rows(sizes, m, tm):
    """Every visit, idle ones included, names a group with rows (none when no group has rows):
    only their matrices are read. Each tile's real visits are consecutive and cover its rows once;
    the tiles without rows are each zeroed once; idle visits repeat the last visit's blocks."""
    tiles_m = -(-m // tm)
    visits = jax.jit(gm._visits, static_argnums=(1, 2, 3))  # one program, not an op at a time
    v = jax.tree.map(np.asarray, visits(jnp.asarray(sizes, jnp.int32), m, tm, tiles_m))
    sizes = np.asarray(sizes)
    bound = tiles_m + len(sizes) - 1
    assert v.groups.shape == v.tiles.shape == v.out_tiles.shape == (bound,)
    real, zero_end = v.counts
    held = set(np.flatnonzero(sizes).tolist())
    assert set(v.groups.tolist()) <= (held or {len(sizes) - 1})
    rows = np.zeros(tiles_m * tm, int)
    for i in range(real):
        g, t = v.groups[i], v.tiles[i]
        assert sizes[g] > 0 and v.out_tiles[i] == t
        lo, hi = max(v.offsets[g], t * tm), min(v.offsets[g + 1], (t + 1) * tm)
        assert lo < hi
        rows[lo:hi] += 1
    total = min(sizes.sum(), m)
    assert (rows[:total] == 1).all() and (rows[total:] == 0).all()
    assert (np.diff(v.tiles[:real]) >= 0).all()
    used = -(-total // tm)
    assert v.out_tiles[real:zero_end].tolist() == list(range(used, tiles_m))
    last = max(real - 1, 0)
    assert (v.groups[real:] == v.groups[last]).all() and (v.tiles[real:] == v.tiles[last]).all()
    assert (v.out_tiles[zero_end:] == v.out_tiles[max(zero_end - 1, 0)]).all()


@pytest.mark.slow
def test_bf16_experts_equal_ragged_dot_and_read_no_empty_group():
    """bf16 rows and experts [G, k, n]: `ragged_dot`'s float32 product; the experts of empty groups are
    NaN and the output stays finite; the rows past the groups are 0."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    rhs = np.asarray(jnp.asarray(rng.standard_normal((len(SIZES), 256, 256)), jnp.bfloat16), np.float32)
    want = _reference(lhs, rhs, SIZES)
    rhs[np.asarray(SIZES) == 0] = np.nan
    got = gm.grouped_matmul(lhs, jnp.asarray(rhs, jnp.bfloat16), jnp.asarray(SIZES, jnp.int32), tile=(32, 128, 128),
                            interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    _close(got, want)
    assert not np.asarray(got)[sum(SIZES):].any()


@pytest.mark.slow
def test_an_int8_layer_stack_read_at_a_traced_layer_equals_ragged_dot():
    """int8 experts stacked [L, G, k, n], the layer a traced argument: `ragged_dot` on that layer's
    experts widened to bf16; a group over three tiles, a tile of no group, rows padded to the tile."""
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((300, 256)) * 0.1, jnp.bfloat16)
    stack = jnp.asarray(rng.integers(-128, 128, (3, len(STACKED_SIZES), 256, 256)), jnp.int8)
    run = jax.jit(lambda a, b, s, layer: gm.grouped_matmul(a, b, s, layer, tile=(64, 128, 128), interpret=True))
    sizes = jnp.asarray(STACKED_SIZES, jnp.int32)
    for layer in (2, 0):
        got = run(lhs, stack, sizes, jnp.int32(layer))
        _close(got, _reference(lhs, stack[layer], STACKED_SIZES))
        assert not np.asarray(got)[sum(STACKED_SIZES):].any()


@pytest.mark.slow
def test_widths_of_part_of_a_block_and_no_rows():
    """k and n not whole lane tiles (each one block of its own width) with float32 rows; then no group
    with rows: zeros."""
    rng = np.random.default_rng(2)
    lhs = jnp.asarray(rng.standard_normal((20, 96)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 96, 160)), jnp.bfloat16)
    sizes = [7, 0, 11]
    got = gm.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), interpret=True)
    _close(got, _reference(lhs, rhs, sizes))
    empty = gm.grouped_matmul(lhs, rhs, jnp.zeros(3, jnp.int32), interpret=True)
    assert empty.shape == (20, 160) and not np.asarray(empty).any()


@pytest.mark.slow
def test_fewer_rows_than_a_sublane_tile():
    """A decode step's few pairs (5 rows): one block of exactly those rows, nothing padded."""
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    rhs = jnp.asarray(rng.integers(-128, 128, (4, 256, 128)), jnp.int8)
    sizes = [2, 0, 2, 0]  # the last row belongs to no group
    _close(gm.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), interpret=True), _reference(lhs, rhs, sizes))


def _whole_layer_values(text: str, k: int, n: int) -> list[str]:
    """The compiled HLO's instructions that produce a value of a whole layer's experts `[32, k, n]`
    (a slice or copy of the stack), whatever its element type."""
    return [line.strip() for line in text.splitlines() if re.search(rf"= \w+\[32,{k},{n}\]", line)]


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("k,n", [(7168, 256), (256, 7168)], ids=["gate-up", "down"])
def test_compiles_for_a_v5e_chip_and_reads_the_stack_in_place(k, n):
    """R1's local experts on one of 8 devices (32 of 256, int8, two layers stacked), decode (8 rows) and
    a prefill chunk (512 rows), with the default tiles: Mosaic's lowering and XLA:TPU's
    compile without a TPU. The kernel's program holds no value of a whole layer's experts; XLA's
    `ragged_dot` on `stack[layer]` copies them (printed). The kernel's bytes are its cost estimate, a
    bound from the rows (printed)."""
    from .harness import v5e_chip

    on_chip = jax.sharding.SingleDeviceSharding(v5e_chip())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)

    def bytes_accessed(compiled) -> float | None:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return (cost or {}).get("bytes accessed")

    for m in (8, 512):
        args = (spec((m, k), jnp.bfloat16), spec((2, 32, k, n), jnp.int8), spec((32,), jnp.int32), spec((), jnp.int32))
        compiled = jax.jit(gm.grouped_matmul).lower(*args).compile()
        text = compiled.as_text()
        assert gm.NAME in text and "tpu_custom_call" in text
        assert not _whole_layer_values(text, k, n)
        print(f"\n[{k}x{n} m={m}] kernel bytes accessed {bytes_accessed(compiled)}")
        if m > 8:
            continue
        xla = jax.jit(lambda x, w, s, layer: jax.lax.ragged_dot(x, w[layer], s, preferred_element_type=jnp.float32))
        compiled = xla.lower(*args).compile()
        copies = _whole_layer_values(compiled.as_text(), k, n)
        print(f"[{k}x{n} m={m}] ragged_dot on stack[layer]: bytes accessed {bytes_accessed(compiled)}, "
              f"{len(copies)} values of a whole layer's experts: {[c.split(' = ')[0] for c in copies]}")


def test_applies_on_tpu_only():
    assert gm.applies("tpu")
    assert not any(gm.applies(p) for p in ("cpu", "gpu"))
    assert not gm.applies()  # this machine: CPU


@pytest.mark.slow
def test_routed_experts_by_the_kernel_equal_ragged_dot():
    """The MoE layer's routed experts through `grouped_experts` (the TPU default, interpreted here), the
    last layer read in place from the int8 stacks at a traced index, equal `ragged_experts`' (float32
    activations)."""
    import functools

    import dsr1
    from dsr1.core import moe

    model = dsr1.init_random(TINY, seed=5, dtype="float32", quant="int8")
    cfg, p = model.cfg, model.params["moe_layers"]["moe"]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((13, cfg.hidden_size)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False)
                                    for _ in range(13)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, experts.shape), jnp.float32)
    grouped = functools.partial(moe.grouped_experts, interpret=True)
    layer = cfg.num_moe_layers - 1
    want, got = (np.asarray(moe.routed_experts(p, x, weights, experts, model.mesh, model.rules, layer, kernel=k))
                 for k in (moe.ragged_experts, grouped))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
