"""int8 weights: symmetric, one scale per output channel.

A quantized weight is an `Int8Weight(q, scale)`: `q` int8 with the weight's shape, `scale` float32
with the weight's *output* axes only (the contracted input axes are reduced away), so
`W = q * scale` broadcast over the input axes. Matmuls never build a dequantized copy of a
weight stack: `einsum` scales the output (or, when an output channel is itself contracted, as in
absorbed decode, the input), and experts go through a mixed bf16 x int8 `ragged_dot` (or, on CPU,
`dsr1.core.moe`'s expert loop, which widens one expert's slice at a time).

On CPU, decode's products of few rows read a second copy of their weights laid out `[..., out, in]`
with dsr1's own kernel (`cpu_kernels`, `kernel_matmul`) where it is built. Otherwise bf16 weights
are widened to float32 where they are used (`Bf16Bits`, `widen`), by moving their bits: XLA:CPU
has no bf16 matrix-vector dot, and the `convert` it inserts instead is hoisted out of the layer
scan, converting every weight stack of the model on every call. Products of many rows (prefill)
take XLA:CPU's bf16 matrix-matrix dot instead (`native_bf16`), with the activations rounded to bf16
as GPU and TPU compute them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_kernels, host_copy, huge_pages

QUANT_MODES = (None, "int8")


class _TransposedCopy:
    """A weight that may also hold its values with the last two axes swapped (`transposed`,
    `[..., out, in]`; CPU, see `as_bits` and `with_transposed`) for products of a few rows."""

    transposed: Any
    one_device: bool
    kernel_spec = None  # `Bf16Bits` only: the einsum a copy is laid out for
    # The most rows of an expert (which stays in cache between its rows) that read the copy: for bf16
    # 2 (from 4 rows the `[in, out]` bits are as fast, from 16 much faster: the bf16 dot), for int8 4.
    expert_rows: ClassVar[int] = 2

    def reads_transposed(self, rows: int, max_rows: int | None = None) -> bool:
        """Whether a product of `rows` rows reads the transposed copy (`rowwise_matmul`), where held:
        up to `max_rows`, by default `expert_rows`."""
        return self.transposed is not None and rows <= (self.expert_rows if max_rows is None else max_rows)

    def kernel_reads(self, rows: int) -> bool:
        """Whether a product of `rows` rows reads the transposed copy with dsr1's CPU kernel
        (`kernel_matmul`): up to `cpu_kernels.KERNEL_ROWS`, where the kernel is built."""
        return self.transposed is not None and rows <= cpu_kernels.KERNEL_ROWS and cpu_kernels.available()

    def bf16_reads(self, rows: int) -> bool:
        """Whether a product of `rows` rows, many (a prefill's expert blocks), reads the transposed copy
        in place with bf16 instructions, the rows rounded to bf16 (`kernel_matmul` with an index per
        block of rows): `Bf16Bits` only."""
        return False

    def block_reads(self, rows: int) -> bool:
        """Whether an expert loop's blocks of `rows` rows read the transposed copy in place with dsr1's
        CPU kernel (`kernel_matmul` with an index per block): a few rows (`kernel_reads`), or many where
        `bf16_reads`."""
        return self.kernel_reads(rows) or self.bf16_reads(rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight(_TransposedCopy):
    q: Any  # int8, the weight's shape
    scale: Any  # float32, the weight's shape without its input axes
    input_axes: tuple[int, ...] = dataclasses.field(default=(0,), metadata=dict(static=True))
    transposed: Any = None  # `q` with the last two axes swapped, for one-row products (`with_transposed`)
    one_device: bool = dataclasses.field(default=False, metadata=dict(static=True))  # as `Bf16Bits.one_device`
    expert_rows: ClassVar[int] = 4  # int8 at 4 rows: 3.5 ms one row at a time against 4.9 widened

    def kernel_reads(self, rows: int) -> bool:
        """int8: dsr1's CPU kernel at any number of rows, float32 rows against int8 values widened in
        registers, 8 rows per pass over the weight. XLA widens the whole int8 weight (or each expert
        block's slice) to float32 in memory first: a 32-token prefill of the bench preset, int8, at
        batch 1 44-46 -> 25 ms, at batch 8 148-160 -> 133-138, 512 and 2,048 tokens no slower (Zen 5,
        docs/performance.md)."""
        return self.transposed is not None and cpu_kernels.available()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: the values, their scales and the transposed copy where there is one."""
        return self.bytes_read() + (0 if self.transposed is None else self.transposed.nbytes)

    def bytes_read(self, rows: int = 1) -> int:
        """Bytes a product reads: the values (or their transposed copy, the same size) and the scales."""
        return self.q.nbytes + self.scale.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackSlice:
    """Matrix `index` of a weight copy's stack `[L, ...]`, read in place by the CPU kernel: a layer
    scan gives the kernel copies of its weights this way (`in_place_copies`), not sliced out (a copy)."""

    stack: Any
    index: Any


def in_place_copies(p: Any) -> tuple[Any, Any]:
    """A layer stack's weights as (without the kernel copies `transposed`, those copies' stacks) for a
    layer scan: it slices the first, and `with_layer_copies` puts the second back in place."""
    def strip(w: Any) -> Any:
        return dataclasses.replace(w, transposed=None) if _has_copy(w) else w

    def copy(w: Any) -> Any:
        return w.transposed if _has_copy(w) else None

    return jax.tree.map(strip, p, is_leaf=_is_weight), jax.tree.map(copy, p, is_leaf=_is_weight)


def with_layer_copies(p: Any, copies: Any, layer: jax.Array) -> Any:
    """One layer's weights (sliced by a layer scan) with their kernel copies read in place from the
    stacks in `copies` (`in_place_copies`) at `layer`."""
    def put(w: Any, stack: Any) -> Any:
        return w if stack is None else dataclasses.replace(w, transposed=StackSlice(stack, layer))

    return jax.tree.map(put, p, copies, is_leaf=_is_weight)


def _is_weight(w: Any) -> bool:
    return isinstance(w, _TransposedCopy)


def _has_copy(w: Any) -> bool:
    return _is_weight(w) and w.transposed is not None


def _kernel_operand(copy: Any, index: jax.Array | int = 0) -> tuple[jax.Array, jax.Array | int]:
    """The array the CPU kernel reads and the index of the matrix in it: a layer's copy in its stack
    (`StackSlice`: one matrix, or one group of them, per layer), or the copy itself."""
    if isinstance(copy, StackSlice):
        assert isinstance(index, int) and index == 0, "a layer's copy is one matrix"
        return copy.stack, copy.index
    return copy, index


def check_quant(quant: str | None) -> str | None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant={quant!r} is not supported; choose one of {QUANT_MODES}")
    return quant


def quantize(w: Any, input_axes: tuple[int, ...]) -> Int8Weight:
    """Symmetric per-output-channel int8 of `w` (numpy or jax), reducing over `input_axes`."""
    xp = jnp if isinstance(w, jax.Array) else np
    w = w.astype(xp.float32)
    amax = xp.max(xp.abs(w), axis=input_axes, keepdims=True)
    # Multiply by reciprocals explicitly: XLA rewrites divisions that way, and host (numpy, the
    # converter) and device (the loader) quantization must agree to the last bit.
    scale = xp.where(amax > 0, amax * np.float32(1 / 127), np.float32(1))
    q = xp.clip(xp.round(w * (np.float32(1) / scale)), -127, 127).astype(xp.int8)
    return Int8Weight(q, xp.squeeze(scale, axis=input_axes).astype(xp.float32), tuple(input_axes))


def widens_on_use() -> bool:
    """Whether weights are widened to float32 where they are used: on CPU (see the module doc).
    GPU and TPU compute bf16 and int8 operands directly."""
    return cpu_kernels.target_platform() == "cpu"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bf16Bits(_TransposedCopy):
    """A bf16 weight seen as its uint16 bits (a free bitcast), so that XLA:CPU treats it as integers:
    it normalizes bf16 slices and loop operands to float32 and hoists that `convert` of the whole
    stack out of the loops, on every call. `widen` turns the bits of the slice in use into float32.
    `one_device`: the weight is whole on one device, so a large product may widen it a block of
    output columns at a time (`einsum`); a block of a sharded axis would gather the weight."""

    bits: Any  # uint16, the weight's shape
    wide: Any = None  # the same weight in float32 for one-row products, where held (see `as_bits`)
    one_device: bool = dataclasses.field(default=False, metadata=dict(static=True))
    transposed: Any = None  # the bits with the last two axes swapped, for one-row products (`as_bits`)
    # The einsum whose decode products the CPU kernel computes on `transposed`, laid out for it (`as_bits`);
    # None: `transposed` is the `[..., out, in]` copy of an `x @ W` weight.
    kernel_spec: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    def bf16_reads(self, rows: int) -> bool:
        """Blocks of many rows (a prefill's expert blocks: where XLA's bf16 dot would run, `native_bf16`,
        rounding the rows to bf16 as it does) read the transposed copy in place, with AMX tiles on a
        CPU that has them (`amx_fits`), else with `vdpbf16ps` where the kernel multiplies bf16 rows
        (`cpu_kernels.bf16_rows`). XLA's dot of a block needs the expert's slice copied out first: a
        batch-8 prefill of the bench preset spent 62 ms on those copies."""
        return (self.transposed is not None and rows >= NATIVE_BF16_ROWS
                and (self.amx_fits() or cpu_kernels.bf16_rows()))

    def amx_fits(self) -> bool:
        """Whether products of many rows take AMX tiles: sizes multiples of 32, on a CPU with AMX."""
        return self.shape[-1] % 32 == 0 and self.shape[-2] % 32 == 0 and cpu_kernels.amx_available()

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    @property
    def sharding(self):
        return self.bits.sharding

    @property
    def nbytes(self) -> int:
        """Bytes held: the bits, and the float32 or transposed copies where there are some (a weight
        already laid out for the CPU kernel holds no copy: `transposed` is `bits`)."""
        copies = (c for c in (self.wide, self.transposed) if c is not None and c is not self.bits)
        return self.bits.nbytes + sum(c.nbytes for c in copies)

    def reads_wide(self, rows: int) -> bool:
        """Whether a product of `rows` rows (`einsum`) reads the float32 copy: for one row, where held."""
        return self.wide is not None and rows == 1

    def bytes_read(self, rows: int) -> int:
        """Bytes a product of `rows` rows reads (`einsum`; the transposed copy is the bits' size)."""
        return self.wide.nbytes if self.reads_wide(rows) else self.bits.nbytes

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def size(self) -> int:
        return self.bits.size

    @property
    def addressable_shards(self) -> list:
        """This process's shards (of the bits: same shapes and devices as the bf16 weight's)."""
        return self.bits.addressable_shards

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The bf16 values on the host (numpy), as for a bf16 `jax.Array`."""
        values = np.asarray(self.bits).view(jnp.bfloat16)
        return values if dtype is None else values.astype(dtype)


def as_bits(w: jax.Array, *, keep_float32: bool = False, keep_transposed: bool = False,
            kernel_spec: str | None = None, stacked: int = 0, transposed: jax.Array | None = None) -> Bf16Bits:
    """A bf16 weight as `Bf16Bits`. An array on one device is reinterpreted through a host view (no
    program compiled per shape); a sharded or traced one by a bitcast.

    `keep_float32` also holds the weight widened once, for one-row products: XLA:CPU reads a float32
    weight at memory speed in a one-row product, and widening a large weight block by block costs
    more than that read (the bench lm_head `[1024, 32768]`: 3.5-4.6 ms against 7.2-7.8 per row);
    from 2 rows the blocked widening is faster again (2 rows 7.6-9.1 against 9.6-11.2 ms, 8 rows
    11.9-13.5 against 20.0-22.7: docs/performance.md), so the bits stay too.

    `keep_transposed` also holds the bits with the last two axes swapped (`[..., out, in]`), for
    products of few rows (`einsum`, the expert loop): dsr1's CPU kernel reads that copy for up to 8
    rows (`kernel_matmul`); without it XLA:CPU fuses the widening into a one-row product that contracts
    the minor axis and reads the weight once, at ~14-15 GB/s on one core, against ~5 GB/s for the
    widened `[in, out]` slice it first writes out as float32; products of more rows (prefill) run
    faster on the `[in, out]` bits (`native_bf16`), so both are held. `kernel_spec` instead holds the
    bits laid out for the kernel's products of the einsum `kernel_spec` (`kernel_layout`; an array on
    one device only, the kernel's own), past `stacked` leading axes (layers). A traced weight (a program
    given bf16 arrays) gets no copy: made on every call, it would cost more than it saves. `transposed`
    is the `keep_transposed` copy made already (uint16 bits on `w`'s device: the loader's)."""
    wide = w.astype(jnp.float32) if keep_float32 else None
    traced = isinstance(w, jax.core.Tracer)
    if isinstance(w, jax.Array) and not traced and len(w.sharding.device_set) == 1:
        device = next(iter(w.sharding.device_set))
        bits = jax.device_put(np.asarray(w).view(np.uint16), device)
        if kernel_spec is not None:  # (laid out as it is, as `W_UV`: the bits themselves, no copy)
            laid = bits if _laid_out_already(kernel_spec) else kernel_layout(bits, kernel_spec, stacked)
            return Bf16Bits(bits, wide, one_device=True, transposed=laid, kernel_spec=kernel_spec)
        if keep_transposed and transposed is None:
            transposed = swapped_copy(bits)
        return Bf16Bits(bits, wide, one_device=True, transposed=transposed if keep_transposed else None)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    return Bf16Bits(bits, wide, transposed=_swap_last(bits) if keep_transposed and not traced else None)


def _subscripts(spec: str) -> tuple[str, str, str]:
    """`x, w -> out` of a two-operand einsum."""
    inputs, out = spec.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    return x_sub, w_sub, out


def product_axes(spec: str) -> tuple[str, str, str, str] | None:
    """The weight's batch, output and contracted subscripts in `spec` (`x, w -> out`, explicit
    subscripts), and x's rows (its other subscripts, kept in the output); None for other einsums."""
    x_sub, w_sub, out = _subscripts(spec)
    if "." in spec or len(set(x_sub)) != len(x_sub) or len(set(w_sub)) != len(w_sub):
        return None
    batch = "".join(c for c in w_sub if c in x_sub and c in out)
    outputs = "".join(c for c in w_sub if c not in x_sub and c in out)
    contracted = "".join(c for c in w_sub if c in x_sub and c not in out)
    rows = "".join(c for c in x_sub if c not in w_sub)
    if len(batch + outputs + contracted) != len(w_sub) or not all(c in out for c in rows):
        return None
    return batch, outputs, contracted, rows


