"""dsr1's own CPU kernel: `rows_dot`, a few float32 rows against one bf16 or int8 matrix (decode).

XLA:CPU reads a transposed bf16 or int8 weight at memory speed in a one-row product, but from two
rows on it first writes out a widened float32 copy of the weight and reads that. `rows_dot`
(kernels/rows_dot.cc, an XLA FFI handler) reads each weight row once for blocks of up to 8 rows,
widening it in registers, splits the output over threads of its own (one per core beside the caller,
which look for work for 200 us before they sleep: a decode step calls it every few microseconds),
and takes the matrix by its index in a stack, so an expert of a layer is read in place; with an
index per group of rows, one call runs every block of an expert loop. A bf16 model's rows
(activations, exact bf16) are multiplied as bf16 with AVX-512 BF16's `vdpbf16ps` where the CPU runs
it fast (`bf16_rows`). `amx_rows_dot` does the same for blocks of many bf16 rows (a prefill's) on
AMX tiles, where the CPU has them. Built on the same row products: a decode step's routed experts
from the router's pairs (`swiglu_pairs`, `combine_pairs`) and its absorbed MLA attention against the
bf16 cache (`mla_decode_context`), each in place of tens of small XLA operations.

The kernel is compiled on first use with the system's C++ compiler for the CPU it runs on (x86-64
with AVX-512, or AVX2 and FMA) and cached under `$DSR1_KERNEL_CACHE` (default
`~/.cache/dsr1/kernels`), keyed by the sources, the compiler, jaxlib and the CPU (`dsr1.host.native`);
building it also builds the host copies that loading runs (`dsr1.host.copy`). Without a compiler,
on another CPU, or with `DSR1_CPU_KERNELS=0`, `available()` is False and dsr1 computes these
products with XLA's own operations. Which devices the kernels serve is `dsr1.cpu.enabled`'s choice.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import warnings
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp

from ..host import copy as host_copy
from ..host import native

SOURCES = ("rows_dot.cc",)  # in kernels/
KERNEL_ROWS = 8  # the kernel's block: more rows re-read the weight per block (prefill: AMX, or XLA's bf16 dot)
_WEIGHTS = {jnp.dtype(jnp.uint16): "bf16", jnp.dtype(jnp.int8): "int8"}  # the handlers' names end so


def available() -> bool:
    """Whether the kernels run: built (on first call), unless `DSR1_CPU_KERNELS=0`. Which devices they
    run for is `dsr1.cpu.enabled`'s choice."""
    return library() is not None


# vdpbf16ps per float32 FMA from which bf16 rows pay off: each does twice the multiply-adds and needs
# no widening of the weight (some CPUs retire it at nearly the FMA rate, others at a quarter).
BF16_DOT_RATE = 0.5
# From this many rows: fewer are bound by memory either way, and in cache one row runs faster widened.
BF16_ROWS_MIN = 4


def bf16_rows() -> bool:
    """Whether `rows_dot` multiplies bf16 rows (a bf16 model's activations) against bf16 weights as
    bf16, with AVX-512 BF16's `vdpbf16ps`, instead of widening both to float32: where the kernel was
    built with it and the CPU retires it at least `BF16_DOT_RATE` times as often as a float32 FMA
    (measured once per process). `DSR1_BF16_ROWS=0` turns it off, `=1` on wherever it is
    built. The products and their float32 sums are those of the float32 path, summed in another order:
    the rows are exact bf16 already."""
    choice = os.environ.get("DSR1_BF16_ROWS", "")
    if choice == "0" or not available():
        return False
    rate = _bf16_dot_rate()
    return rate > 0 and (choice == "1" or rate >= BF16_DOT_RATE)


@functools.cache
def _bf16_dot_rate() -> float:
    """vdpbf16ps per float32 FMA on this CPU (0: the kernel was built without AVX-512 BF16)."""
    lib = _registered()
    lib.dsr1_bf16_dot_rate.restype = ctypes.c_double
    return float(lib.dsr1_bf16_dot_rate())


