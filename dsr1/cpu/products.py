"""The CPU backend's products: matrix products, expert products and decode attention on its layouts.

Few rows (decode) read a weight's copy laid out `[..., out, in]` with dsr1's kernel (`ffi.rows_dot`)
where the weight is whole on one device; a sharded weight's copy is read one row at a time by XLA,
which fuses the widening into a one-row product over the minor axis. Many rows (prefill) take
XLA:CPU's bf16 matrix-matrix dot (`native_bf16`), the activations rounded to bf16 as GPU and TPU
compute them; other products widen the bf16 bits to float32 where they are used (`to_float32`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ..core import products as xla
from ..core.quant import Int8Weight, subscripts
from . import ffi
from .layouts import NATIVE_BF16_ROWS, Bf16Bits, Int8Rows, Laid, StackSlice, kernel_operand, product_axes

WIDEN_CHUNK_ELEMENTS = 1 << 19  # float32 elements widened at a time (2 MB: a core's cache holds them)
HIGHEST = jax.lax.Precision.HIGHEST  # XLA:CPU runs a few-row float32 dot faster than at DEFAULT


def to_float32(w: Any) -> jax.Array:
    """A weight (or int8 values) as float32. bf16 bits are widened exactly (they become the high half
    of a float32) with integer ops, which XLA:CPU keeps next to their use."""
    if isinstance(w, Bf16Bits):
        return jax.lax.bitcast_convert_type(w.bits.astype(jnp.uint32) << 16, jnp.float32)
    if isinstance(w, Int8Rows):
        return w.q.astype(jnp.float32)
    return w.astype(jnp.float32)


def _as_int8(w: Int8Rows, q: Any) -> Int8Weight:
    return Int8Weight(q, w.scale, w.input_axes)


def rowwise_matmul(x: jax.Array, w: Laid) -> jax.Array:
    """float32 `x [r, i] @ w [i, o]` for a few rows, one row at a time against `w.transposed` `[o, i]`:
    each a product XLA:CPU computes as one fused widen-multiply-reduce over the minor axis. The weight
    stays in cache between rows. An int8 weight's rows are scaled after."""
    copy = w.transposed
    if isinstance(copy, StackSlice):  # a layer's copy in its stack (sharded weights: no kernel)
        copy = copy.stack[copy.index]
    wide_t = to_float32(Bf16Bits(copy) if isinstance(w, Bf16Bits) else copy)
    x = x.astype(jnp.float32)
    rows = [jnp.dot(x[r:r + 1], wide_t.T, precision=HIGHEST) for r in range(x.shape[0])]
    y = jnp.concatenate(rows) if len(rows) > 1 else rows[0]
    return y * w.scale if isinstance(w, Int8Rows) else y


def kernel_matmul(x: jax.Array, w: Laid, index: jax.Array | int = 0, used: jax.Array | None = None) -> jax.Array:
    """float32 `x [r, i] @ w [i, o]` by dsr1's kernel (`ffi.rows_dot`) on `w.transposed`; of a stack
    `w [..., i, o]`, matrix `index` of its leading axes flattened, read in place (an expert of a layer);
    with `x [g, r, i]` and `index [g]`, each group of rows by its own matrix (a negative index: zeros),
    only its first `used[g]` rows if given (the rest: zeros); many rows, where `w.bf16_reads` them,
    rounded to bf16 (AMX tiles, or `vdpbf16ps`). An int8 weight's rows are scaled after."""
    if w.bf16_reads(x.shape[-2]):
        if w.amx_fits():
            return ffi.amx_rows_dot(x, w.transposed, index, used)
        x = x.astype(jnp.bfloat16)
    y = ffi.rows_dot(x, *kernel_operand(w.transposed, index), used)
    if not isinstance(w, Int8Rows):
        return y
    scale = w.scale.reshape(-1, w.shape[-1])[index]
    return y * (scale[:, None] if jnp.ndim(index) else scale)


def native_bf16(w: Any, rows: int) -> bool:
    """Whether `rows x w` (a 2-D `Bf16Bits` weight) runs as a bf16 x bf16 -> float32 dot rather than
    widened. XLA:CPU hands a bf16 dot of many rows to its GEMM, which computes bf16 directly. For a
    few rows (decode) widening is as fast or faster and keeps the activations in float32; a weight
    large enough to be widened in blocks (the lm_head, dense MLPs) needs 4x the rows."""
    if not isinstance(w, Bf16Bits) or w.ndim != 2:
        return False
    return rows >= NATIVE_BF16_ROWS * (4 if w.size > WIDEN_CHUNK_ELEMENTS else 1)


def bf16_dot(x: jax.Array, w: Bf16Bits) -> jax.Array:
    """`x [..., i] @ w [i, o]` in bf16 with a float32 result (see `native_bf16`)."""
    return jnp.dot(x.astype(jnp.bfloat16), jax.lax.bitcast_convert_type(w.bits, jnp.bfloat16),
                   preferred_element_type=jnp.float32)