def _laid_out_already(spec: str) -> bool:
    """Whether a weight of the einsum `spec` is stored as the kernel reads it: `[(batch,) out, in]`."""
    batch, outputs, contracted, _ = product_axes(spec)
    in_order = batch + outputs + contracted == _subscripts(spec)[1]
    return in_order and len(batch) <= 1 and len(outputs) == len(contracted) == 1


@functools.partial(jax.jit, static_argnums=(1, 2))
def kernel_layout(bits: jax.Array, spec: str, stacked: int = 0) -> jax.Array:
    """A weight's bits `[stack..., w]` laid out for the CPU kernel's products of the einsum `spec`:
    `[stack..., (batch,) out, in]`, each its subscripts flattened (batch: heads multiplied each by
    their own rows; none, no axis)."""
    batch, outputs, contracted, _ = product_axes(spec)
    w_sub = _subscripts(spec)[1]
    axis = {c: stacked + i for i, c in enumerate(w_sub)}
    laid = jnp.transpose(bits, (*range(stacked), *(axis[c] for c in batch + outputs + contracted)))
    size = {c: bits.shape[axis[c]] for c in w_sub}
    groups = (math.prod(size[c] for c in batch),) if batch else ()
    return laid.reshape(*bits.shape[:stacked], *groups, math.prod(size[c] for c in outputs),
                        math.prod(size[c] for c in contracted))