def rows_dot(x: jax.Array, w: jax.Array, index: jax.Array | int = 0, used: jax.Array | None = None) -> jax.Array:
    """float32 `x [rows, in] @ w[index].T` for `w [..., out, in]` of bf16 bits (uint16) or int8
    values: matrix `index` of the stack's leading axes flattened, read in place (clamped to the
    stack). With `x [g, rows, in]`, `g` independent products (heads) against `w [..., g, out, in]`,
    giving `[g, rows, out]`; or, with `index [g]`, each group of rows against its own matrix
    `w[index[g]]` of `w [..., out, in]` (an expert loop's blocks, in one call), a negative index
    giving zeros; `used [g]` there: the rows of each group that count, its first `used[g]` (the rest
    of its output zeros, not computed: blocks padded to a whole block), by default all. bf16 `x` of at
    least `BF16_ROWS_MIN` rows against bf16 bits stays bf16 where `bf16_rows()`. Needs `available()`."""
    if w.dtype not in _WEIGHTS:
        raise TypeError(f"rows_dot: weight dtype {w.dtype} is neither bf16 bits (uint16) nor int8")
    each = jnp.ndim(index) == 1
    grouped = x.ndim == 3
    xg = x if grouped else x[None]
    heads = grouped and not each
    if (xg.ndim != 3 or w.ndim < 2 + heads or w.shape[-1] != xg.shape[2] or heads and w.shape[-3] != xg.shape[0]
            or each and jnp.shape(index) != (xg.shape[0],)
            or used is not None and (not each or jnp.shape(used) != (xg.shape[0],))):
        raise ValueError(f"rows_dot: x {x.shape} is not [(g,) rows, in] against w {w.shape} [..., (g,) out, in]"
                         f" with index {jnp.shape(index)} (one, or one per group) and used rows "
                         f"{None if used is None else jnp.shape(used)} (one count per index)")
    out = jax.ShapeDtypeStruct((xg.shape[0], xg.shape[1], w.shape[-2]), jnp.float32)
    as_bf16 = xg.dtype == jnp.bfloat16 and w.dtype == jnp.uint16 and xg.shape[1] >= BF16_ROWS_MIN and bf16_rows()
    call = jax.ffi.ffi_call(_target(_WEIGHTS[w.dtype], each, as_bf16), out, vmap_method="sequential")
    rows = jax.lax.bitcast_convert_type(xg, jnp.uint16) if as_bf16 else xg.astype(jnp.float32)
    operands = (rows, w, jnp.asarray(index, jnp.int32))
    y = call(*operands, _used_rows(used, xg.shape)) if each else call(*operands)
    return y if grouped else y[0]


