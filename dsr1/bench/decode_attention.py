"""Absorbed-MLA decode attention alone: one new token per row against `positions` cached latents
(plus its own key), by every implementation that runs here, on random bf16 inputs of the asked
widths (R1's by default), the cache bf16 or (`--kv-cache-dtype int8`) int8 latents with a float32
scale per position. XLA's path (one softmax, float32 scores, the probabilities rounded to bf16:
`attention._cache_softmax`'s steps) is the reference; the GPU flash-decoding kernel runs under
each asked tiling (`flash_decode.Tiling`; `--interpret` runs it on any backend, slowly: for tests);
dsr1's CPU kernel (`dsr1.cpu.ffi.mla_decode_context`) where it is built. Per call: ms,
the cache read (latents once) in GB/s, the products' TFLOP/s and the error against the reference.
The flash kernel's default tilings were chosen with this loop (docs/benchmarks.md, "Decode attention
alone")."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import cpu
from ..core import flash_decode
from ..core.cache import KV_CACHE_DTYPES, quantize_latent
from ..cpu import ffi as cpu_kernels
from ..options import positive_int, positive_ints
from .bandwidth import device_description, with_final_load
from .report import device_line, markdown_table

# The tilings swept to choose the defaults (bf16 cache, int8 cache), which come first.
TILINGS = ("32x64x4x2", "64x64x8x1", "16x64x4x2", "64x64x8x2", "64x32x4x2", "64x32x8x2", "32x32x4x2", "64x64x4x2",
           "32x64x4x3", "32x64x8x2", "64x64x8x3", "128x32x8x1", "128x16x8x2", "16x128x4x2", "16x32x4x2", "16x64x4x3",
           "32x64x4x2t", "64x64x8x2t")
ATTENTION_COLUMNS = ("implementation", "rows", "positions", "ms", "cache_gbs", "tflop_s", "max_rel_diff")
SCALE = 192**-0.5  # R1's softmax scale, 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), without YaRN's factor


class Inputs(NamedTuple):
    """One decode step's attention inputs (bf16): queries `q [B, H, r]`, `q_pe [B, H, rope]`, the
    cache `c [B, S, r]`, `pe [B, S, rope]` (every row `S` long), the new tokens' own latents
    `own_c [B, r]`, `own_pe [B, rope]`; for an int8 cache `c` is int8, `c_scale [B, S]` its scales."""

    q: jax.Array
    q_pe: jax.Array
    c: jax.Array
    pe: jax.Array
    own_c: jax.Array
    own_pe: jax.Array
    c_scale: jax.Array | None = None

    @property
    def lengths(self) -> jax.Array:
        return jnp.full(self.c.shape[0], self.c.shape[1], jnp.int32)


def random_inputs(rows: int, positions: int, heads: int, rank: int, rope: int, seed: int = 0,
                  kv_cache_dtype: str | None = None) -> Inputs:
    """Unit-normal bf16 inputs of the given sizes; `kv_cache_dtype="int8"`: the cached latents
    quantized as a model's cache stores them (`cache.quantize_latent`)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = [(rows, heads, rank), (rows, heads, rope), (rows, positions, rank), (rows, positions, rope),
              (rows, rank), (rows, rope)]
    x = Inputs(*(jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(keys, shapes)))
    if kv_cache_dtype == "int8":
        c, c_scale = quantize_latent(x.c.astype(jnp.float32))
        x = x._replace(c=c, c_scale=c_scale)
    return x


def xla_context(x: Inputs, scale: float) -> jax.Array:
    """The reference context `[B, H, r]` (float32): the own key appended to the cache, float32 scores,
    one softmax, the probabilities rounded to bf16 before their sum over the latents (an int8 cache's
    scales multiply its keys' latent products and probabilities, as `attention.scores` and
    `weighted_values`; the own key's is 1)."""
    f32 = jnp.float32
    keys = jnp.concatenate([x.c.astype(x.own_c.dtype), x.own_c[:, None]], axis=1)
    rotary = jnp.concatenate([x.pe, x.own_pe[:, None]], axis=1)
    s = jnp.einsum("bhr,bsr->bhs", x.q, keys, preferred_element_type=f32)
    key_scale = None if x.c_scale is None else jnp.pad(x.c_scale, ((0, 0), (0, 1)), constant_values=1)[:, None]
    if key_scale is not None:
        s = s * key_scale
    s = (s + jnp.einsum("bhp,bsp->bhs", x.q_pe, rotary, preferred_element_type=f32)) * scale
    probs = jax.nn.softmax(s, axis=-1)
    if key_scale is not None:
        probs = probs * key_scale
    return jnp.einsum("bhs,bsr->bhr", probs.astype(keys.dtype), keys, preferred_element_type=f32)