def _kernel_einsum(spec: str, x: jax.Array, w: Bf16Bits) -> jax.Array:
    """float32 `einsum(spec, x, w)` by the CPU kernel on `w.transposed` (laid out by `kernel_layout`):
    x's rows (and batch) gathered in front of its contracted axes, one kernel call, then the output's
    order."""
    batch, outputs, contracted, rows = product_axes(spec)
    x_sub, w_sub, out_sub = _subscripts(spec)
    size = {**dict(zip(w_sub, w.shape)), **dict(zip(x_sub, x.shape))}
    xs = jnp.einsum(f"{x_sub}->{batch}{rows}{contracted}", x)
    n_rows, n_in = math.prod(size[c] for c in rows), math.prod(size[c] for c in contracted)
    xs = xs.reshape((math.prod(size[c] for c in batch), n_rows, n_in) if batch else (n_rows, n_in))
    y = cpu_kernels.rows_dot(xs, *_kernel_operand(w.transposed)).reshape([size[c] for c in batch + rows + outputs])
    return jnp.einsum(f"{batch}{rows}{outputs}->{out_sub}", y)


def with_transposed(w: Int8Weight) -> Int8Weight:
    """An int8 weight that also holds its values transposed, `[..., out, in]`, for products of a few
    rows (`rowwise_matmul`), as `as_bits` does for bf16: XLA:CPU reads int8 `[out, in]` values
    in a one-row product at ~8 GB/s, ~3.5x faster than the `[in, out]` values it first widens and
    writes out as float32 (24 random 0.5 MB experts: 1.5 against 5.3 ms; docs/performance.md).
    Traced values (a program given int8 arrays) get no copy, nor does a weight that has one."""
    if w.transposed is not None or isinstance(w.q, jax.core.Tracer):
        return w
    one_device = isinstance(w.q, jax.Array) and len(w.q.sharding.device_set) == 1
    return dataclasses.replace(w, transposed=swapped_copy(w.q), one_device=one_device)