def _used_rows(used: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """`used` as the kernel's int32 count per group of `[g, rows, in]` rows: all of them by default."""
    return jnp.full(shape[:1], shape[1], jnp.int32) if used is None else jnp.asarray(used, jnp.int32)


def swiglu_rows_dot(x: jax.Array, gate: jax.Array, up: jax.Array, index: jax.Array,
                    used: jax.Array | None = None) -> jax.Array:
    """`SiLU(x[g] @ gate[index[g]].T) * (x[g] @ up[index[g]].T)`, float32 `[g, rows, out]`, for float32
    `x [g, rows, in]` against bf16 bits `gate`, `up [..., out, in]` (an expert loop's blocks: each
    against its expert, read in place; a negative index gives zeros, and so do the rows of group g
    from `used[g]` on, default none): the first two products of an expert and their SwiGLU in one
    call. Needs `available()`."""
    if gate.dtype != jnp.uint16 or gate.shape != up.shape or gate.shape[-1] != x.shape[-1] or x.ndim != 3 \
            or jnp.shape(index) != x.shape[:1] or used is not None and jnp.shape(used) != x.shape[:1]:
        raise ValueError(f"swiglu_rows_dot: x {x.shape} against bf16 bits gate {gate.shape} {gate.dtype} and up "
                         f"{up.shape} with index {jnp.shape(index)}, used {None if used is None else jnp.shape(used)}"
                         ": x [g, rows, in], [..., out, in], index and used [g]")
    out = jax.ShapeDtypeStruct((*x.shape[:2], gate.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call("dsr1_swiglu_rows_dot", out, vmap_method="sequential")
    return call(x.astype(jnp.float32), gate, up, jnp.asarray(index, jnp.int32), _used_rows(used, x.shape))


def combine_rows_dot(h: jax.Array, down: jax.Array, index: jax.Array, token: jax.Array, weight: jax.Array,
                     tokens: int, used: jax.Array | None = None) -> jax.Array:
    """float32 `[tokens, out]`: the sum over groups g and rows r of `weight[g, r] * (h[g, r] @
    down[index[g]].T)` added to token `token[g, r]`, for `h [g, rows, in]` against bf16 bits `down [...,
    out, in]` (an expert loop's last product and the routing-weighted sum of each token's experts, in
    one call); a negative index skips a group, a token outside [0, tokens) a row, and only the first
    `used[g]` rows of group g count (default: all). bf16 `h` of at least `BF16_ROWS_MIN` rows stays
    bf16 where `bf16_rows()` (a prefill's blocks). Needs `available()`."""
    if down.dtype != jnp.uint16 or down.shape[-1] != h.shape[-1] or h.ndim != 3 or jnp.shape(index) != h.shape[:1] \
            or jnp.shape(token) != h.shape[:2] or jnp.shape(weight) != h.shape[:2] \
            or used is not None and jnp.shape(used) != h.shape[:1]:
        raise ValueError(f"combine_rows_dot: h {h.shape} against bf16 bits down {down.shape} {down.dtype}, index "
                         f"{jnp.shape(index)}, token {jnp.shape(token)}, weight {jnp.shape(weight)}, used "
                         f"{None if used is None else jnp.shape(used)}: h [g, rows, in], down [..., out, in], index "
                         "and used [g], token and weight [g, rows]")
    out = jax.ShapeDtypeStruct((tokens, down.shape[-2]), jnp.float32)
    as_bf16 = h.dtype == jnp.bfloat16 and h.shape[1] >= BF16_ROWS_MIN and bf16_rows()
    call = jax.ffi.ffi_call(f"dsr1_{'bf16_' if as_bf16 else ''}combine_rows_dot", out, vmap_method="sequential")
    rows = jax.lax.bitcast_convert_type(h, jnp.uint16) if as_bf16 else h.astype(jnp.float32)
    return call(rows, down, jnp.asarray(index, jnp.int32), _used_rows(used, h.shape), jnp.asarray(token, jnp.int32),
                weight.astype(jnp.float32))


def swiglu_pairs(x: jax.Array, matrix: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """Each token-expert pair's `SiLU(x[t] @ gate[matrix[t, j]].T) * (x[t] @ up[matrix[t, j]].T)`, float32
    `[tokens, k, out]`, for `x [tokens, in]` against bf16 bits `gate`, `up [..., out, in]` (an expert
    stack, its leading axes flattened): a decode step's routed pairs as the router chose them, grouped
    by matrix in the kernel (each hit expert read once for all its rows, in place); a negative matrix
    (another device's expert) gives zeros. Needs `available()`."""
    if (gate.dtype != jnp.uint16 or gate.shape != up.shape or x.ndim != 2 or gate.shape[-1] != x.shape[1]
            or matrix.ndim != 2 or matrix.shape[0] != x.shape[0]):
        raise ValueError(f"swiglu_pairs: x {x.shape} against bf16 bits gate {gate.shape} {gate.dtype} and up "
                         f"{up.shape} with matrix {matrix.shape}: x [tokens, in], matrix [tokens, k], [..., out, in]")
    out = jax.ShapeDtypeStruct((*matrix.shape, gate.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call("dsr1_swiglu_pairs", out, vmap_method="sequential")
    return call(x.astype(jnp.float32), jnp.asarray(matrix, jnp.int32), gate, up)


def combine_pairs(h: jax.Array, matrix: jax.Array, weight: jax.Array, down: jax.Array) -> jax.Array:
    """float32 `[tokens, out]`: for each token t the sum over its pairs j of `weight[t, j] * (h[t, j] @
    down[matrix[t, j]].T)`, for `h [tokens, k, in]` against bf16 bits `down [..., out, in]`: the last
    product of `swiglu_pairs`' experts and the routing-weighted sum of each token's experts in one
    call; a negative matrix skips its pair. Needs `available()`."""
    if (down.dtype != jnp.uint16 or h.ndim != 3 or down.shape[-1] != h.shape[-1] or jnp.shape(matrix) != h.shape[:2]
            or jnp.shape(weight) != h.shape[:2]):
        raise ValueError(f"combine_pairs: h {h.shape} against bf16 bits down {down.shape} {down.dtype}, matrix "
                         f"{jnp.shape(matrix)}, weight {jnp.shape(weight)}: h [tokens, k, in], matrix and weight "
                         "[tokens, k], down [..., out, in]")
    out = jax.ShapeDtypeStruct((h.shape[0], down.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call("dsr1_combine_pairs", out, vmap_method="sequential")
    return call(h.astype(jnp.float32), jnp.asarray(matrix, jnp.int32), weight.astype(jnp.float32), down)


def rows_matmul(x: jax.Array, w: jax.Array, index: jax.Array | int = 0) -> jax.Array:
    """float32 `x [rows, in] @ w[index]` for a float32 stack `w [..., in, out]` (not transposed: the
    router's layout), matrix `index` of its leading axes flattened, read in place (clamped to the
    stack): a decode step's router logits without slicing the layer's router out of its stack. Sums
    in input order per output. Needs `available()`."""
    if x.ndim != 2 or w.ndim < 2 or w.dtype != jnp.float32 or w.shape[-2] != x.shape[1]:
        raise ValueError(f"rows_matmul: x {x.shape} against float32 w {w.shape} {w.dtype}: x [rows, in], "
                         "w [..., in, out]")
    call = jax.ffi.ffi_call("dsr1_rows_matmul_f32", jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w, jnp.asarray(index, jnp.int32).reshape(1))


def mla_decode_context(q: jax.Array, q_pe: jax.Array, c_kv: jax.Array, k_pe: jax.Array, layer: jax.Array | int,
                       lengths: jax.Array, own_c: jax.Array, own_pe: jax.Array, scale: float,
                       page_table: jax.Array | None = None, c_scale: jax.Array | None = None) -> jax.Array:
    """Absorbed MLA attention of one new token per row: the context `[B, H, r]` (float32) of queries
    `q [B, H, r]`, `q_pe [B, H, rope]` over the first `lengths[b]` positions of layer `layer` of a
    cache of bf16 bits (uint16), read in place, and the new token's own latent `own_c [B, r]`,
    `own_pe [B, rope]` (bf16 values) as one more key. The cache is contiguous, `c_kv [layers, B, S, r]`,
    `k_pe [layers, B, S, rope]`, or (given `page_table [B, P]`, row b's pages in order) a page pool
    `c_kv [layers, pages, page_size, r]`, `k_pe [layers, pages, page_size, rope]`; an int8 cache's
    `c_kv` is int8 with a float32 scale per position `c_scale` (`c_kv`'s shape but the last axis).
    Scores `(q . c + q_pe . pe) * scale`, one softmax, the probabilities rounded to bf16 before their
    sum over the latents, as `attention`'s XLA path computes them (an int8 cache's scales multiply
    the latent products, and the probabilities before they are rounded). bf16 queries are scored, and
    (at latent widths of multiples of 32) the values summed, as bf16 with `vdpbf16ps` where
    `bf16_rows()` (int8 latents made bf16 exactly: the same products, summed in another order), others
    in float32. Needs `available()`."""
    b, h, r = q.shape if q.ndim == 3 else (0, 0, 0)
    rope = q_pe.shape[-1]
    if page_table is None:  # a contiguous cache: B pages of S positions, one per row
        page_table = jnp.arange(b, dtype=jnp.int32)[:, None]
        if c_kv.ndim == 4 and c_kv.shape[1] != b:
            raise ValueError(f"mla_decode_context: a contiguous cache c_kv {c_kv.shape} holds {c_kv.shape[1]} rows "
                             f"for queries q {q.shape} of {b}")
    int8 = c_kv.dtype == jnp.int8
    if int8 != (c_scale is not None) or (int8 and c_scale.shape != c_kv.shape[:3]):
        raise ValueError(f"mla_decode_context: c_kv {c_kv.shape} {c_kv.dtype} with c_scale "
                         f"{None if c_scale is None else c_scale.shape}: int8 latents take a scale per position "
                         "(c_scale [layers, pages, page_size]), bf16 bits none")
    if (q.ndim != 3 or c_kv.dtype not in (jnp.uint16, jnp.int8) or k_pe.dtype != jnp.uint16
            or q_pe.shape != (b, h, rope)
            or c_kv.ndim != 4 or c_kv.shape[3] != r or k_pe.shape != (*c_kv.shape[:3], rope)
            or jnp.shape(lengths) != (b,) or jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != b
            or own_c.shape != (b, r) or own_pe.shape != (b, rope)):
        raise ValueError(f"mla_decode_context: q {q.shape}, q_pe {q_pe.shape}, c_kv {c_kv.shape} "
                         f"{c_kv.dtype} and k_pe {k_pe.shape} {k_pe.dtype}, lengths {jnp.shape(lengths)}, page_table "
                         f"{jnp.shape(page_table)}, own_c {own_c.shape}, own_pe {own_pe.shape}: q [B, H, r], q_pe "
                         "[B, H, rope], c_kv [layers, pages, page_size, r], k_pe [layers, pages, page_size, rope], "
                         "lengths [B], page_table [B, P], own_c [B, r], own_pe [B, rope] (c_kv bf16 bits or int8, "
                         "k_pe bf16 bits)")
    f32 = jnp.float32
    as_bf16 = q.dtype == q_pe.dtype == jnp.bfloat16 and bf16_rows()
    name = ("bf16_" if as_bf16 else "") + ("int8_" if int8 else "")
    call = jax.ffi.ffi_call(f"dsr1_{name}mla_decode_context", jax.ShapeDtypeStruct(q.shape, f32),
                            vmap_method="sequential")
    queries = [_bits(x) if as_bf16 else x.astype(f32) for x in (q, q_pe)]
    scales = c_scale.astype(f32) if int8 else jnp.zeros((0,), f32)
    return call(*queries, c_kv, k_pe, scales, jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(lengths, jnp.int32),
                jnp.asarray(page_table, jnp.int32), _bits(own_c), _bits(own_pe), jnp.full((1,), scale, f32))


def _bits(x: jax.Array) -> jax.Array:
    """The bits (uint16) of `x` rounded to bf16."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def amx_available() -> bool:
    """Whether `amx_rows_dot` runs here: `available()`, built for a CPU with AMX (bf16 tiles: Intel
    Xeon since Sapphire Rapids), and Linux grants this process the tile state."""
    return available() and bool(_registered().dsr1_amx())


def amx_rows_dot(x: jax.Array, w: jax.Array, index: jax.Array, used: jax.Array | None = None) -> jax.Array:
    """float32 `x[g] @ w[index[g]].T` for `x [g, rows, in]`, rounded to bf16, against bf16 bits
    `w [..., out, in]` (`in`, `out` multiples of 32) with AMX tiles: many rows per matrix (a
    prefill's expert blocks), each matrix read in place; a negative index gives zeros, and so do the
    rows of a group past its `used` count (as in `rows_dot`). Needs `amx_available()`."""
    g, rows, inputs = x.shape
    if (w.dtype != jnp.uint16 or w.shape[-1] != inputs or inputs % 32 or w.shape[-2] % 32 or jnp.shape(index) != (g,)
            or used is not None and jnp.shape(used) != (g,)):
        raise ValueError(f"amx_rows_dot: x {x.shape} against bf16 bits w {w.shape} {w.dtype} with index "
                         f"{jnp.shape(index)}: in and out must be multiples of 32, one index (and used count) per "
                         "group")
    out = jax.ShapeDtypeStruct((g, rows, w.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call("dsr1_rows_dot_each_amx", out, vmap_method="sequential")
    return call(_bits(x), w, jnp.asarray(index, jnp.int32), _used_rows(used, x.shape))


def _target(weights: str, each: bool, bf16: bool = False) -> str:
    """The kernel's handler for `weights` ("bf16" bits or "int8"): one matrix, or one per group (`each`);
    float32 rows, or `bf16` rows (their bits, against bf16 weights)."""
    return f"dsr1_{'bf16_' if bf16 else ''}rows_dot_{'each_' if each else ''}{weights}"


def library(build: bool = True) -> ctypes.CDLL | None:
    """The built kernel library; None without a compiler, on another CPU, or with `DSR1_CPU_KERNELS=0`.
    `build=False`: only where this process has built it already (for a CPU mesh, `dsr1.cpu.enabled`)."""
    if os.environ.get("DSR1_CPU_KERNELS", "1") == "0" or not (build or _registered.cache_info().currsize):
        return None
    return _registered()


@functools.cache
def _registered() -> ctypes.CDLL | None:
    """Build (or find) the kernel library and register its handlers with XLA, once per process."""
    host_copy.library()  # the host copies too: a process that runs the kernels loads weights for them
    try:
        library = _build()
    except (OSError, subprocess.CalledProcessError) as e:  # a broken compiler: say so, compute without
        warnings.warn(f"dsr1: CPU decode kernel not built ({e}); using XLA's products instead", stacklevel=3)
        return None
    if library is None:
        return None
    lib = ctypes.cdll.LoadLibrary(str(library))
    targets = [_target(weights, each) for weights in _WEIGHTS.values() for each in (False, True)]
    targets += [_target("bf16", each, bf16=True) for each in (False, True)]
    fused = ["dsr1_swiglu_rows_dot", "dsr1_combine_rows_dot", "dsr1_bf16_combine_rows_dot", "dsr1_rows_dot_each_amx",
             "dsr1_swiglu_pairs", "dsr1_combine_pairs", "dsr1_mla_decode_context", "dsr1_bf16_mla_decode_context",
             "dsr1_int8_mla_decode_context", "dsr1_bf16_int8_mla_decode_context", "dsr1_rows_matmul_f32"]
    for target in [*targets, *fused]:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    return lib


def _build(extra_flags: tuple[str, ...] = ()) -> Path | None:
    """The compiled library for this CPU (`dsr1.host.native.build`: cached, built once under the cache's
    lock; None: no compiler, or not an x86-64 CPU with AVX2). `extra_flags` (tests: `-mno-avx512f`
    builds the AVX2 variant on an AVX-512 CPU)."""
    sources = {name: resources.files("dsr1.cpu").joinpath(f"kernels/{name}").read_bytes() for name in SOURCES}
    flags = ["-O3", "-march=native", *extra_flags, "-std=c++17", "-shared", "-fPIC", "-isystem", jax.ffi.include_dir()]
    return native.build("rows_dot", sources, flags, unsupported="rows_dot kernel needs")