def flash_context(x: Inputs, scale: float, tiling: flash_decode.Tiling, interpret: bool = False) -> jax.Array:
    """The GPU kernel's context: its splits' partials folded with the own key's score and latent."""
    f32 = jnp.float32
    acc, run_max, run_sum = flash_decode.cached_context(x.q, x.q_pe, x.c, x.pe, x.lengths, scale, x.c_scale,
                                                        interpret=interpret, tiling=tiling)
    own = (jnp.einsum("bhr,br->bh", x.q, x.own_c, preferred_element_type=f32)
           + jnp.einsum("bhp,bp->bh", x.q_pe, x.own_pe, preferred_element_type=f32)) * scale
    return flash_decode.combine(acc, run_max, run_sum, own, x.own_c)


def cpu_kernel_context(x: Inputs, scale: float) -> jax.Array:
    """dsr1's CPU kernel's context, the cache as one layer of bf16 bits (or of int8 latents)."""
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)[None]  # noqa: E731
    c, c_scale = (bits(x.c), None) if x.c_scale is None else (x.c[None], x.c_scale[None])
    return cpu_kernels.mla_decode_context(x.q, x.q_pe, c, bits(x.pe), 0, x.lengths, x.own_c, x.own_pe, scale,
                                          c_scale=c_scale)


def time_calls(context: Callable[[Inputs], jax.Array], x: Inputs, calls: int, repeats: int) -> tuple[float, jax.Array]:
    """Seconds per call of `context` over `calls` calls in one jitted loop (no dispatch between
    them), the fastest of `repeats` runs after a compiling one, and one call's result. The queries
    change a little each call, so that no call can be hoisted out of the loop."""

    @jax.jit
    def loop(x: Inputs) -> jax.Array:
        def body(i, total):
            step = x._replace(q=x.q * (1 + i % 2).astype(x.q.dtype))
            return total + context(step)

        return jax.lax.fori_loop(0, calls, body, jnp.zeros(x.q.shape, jnp.float32))

    jax.block_until_ready(loop(x))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(x))
        best = min(best, time.perf_counter() - start)
    return best / calls, jax.jit(context)(x)


def attention_row(name: str, x: Inputs, seconds: float, out: jax.Array, reference: jax.Array) -> dict[str, Any]:
    """One line of the table: time per call, cache GB/s, TFLOP/s and the error against `reference`."""
    rows, heads, rank = x.q.shape
    positions, rope = x.c.shape[1], x.pe.shape[-1]
    per_position = rank * x.c.dtype.itemsize + rope * x.pe.dtype.itemsize + (0 if x.c_scale is None else 4)
    ref = np.asarray(reference, np.float64)
    return {"implementation": name, "rows": rows, "positions": positions, "ms": 1e3 * seconds,
            "cache_gbs": rows * positions * per_position / seconds / 1e9,
            "tflop_s": 2 * rows * heads * (positions + 1) * (2 * rank + rope) / seconds / 1e12,
            "max_rel_diff": float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())}


def implementations(tilings: list[flash_decode.Tiling], interpret: bool,
                    scale: float) -> dict[str, Callable[[Inputs], jax.Array]]:
    """What runs here, by name: XLA's path first (the reference), the flash kernel per tiling on a GPU
    (or with `interpret`), the CPU kernel where it is built."""
    found = {"xla": lambda x: xla_context(x, scale)}
    if jax.default_backend() == "gpu" or interpret:
        for t in tilings:
            found[f"flash {tiling_name(t)}"] = lambda x, t=t: flash_context(x, scale, t, interpret)
    if cpu.enabled(jax.devices()):
        found["cpu kernel"] = lambda x: cpu_kernel_context(x, scale)
    return found


def tiling_name(t: flash_decode.Tiling) -> str:
    return f"{t.heads}x{t.keys}x{t.warps}x{t.stages}{'t' if t.transposed else ''}"


def parse_tilings(text: str) -> list[flash_decode.Tiling]:
    """`HEADSxKEYSxWARPSxSTAGES[t],...` -> tilings (a trailing `t`: the transposed products)."""
    tilings = []
    for item in text.split(","):
        item = item.strip()
        transposed = item.endswith("t")
        parts = item.removesuffix("t").split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected tilings as HEADSxKEYSxWARPSxSTAGES, a trailing t for the "
                                             f"transposed products (e.g. 32x64x4x2, 32x64x4x2t), comma-separated; "
                                             f"got {item!r}")
        tilings.append(flash_decode.Tiling(*map(int, parts), transposed=transposed))
    return tilings