def swapped_copy(x: jax.Array) -> jax.Array:
    """A copy of `x` with the last two axes swapped. On one CPU device it is made on the host straight
    into the memory it is then held in (huge pages, `huge_pages.empty`), in threads (`host_copy`):
    6-7 GB/s for a bf16 expert stack on 2 Zen 5 cores, where XLA's transpose (elsewhere) ran 1.6."""
    devices = x.sharding.device_set
    device = next(iter(devices))
    if len(devices) > 1 or device.platform != "cpu":
        return _swap_last(x)
    host = np.asarray(x)
    out = huge_pages.empty((*host.shape[:-2], host.shape[-1], host.shape[-2]), host.dtype)
    host_copy.transpose_into(out, host)
    return jax.device_put(out, device)


@jax.jit
def _swap_last(bits: jax.Array) -> jax.Array:
    return jnp.swapaxes(bits, -1, -2)


def rowwise_matmul(x: jax.Array, w: Bf16Bits | Int8Weight) -> jax.Array:
    """float32 `x [r, i] @ w [i, o]` for a few rows, one row at a time against `w.transposed`
    `[o, i]`: each a product XLA:CPU computes as one fused widen-multiply-reduce over the minor axis
    (see `as_bits`). The weight stays in cache between rows. An int8 weight's rows are scaled after."""
    copy = w.transposed
    if isinstance(copy, StackSlice):  # a layer's copy in its stack (sharded weights: no kernel)
        copy = copy.stack[copy.index]
    wide_t = widen(Bf16Bits(copy) if isinstance(w, Bf16Bits) else copy)
    x = x.astype(jnp.float32)
    rows = [jnp.dot(x[r:r + 1], wide_t.T, precision=jax.lax.Precision.HIGHEST) for r in range(x.shape[0])]
    y = jnp.concatenate(rows) if len(rows) > 1 else rows[0]
    return y * w.scale if isinstance(w, Int8Weight) else y


