"""The CPU backend's weight layouts: bf16 weights as their bits, and copies laid out for few-row products.

XLA:CPU normalizes bf16 slices and loop operands to float32 and hoists that `convert` of a whole
weight stack out of the layer scan, on every call. `Bf16Bits` holds a bf16 weight as its uint16 bits
(a free bitcast) so that XLA treats it as integers, and the backend widens the slice in use
(`products.to_float32`). Decode multiplies a few rows against each weight; dsr1's kernel
(`ffi.rows_dot`) reads a weight laid out `[..., out, in]` for that, so the matrices of `x @ W`
products (routed experts, MLPs, `q_a`, `kv_a`, the output heads) also hold such a copy
(`transposed`), and the attention weights of `dsr1.core.attention.DECODE_PRODUCTS` a copy laid out
for their einsum
(`kernel_layout`). int8 weights keep their values transposed the same way (`Int8Rows`).

These layouts exist only where `dsr1.cpu.enabled` says so: `view` makes them from plain weights.
Everywhere else the weights are held as their dtype says, and nothing is copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..core.attention import DECODE_PRODUCTS
from ..core.backend import HeldWeight
from ..core.params import is_output_head, multiplies_last_two_axes
from ..core.quant import Int8Weight, subscripts
from ..host import copy as host_copy
from ..host import huge_pages
from . import ffi

# The rows from which a product of a bf16 weight runs as a bf16 dot (`products.native_bf16`).
NATIVE_BF16_ROWS = 16


class Laid(HeldWeight):
    """A weight in one of the backend's layouts, which may also hold its values with the last two axes
    swapped (`transposed`, `[..., out, in]`) for products of a few rows. Its `backend` is
    `dsr1.cpu.backend.CPU`."""

    transposed: Any
    one_device: bool
    kernel_spec = None  # `Bf16Bits` only: the einsum a copy is laid out for
    # The most rows of an expert (which stays in cache between its rows) that read the copy one row
    # at a time where the kernel does not (a sharded weight): bf16 2, int8 4.
    expert_rows: ClassVar[int] = 2

    def reads_transposed(self, rows: int, max_rows: int | None = None) -> bool:
        """Whether a product of `rows` rows reads the transposed copy one row at a time with XLA
        (`products.rowwise_matmul`), where held: up to `max_rows`, by default `expert_rows`."""
        return self.transposed is not None and rows <= (self.expert_rows if max_rows is None else max_rows)

    def kernel_reads(self, rows: int) -> bool:
        """Whether a product of `rows` rows reads the transposed copy with dsr1's kernel
        (`products.kernel_matmul`): up to `ffi.KERNEL_ROWS`, where the kernel is built."""
        return self.transposed is not None and rows <= ffi.KERNEL_ROWS and ffi.available()

    def bf16_reads(self, rows: int) -> bool:
        """Whether a product of many rows (a prefill's expert blocks) reads the transposed copy in place
        with bf16 instructions, the rows rounded to bf16: `Bf16Bits` only."""
        return False

    def block_reads(self, rows: int) -> bool:
        """Whether an expert loop's blocks of `rows` rows read the transposed copy in place with dsr1's
        kernel: a few rows (`kernel_reads`), or many where `bf16_reads`."""
        return self.kernel_reads(rows) or self.bf16_reads(rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Rows(Int8Weight, Laid):
    """An int8 weight that may also hold its values transposed, `[..., out, in]` (`with_transposed`):
    XLA:CPU reads int8 `[out, in]` values in a one-row product several times faster than the
    `[in, out]` values it first widens and writes out as float32; dsr1's kernel reads them for any
    number of rows, widening in registers, a block of rows per pass over the weight."""

    transposed: Any = None
    one_device: bool = dataclasses.field(default=False, metadata=dict(static=True))
    expert_rows: ClassVar[int] = 4

    def kernel_reads(self, rows: int) -> bool:
        """int8: dsr1's kernel at any number of rows (XLA widens the whole weight, or each expert block's
        slice, to float32 in memory first)."""
        return self.transposed is not None and ffi.available()

    @property
    def nbytes(self) -> int:
        """Bytes held: the values, their scales and the transposed copy where there is one."""
        return self.bytes_read() + (0 if self.transposed is None else self.transposed.nbytes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bf16Bits(Laid):
    """A bf16 weight seen as its uint16 bits (a free bitcast), so that XLA:CPU treats it as integers.
    `one_device`: the weight is whole on one device, so a large product may widen it a block of
    output columns at a time; a block of a sharded axis would gather the weight."""

    bits: Any  # uint16, the weight's shape
    one_device: bool = dataclasses.field(default=False, metadata=dict(static=True))
    transposed: Any = None  # the bits with the last two axes swapped, or laid out for `kernel_spec`
    # The einsum whose decode products the kernel computes on `transposed`, laid out for it (`as_bits`);
    # None: `transposed` is the `[..., out, in]` copy of an `x @ W` weight.
    kernel_spec: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    def bf16_reads(self, rows: int) -> bool:
        """Blocks of many rows (a prefill's expert blocks: where XLA's bf16 dot would run, `native_bf16`,
        rounding the rows to bf16 as it does) read the transposed copy in place, with AMX tiles on a
        CPU that has them (`amx_fits`), else with `vdpbf16ps` where the kernel multiplies bf16 rows
        (`ffi.bf16_rows`): XLA's dot of a block needs the expert's slice copied out first."""
        return self.transposed is not None and rows >= NATIVE_BF16_ROWS and (self.amx_fits() or ffi.bf16_rows())

    def amx_fits(self) -> bool:
        """Whether products of many rows take AMX tiles: sizes multiples of 32, on a CPU with AMX."""
        return self.shape[-1] % 32 == 0 and self.shape[-2] % 32 == 0 and ffi.amx_available()

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    @property
    def sharding(self):
        return self.bits.sharding

    @property
    def nbytes(self) -> int:
        """Bytes held: the bits, and the transposed copy where there is one (a weight already laid out
        for the kernel holds no copy: `transposed` is `bits`)."""
        copy = self.transposed
        return self.bits.nbytes + (0 if copy is None or copy is self.bits else copy.nbytes)

    def bytes_read(self, rows: int) -> int:
        """Bytes a product of `rows` rows reads (the transposed copy is the bits' size)."""
        return self.bits.nbytes

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackSlice(HeldWeight):
    """Matrix `index` of a weight copy's stack `[L, ...]`, read in place by the kernel: a layer scan
    gives the kernel copies of its weights this way (`in_place_copies`), not sliced out (a copy), and
    the router of its layer (`CpuBackend.router_in_stack`)."""

    stack: Any
    index: Any


def is_laid(w: Any) -> bool:
    """Whether `w` is held in one of the backend's layouts."""
    return isinstance(w, Laid)


def _has_copy(w: Any) -> bool:
    return is_laid(w) and w.transposed is not None


def in_place_copies(p: Any) -> tuple[Any, Any]:
    """A layer stack's weights as (without the kernel copies `transposed`, those copies' stacks) for a
    layer scan: it slices the first, and `with_layer_copies` puts the second back in place."""
    def strip(w: Any) -> Any:
        return dataclasses.replace(w, transposed=None) if _has_copy(w) else w

    def copy(w: Any) -> Any:
        return w.transposed if _has_copy(w) else None

    return jax.tree.map(strip, p, is_leaf=is_laid), jax.tree.map(copy, p, is_leaf=is_laid)


def with_layer_copies(p: Any, copies: Any, layer: jax.Array) -> Any:
    """One layer's weights (sliced by a layer scan) with their kernel copies read in place from the
    stacks in `copies` (`in_place_copies`) at `layer`."""
    def put(w: Any, stack: Any) -> Any:
        return w if stack is None else dataclasses.replace(w, transposed=StackSlice(stack, layer))

    return jax.tree.map(put, p, copies, is_leaf=is_laid)


def kernel_operand(copy: Any, index: jax.Array | int = 0) -> tuple[jax.Array, jax.Array | int]:
    """The array the kernel reads and the index of the matrix in it: a layer's copy in its stack
    (`StackSlice`: one matrix, or one group of them, per layer), or the copy itself."""
    if isinstance(copy, StackSlice):
        assert isinstance(index, int) and index == 0, "a layer's copy is one matrix"
        return copy.stack, copy.index
    return copy, index


def as_bits(w: jax.Array, *, keep_transposed: bool = False, kernel_spec: str | None = None, stacked: int = 0,
            transposed: jax.Array | None = None) -> Bf16Bits:
    """A bf16 weight as `Bf16Bits`. An array on one device is reinterpreted through a host view (no
    program compiled per shape); a sharded or traced one by a bitcast.

    `keep_transposed` also holds the bits with the last two axes swapped (`[..., out, in]`) for
    products of few rows; products of more rows (prefill) read the `[in, out]` bits, so both are held.
    `kernel_spec` instead holds the bits laid out for the kernel's products of the einsum
    `kernel_spec` (`kernel_layout`; an array on one device only), past `stacked` leading axes
    (layers). A traced weight (a program given bf16 arrays) gets no copy: made on every call, it would
    cost more than it saves. `transposed`: the `keep_transposed` copy made already (uint16 bits on
    `w`'s device: the loader's)."""
    traced = isinstance(w, jax.core.Tracer)
    if isinstance(w, jax.Array) and not traced and len(w.sharding.device_set) == 1:
        device = next(iter(w.sharding.device_set))
        bits = jax.device_put(np.asarray(w).view(np.uint16), device)
        if kernel_spec is not None:  # (laid out as it is, as `W_UV`: the bits themselves, no copy)
            laid = bits if _laid_out_already(kernel_spec) else kernel_layout(bits, kernel_spec, stacked)
            return Bf16Bits(bits, one_device=True, transposed=laid, kernel_spec=kernel_spec)
        if keep_transposed and transposed is None:
            transposed = swapped_copy(bits)
        return Bf16Bits(bits, one_device=True, transposed=transposed if keep_transposed else None)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    return Bf16Bits(bits, transposed=_swap_last(bits) if keep_transposed and not traced else None)


def product_axes(spec: str) -> tuple[str, str, str, str] | None:
    """The weight's batch, output and contracted subscripts in `spec` (`x, w -> out`, explicit
    subscripts), and x's rows (its other subscripts, kept in the output); None for other einsums."""
    x_sub, w_sub, out = subscripts(spec)
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
    in_order = batch + outputs + contracted == subscripts(spec)[1]
    return in_order and len(batch) <= 1 and len(outputs) == len(contracted) == 1


@functools.partial(jax.jit, static_argnums=(1, 2))
def kernel_layout(bits: jax.Array, spec: str, stacked: int = 0) -> jax.Array:
    """A weight's bits `[stack..., w]` laid out for the kernel's products of the einsum `spec`:
    `[stack..., (batch,) out, in]`, each its subscripts flattened (batch: heads multiplied each by
    their own rows; none, no axis)."""
    batch, outputs, contracted, _ = product_axes(spec)
    w_sub = subscripts(spec)[1]
    axis = {c: stacked + i for i, c in enumerate(w_sub)}
    laid = jnp.transpose(bits, (*range(stacked), *(axis[c] for c in batch + outputs + contracted)))
    size = {c: bits.shape[axis[c]] for c in w_sub}
    groups = (math.prod(size[c] for c in batch),) if batch else ()
    return laid.reshape(*bits.shape[:stacked], *groups, math.prod(size[c] for c in outputs),
                        math.prod(size[c] for c in contracted))


def with_transposed(w: Int8Weight, keep: bool = True) -> Int8Rows:
    """An int8 weight as `Int8Rows`, holding its values transposed, `[..., out, in]`, where `keep`.
    Traced values (a program given int8 arrays) get no copy, nor does a weight that has one."""
    if isinstance(w, Int8Rows) and (w.transposed is not None or not keep):
        return w
    concrete = isinstance(w.q, jax.Array) and not isinstance(w.q, jax.core.Tracer)
    one_device = concrete and len(w.q.sharding.device_set) == 1
    copy = swapped_copy(w.q) if keep and concrete else None
    return Int8Rows(w.q, w.scale, w.input_axes, transposed=copy, one_device=one_device)


def swapped_copy(x: jax.Array) -> jax.Array:
    """A copy of `x` with the last two axes swapped. On one CPU device it is made on the host straight
    into the memory it is then held in (huge pages, `huge_pages.empty`), in threads (`host_copy`)."""
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


def laid_out(path: tuple, spec: Any, w: Any) -> Any:
    """One weight (`spec`: its declaration, `dsr1.core.params.ArrayInfo`) in the backend's layout:
    every int8 weight as `Int8Rows` (the matrices of `x @ W` products with their values transposed);
    every bf16 matrix (not the norms) as `Bf16Bits`, the attention weights of `DECODE_PRODUCTS` laid
    out for those products, the matrices of `x @ W` products and the output heads with their bits
    transposed. Other weights as they are. Idempotent."""
    if isinstance(w, Int8Weight):
        return with_transposed(w, keep=multiplies_last_two_axes(spec))
    if spec.init != "normal" or isinstance(w, Bf16Bits) or w.dtype != jnp.bfloat16:
        return w
    name = getattr(path[-1], "key", None)
    if name in DECODE_PRODUCTS:
        return as_bits(w, kernel_spec=DECODE_PRODUCTS[name], stacked=int(spec.axes[0] == "layers"))
    return as_bits(w, keep_transposed=holds_transposed_bits(name, spec, w.dtype))


def holds_transposed_bits(name: str | None, spec: Any, dtype: Any) -> bool:
    """Whether the layout of the weight `name` (`spec`, held in `dtype`) is bf16 bits with a transposed
    copy, `[..., out, in]`: the matrices of `x @ W` products and the output heads (the loader makes
    that copy itself, layer by layer, where it can: `dsr1.weights.loading`)."""
    if spec.init != "normal" or jnp.dtype(dtype) != jnp.bfloat16 or name in DECODE_PRODUCTS:
        return False
    return multiplies_last_two_axes(spec) or is_output_head(spec)


def partition_spec(w: Any, spec: Any, swapped: Any, scale: Any) -> Any:
    """The shard_map spec of a weight in a layout, given the weight's spec, its spec with the last two
    axes swapped (the transposed copy is split like the weight) and its int8 scales' spec."""
    transposed = None if w.transposed is None else swapped
    if isinstance(w, Bf16Bits):
        return Bf16Bits(spec, one_device=w.one_device, transposed=transposed)
    return Int8Rows(spec, scale, w.input_axes, transposed, w.one_device)