def add_attention_options(p: argparse.ArgumentParser) -> None:
    """The `attention` command's flags."""
    p.add_argument("--rows", type=positive_ints, default=[1, 8, 32],
                   help="comma-separated batch sizes (default: 1,8,32)")
    p.add_argument("--positions", type=positive_ints, default=[32768],
                   help="comma-separated cached positions per row (default: 32768)")
    p.add_argument("--heads", type=positive_int, default=128, help="attention heads (default: 128, R1's)")
    p.add_argument("--rank", type=positive_int, default=512, help="latent width, kv_lora_rank (default: 512, R1's)")
    p.add_argument("--rope", type=positive_int, default=64,
                   help="rotary key width, qk_rope_head_dim (default: 64, R1's)")
    p.add_argument("--tilings", type=parse_tilings, default=parse_tilings(",".join(TILINGS)),
                   help="the flash kernel's tilings, HEADSxKEYSxWARPSxSTAGES (a trailing t: the transposed products, "
                        "keys as the tiles' rows), comma-separated (default: the 18 swept to choose the "
                        "defaults for bf16 and int8 caches, those first)")
    p.add_argument("--kv-cache-dtype", choices=[d for d in KV_CACHE_DTYPES if d],
                   help="int8 cached latents with a float32 scale per position (default: bf16)")
    p.add_argument("--interpret", action="store_true",
                   help="also run the flash kernel off a GPU, in Pallas' interpreter (slow: small sizes only)")
    p.add_argument("--calls", type=positive_int, default=20, help="calls per timed loop (default: 20)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed loops after a compiling one; the fastest is "
                   "reported (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def run_attention(args: argparse.Namespace) -> dict[str, Any]:
    """The `attention` command: every implementation at each (rows, positions), against XLA's."""
    dev = device_description()
    found = implementations(args.tilings, args.interpret, SCALE)
    rows, failed = [], []
    for batch in args.rows:
        for positions in args.positions:
            x = random_inputs(batch, positions, args.heads, args.rank, args.rope, args.seed, args.kv_cache_dtype)
            reference = None
            for name, context in found.items():
                print(f"{name}: {batch} rows x {positions} positions ...", file=sys.stderr, flush=True)
                try:
                    seconds, out = time_calls(context, x, args.calls, args.repeats)
                except Exception as e:  # noqa: BLE001 - a tiling the GPU cannot run (shared memory, registers)
                    if reference is None:  # XLA's path itself: nothing to compare against
                        raise
                    failed.append({"implementation": name, "rows": batch, "positions": positions,
                                   "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    print(f"    failed: {failed[-1]['error']}", file=sys.stderr, flush=True)
                    continue
                reference = out if reference is None else reference
                rows.append(attention_row(name, x, seconds, out, reference))
    dev = with_final_load(dev)
    print(device_line(dev))
    cache = "int8 latents (a float32 scale each), bf16 rope" if args.kv_cache_dtype else "bf16"
    print(f"absorbed MLA decode attention: {args.heads} heads, latent {args.rank}, rope {args.rope}, bf16 queries, "
          f"{cache} cache; {args.calls} calls per timed loop, the fastest of {args.repeats} loops\n")
    print(attention_table(rows))
    for f in failed:
        print(f"\nfailed: {f['implementation']} at {f['rows']} rows x {f['positions']} positions: {f['error']}")
    print("\ncache GB/s: the cached latents (int8: and their scales) and rotary keys read once per call; TFLOP/s: "
          "scores and values, 2 per multiply-add;\nrel. diff: max |out - xla's| / max |xla's| (float32 contexts; "
          "the probabilities rounded to bf16 in each).")
    return {"command": "attention", "device": dev, "heads": args.heads, "rank": args.rank, "rope": args.rope,
            "kv_cache_dtype": args.kv_cache_dtype, "calls": args.calls, "repeats": args.repeats,
            "columns": list(ATTENTION_COLUMNS), "rows": rows, "failed": failed}


def attention_table(rows: list[dict[str, Any]]) -> str:
    """The `attention` command's table, one line per (implementation, rows, positions)."""
    headers = ("implementation", "rows", "positions", "ms", "cache GB/s", "TFLOP/s", "rel. diff")
    cells = [(r["implementation"], str(r["rows"]), str(r["positions"]), f"{r['ms']:.3f}", f"{r['cache_gbs']:.1f}",
              f"{r['tflop_s']:.2f}", f"{r['max_rel_diff']:.1e}") for r in rows]
    return markdown_table(headers, cells)