def kernel_matmul(x: jax.Array, w: Bf16Bits | Int8Weight, index: jax.Array | int = 0,
                  used: jax.Array | None = None) -> jax.Array:
    """float32 `x [r, i] @ w [i, o]` by dsr1's CPU kernel (`cpu_kernels.rows_dot`) on `w.transposed`;
    of a stack `w [..., i, o]`, matrix `index` of its leading axes flattened, read in place (an expert
    of a layer); with `x [g, r, i]` and `index [g]`, each group of rows by its own matrix (a negative
    index: zeros), only its first `used[g]` rows if given (the rest: zeros); many rows, where
    `w.bf16_reads` them, rounded to bf16 (AMX tiles, or `vdpbf16ps`). An int8 weight's rows are scaled
    after."""
    if w.bf16_reads(x.shape[-2]):
        if w.amx_fits():
            return cpu_kernels.amx_rows_dot(x, w.transposed, index, used)
        x = x.astype(jnp.bfloat16)
    y = cpu_kernels.rows_dot(x, *_kernel_operand(w.transposed, index), used)
    if not isinstance(w, Int8Weight):
        return y
    scale = w.scale.reshape(-1, w.shape[-1])[index]
    return y * (scale[:, None] if jnp.ndim(index) else scale)


NATIVE_BF16_ROWS = 16