def einsum(spec: str, x: jax.Array, w: Laid, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a weight in a layout (the second operand)."""
    matmul, rows = _is_matmul(spec), math.prod(x.shape[:-1])
    dtype = kwargs.get("preferred_element_type") or (w.dtype if isinstance(w, Bf16Bits) else x.dtype)
    if isinstance(w, Bf16Bits) and w.kernel_spec == spec and w.kernel_reads(_kernel_rows(spec, x)):
        return _kernel_einsum(spec, x, w).astype(dtype)  # a decode product with a copy laid out for it
    if matmul and w.transposed is not None and w.kernel_spec is None:
        # The kernel only for a weight on one device: XLA would gather a sharded operand of it.
        if w.one_device and w.kernel_reads(rows):
            return kernel_matmul(x.reshape(rows, -1), w).reshape(*x.shape[:-1], -1).astype(dtype)
        if w.reads_transposed(rows, max_rows=1):  # (a larger weight leaves the cache between rows)
            return rowwise_matmul(x.reshape(1, -1), w).reshape(*x.shape[:-1], -1).astype(dtype)
    if isinstance(w, Int8Rows):  # int8 values widened where they are used, the product in float32
        return xla.einsum(spec, x.astype(jnp.float32), _as_int8(w, to_float32(w)), **kwargs).astype(dtype)
    if matmul and native_bf16(w, rows):
        return bf16_dot(x, w).astype(dtype)
    if matmul and w.one_device and w.size > WIDEN_CHUNK_ELEMENTS:
        return _chunked_matmul(x.astype(jnp.float32), w, **kwargs).astype(dtype)
    return jnp.einsum(spec, x.astype(jnp.float32), to_float32(w), **kwargs).astype(dtype)


def _kernel_einsum(spec: str, x: jax.Array, w: Bf16Bits) -> jax.Array:
    """float32 `einsum(spec, x, w)` by the kernel on `w.transposed` (laid out by `kernel_layout`): x's
    rows (and batch) gathered in front of its contracted axes, one kernel call, then the output's order."""
    batch, outputs, contracted, rows = product_axes(spec)
    x_sub, w_sub, out_sub = subscripts(spec)
    size = {**dict(zip(w_sub, w.shape)), **dict(zip(x_sub, x.shape))}
    xs = jnp.einsum(f"{x_sub}->{batch}{rows}{contracted}", x)
    n_rows, n_in = math.prod(size[c] for c in rows), math.prod(size[c] for c in contracted)
    xs = xs.reshape((math.prod(size[c] for c in batch), n_rows, n_in) if batch else (n_rows, n_in))
    y = ffi.rows_dot(xs, *kernel_operand(w.transposed)).reshape([size[c] for c in batch + rows + outputs])
    return jnp.einsum(f"{batch}{rows}{outputs}->{out_sub}", y)


def _kernel_rows(spec: str, x: jax.Array) -> int:
    """The rows of each of a kernel einsum's products (x's axes that the weight does not have)."""
    x_sub = subscripts(spec)[0]
    return math.prod(x.shape[x_sub.index(c)] for c in product_axes(spec)[3])


def _is_matmul(spec: str) -> bool:
    """Whether `spec` is `x [..., i] @ w [i, o]` (what `matmul` and the lm_head compute)."""
    x_sub, w_sub, out = subscripts(spec)
    return (len(w_sub) == 2 and x_sub.startswith("...") and x_sub[3:] == w_sub[0] and out.startswith("...")
            and out[3:] == w_sub[1])


def _chunked_matmul(x: jax.Array, w: Bf16Bits, **kwargs) -> jax.Array:
    """`x [..., i] @ w [i, o]` for a large bf16 weight, widened a block of output columns at a time:
    widened whole, its float32 copy (twice the weight) goes to memory and back, and for a few rows that
    costs more than the product. A block stays in cache between its widening and its product."""
    rows, cols = w.shape
    block = max(128, WIDEN_CHUNK_ELEMENTS // rows // 128 * 128)
    full = cols // block

    def product(bits: jax.Array) -> jax.Array:
        return jnp.einsum("...i,io->...o", x, to_float32(Bf16Bits(bits, one_device=w.one_device)), **kwargs)

    out = jax.lax.map(lambda i: product(jax.lax.dynamic_slice_in_dim(w.bits, i * block, block, axis=1)),
                      jnp.arange(full))  # [full, ..., block]
    out = jnp.moveaxis(out, 0, -2).reshape(*x.shape[:-1], full * block)
    if full * block == cols:
        return out
    return jnp.concatenate([out, product(w.bits[:, full * block:])], axis=-1)


def ragged_dot(x: jax.Array, w: Laid, group_sizes: jax.Array, experts: jax.Array) -> jax.Array:
    """Grouped matmul of rows sorted by expert against `[E, in, out]` experts in a layout (float32 out),
    widened (the model runs the expert loop instead: `dsr1.core.moe.loop_experts`)."""
    if isinstance(w, Int8Rows):
        return xla.ragged_dot(x.astype(jnp.float32), _as_int8(w, to_float32(w)), group_sizes, experts)
    return jax.lax.ragged_dot(x.astype(jnp.float32), to_float32(w), group_sizes, preferred_element_type=jnp.float32)


def expert_matmul(x: jax.Array, stack: Laid, layer: jax.Array, expert: jax.Array) -> jax.Array:
    """float32 `x @ w` for expert `expert` of layer `layer` of a stacked `[L, E, in, out]` weight in a
    layout: a few rows by the kernel on the transposed copy, read in place; else the expert sliced in
    place and widened where it is used (a bf16 block of many rows: computed in bf16, `native_bf16`)."""
    if stack.kernel_reads(x.shape[0]):
        return kernel_matmul(x, stack, layer * stack.shape[1] + expert)
    w = jax.tree.map(lambda a: a[layer, expert], stack)
    if w.reads_transposed(x.shape[0]):
        return rowwise_matmul(x, w)
    if isinstance(w, Int8Rows):
        return jnp.dot(x, to_float32(w), precision=HIGHEST) * w.scale
    if native_bf16(w, x.shape[0]):
        return bf16_dot(x, w)
    return jnp.dot(x, to_float32(w), precision=HIGHEST)