def native_bf16(w: Any, rows: int) -> bool:
    """Whether `rows x w` (a 2-D `Bf16Bits` weight) runs as a bf16 x bf16 -> float32 dot rather than
    widened. XLA:CPU hands a bf16 dot of many rows to YNNPACK's GEMM, which computes bf16 directly
    (AVX-512 BF16 where the CPU has it): a 32-token prefill at batch 8 on the bench preset 139 -> 106 ms,
    at batch 4 94 -> 77 ms (docs/performance.md). For a few rows (decode) widening is as fast or faster
    and keeps the activations in float32; a weight large enough to be widened in blocks (the lm_head,
    dense MLPs) needs 4x the rows (at 16, the lm_head's bf16 dot made a decode step 25% slower)."""
    if not isinstance(w, Bf16Bits) or w.ndim != 2:
        return False
    return rows >= NATIVE_BF16_ROWS * (4 if w.size > WIDEN_CHUNK_ELEMENTS else 1)


def bf16_dot(x: jax.Array, w: Bf16Bits) -> jax.Array:
    """`x [..., i] @ w [i, o]` in bf16 with a float32 result (see `native_bf16`)."""
    return jnp.dot(x.astype(jnp.bfloat16), jax.lax.bitcast_convert_type(w.bits, jnp.bfloat16),
                   preferred_element_type=jnp.float32)


def widen(w: Any) -> jax.Array:
    """A weight (or int8 values) as float32. bf16 bits are widened exactly (they become the high half
    of a float32) with integer ops, which XLA:CPU keeps next to their use."""
    if isinstance(w, Bf16Bits):
        return jax.lax.bitcast_convert_type(w.bits.astype(jnp.uint32) << 16, jnp.float32)
    return w.astype(jnp.float32)


def einsum(spec: str, x: jax.Array, w: Any, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a plain, `Bf16Bits` or `Int8Weight` weight (the second operand)."""
    matmul, rows = _is_matmul(spec), int(np.prod(x.shape[:-1]))
    if isinstance(w, Bf16Bits) and w.kernel_spec == spec and w.kernel_reads(_kernel_rows(spec, x)):
        # A decode product with a copy laid out for it (attention).
        return _kernel_einsum(spec, x, w).astype(kwargs.get("preferred_element_type") or w.dtype)
    if matmul and isinstance(w, _TransposedCopy) and w.transposed is not None and w.kernel_spec is None:
        dtype = kwargs.get("preferred_element_type") or (w.dtype if isinstance(w, Bf16Bits) else x.dtype)
        # The kernel only for a weight on one device: XLA would gather a sharded operand of it.
        if w.one_device and w.kernel_reads(rows):
            return kernel_matmul(x.reshape(rows, -1), w).reshape(*x.shape[:-1], -1).astype(dtype)
        if w.reads_transposed(rows, max_rows=1):  # (a larger weight leaves the cache between rows)
            return rowwise_matmul(x.reshape(1, -1), w).reshape(*x.shape[:-1], -1).astype(dtype)
    if isinstance(w, Bf16Bits):
        if matmul and native_bf16(w, rows):
            return bf16_dot(x, w).astype(kwargs.get("preferred_element_type") or w.dtype)
        if w.reads_wide(rows):
            out = jnp.einsum(spec, x.astype(jnp.float32), w.wide, **kwargs)
        elif matmul and w.one_device and w.size > WIDEN_CHUNK_ELEMENTS:
            out = _chunked_matmul(x.astype(jnp.float32), w, **kwargs)
        else:
            out = jnp.einsum(spec, x.astype(jnp.float32), widen(w), **kwargs)
        return out.astype(kwargs.get("preferred_element_type") or w.dtype)
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x.astype(w.dtype), w, **kwargs)
    x_sub, w_sub, out_sub = _subscripts(spec)
    if "..." in w_sub or len(w_sub) != w.q.ndim:
        raise ValueError(f"einsum {spec!r}: the weight needs one subscript per axis")
    scale_sub = "".join(c for i, c in enumerate(w_sub) if i not in w.input_axes)
    dtype = kwargs.get("preferred_element_type") or x.dtype
    if widens_on_use():
        x = x.astype(jnp.float32)
    q = widen(w.q) if widens_on_use() else w.q.astype(x.dtype)
    if all(c in x_sub for c in scale_sub) and not all(c in out_sub for c in scale_sub):
        # An output channel of the weight is contracted here (absorbed decode): scale the input instead.
        x = jnp.einsum(f"{x_sub},{scale_sub}->{x_sub}", x, w.scale.astype(x.dtype))
        return jnp.einsum(spec, x, q, **kwargs).astype(dtype)
    # Keep the scale's axes that the product contracts (experts summed over), scale, then sum them.
    wide = out_sub + "".join(c for c in scale_sub if c not in out_sub)
    y = jnp.einsum(f"{x_sub},{w_sub}->{wide}", x, q, **kwargs)
    y = jnp.einsum(f"{wide},{scale_sub}->{wide}", y, w.scale.astype(y.dtype))
    return y.sum(axis=tuple(range(len(out_sub), len(wide)))).astype(dtype)


def _kernel_rows(spec: str, x: jax.Array) -> int:
    """The rows of each of a kernel einsum's products (x's axes that the weight does not have)."""
    x_sub = _subscripts(spec)[0]
    return math.prod(x.shape[x_sub.index(c)] for c in product_axes(spec)[3])


WIDEN_CHUNK_ELEMENTS = 1 << 19  # float32 elements widened at a time (2 MB: a core's cache holds them)


def _is_matmul(spec: str) -> bool:
    """Whether `spec` is `x [..., i] @ w [i, o]` (what `matmul` and the lm_head compute)."""
    x_sub, w_sub, out = _subscripts(spec)
    return (len(w_sub) == 2 and x_sub.startswith("...") and x_sub[3:] == w_sub[0] and out.startswith("...")
            and out[3:] == w_sub[1])


def _chunked_matmul(x: jax.Array, w: Bf16Bits, **kwargs) -> jax.Array:
    """`x [..., i] @ w [i, o]` for a large bf16 weight, widened a block of output columns at a time:
    widened whole, its float32 copy (twice the weight) goes to memory and back, and for a few rows
    that costs more than the product (the lm_head: about a third of a 32-token prefill on the bench
    preset). A block stays in cache between its widening and its product."""
    rows, cols = w.shape
    block = max(128, WIDEN_CHUNK_ELEMENTS // rows // 128 * 128)
    full = cols // block

    def product(bits: jax.Array) -> jax.Array:
        return jnp.einsum("...i,io->...o", x, widen(Bf16Bits(bits, one_device=w.one_device)), **kwargs)

    out = jax.lax.map(lambda i: product(jax.lax.dynamic_slice_in_dim(w.bits, i * block, block, axis=1)),
                      jnp.arange(full))  # [full, ..., block]
    out = jnp.moveaxis(out, 0, -2).reshape(*x.shape[:-1], full * block)
    if full * block == cols:
        return out
    return jnp.concatenate([out, product(w.bits[:, full * block:])], axis=-1)


def matmul(x: jax.Array, w: Any) -> jax.Array:
    """`x @ w` for a plain or `Int8Weight` `[in, out]` weight."""
    return einsum("...i,io->...o", x, w)


def ragged_dot(x: jax.Array, w: Any, group_sizes: jax.Array, experts: jax.Array) -> jax.Array:
    """Grouped matmul of rows sorted by expert against `[E, in, out]` expert weights (float32 out).

    int8 experts enter `ragged_dot` as int8 (mixed bf16 x int8), then each row is scaled by its
    expert's output-channel scales: no dequantized copy of the expert stack is ever built.
    """
    if isinstance(w, Bf16Bits):  # CPU, where the model runs the expert loop instead (`bench moe` compares)
        return jax.lax.ragged_dot(x.astype(jnp.float32), widen(w), group_sizes, preferred_element_type=jnp.float32)
    if not isinstance(w, Int8Weight):
        return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(x, w.q, group_sizes, preferred_element_type=jnp.float32)
    return y * w.scale[jnp.minimum(experts, w.q.shape[0] - 1)]
