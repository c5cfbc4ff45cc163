"""Flash decoding of absorbed MLA on GPU: one Pallas (Triton) kernel, the scores kept on chip.

In absorbed decode every head attends to the same latents `c_kv [B, S, r]` and `k_pe [B, S, rope]`
(keys are `[c_kv, k_pe]`, values `c_kv`). Through XLA the step writes the scores `[B, H, S]` in
float32 and reads them back (softmax, concatenation with the new token's, the values' product):
~4 bytes per head per cached token against the cache's ~2 per latent, so at long context the
attention runs far below the copy bandwidth. The kernel
keeps a block of scores in registers: each program takes `Tiling.heads` heads and one split of the
cached positions, loops over blocks of `Tiling.keys` latents with an online softmax, and writes its
partial context with its running max and sum; `combine` folds the splits and the new token's own
key. Each head block reads its split's latents again (4 blocks of 32 for R1's 128 heads): a block of
all heads needs 256 KB of shared memory, more than a Hopper GPU has. With 128 heads the products
bound the step, not memory (~240 FLOP per cached byte, above the ratio of a Hopper GPU's peak FLOPs
to its bandwidth), so the kernel computes them as 32-row tiles through Triton's mma. An int8 cache's
latents are made bf16 in every program (docs/benchmarks.md has the figures).

Used where it applies (`applies`: one GPU, one query per row, a bf16/f16 cache or an int8 one (its
latents made bf16 on chip, its scales applied to scores and probabilities), head count and widths
the kernel tiles); everywhere else the XLA path runs. `interpret=True` runs the kernel on any backend
(the tests, on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_HEADS = 16  # Triton's smallest dot tile: the head count must be a multiple of it
KEYS_PER_SPLIT = 512  # the cached positions of one program, at least, before the splits stop growing
MAX_SPLITS = 32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How programs tile one row's attention: `heads` per program (a power of two from `BLOCK_HEADS`,
    fewer where the head count needs; a [heads, r] float32 context stays in registers), `keys`
    cached positions per loop step, and Triton's `warps` per program and pipeline `stages`;
    `transposed` computes the products with the keys (and for the values the latents) as the tiles'
    rows: Hopper's `wgmma` wants 64 rows per warpgroup, which 64 keys or 512 latents have and 32 heads
    do not (Triton then uses the older `mma`), which pays at one row and not at 8 or more. The default
    is the best tiling found for long contexts at 8-32 rows (`python -m dsr1.bench decode-attention`
    compares tilings)."""

    heads: int = 32
    keys: int = 64
    warps: int = 4
    stages: int = 2
    transposed: bool = False


DEFAULT_TILING = Tiling()
# An int8 cache's latents are made bf16 on chip by every program that reads them: 64 heads per program
# halve those conversions.
INT8_TILING = Tiling(heads=64, keys=64, warps=8, stages=1)


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def applies(heads: int, rank: int, rope: int, queries: int, cache_dtype: jnp.dtype, scaled: bool,
            backend: str | None = None, devices: int | None = None) -> bool:
    """Whether the kernel runs this decode step: on one GPU, one query per row, an unscaled 16-bit
    cache or an int8 one with its scales, heads a multiple of `BLOCK_HEADS`, latent and rope widths
    powers of two (Triton tiles). On several devices the XLA path runs: the kernel is not yet split
    over the tensor axis's heads (XLA's partitioner would run every head on every device). `backend`,
    `devices`: JAX's by default."""
    backend = backend or jax.default_backend()
    devices = jax.device_count() if devices is None else devices
    cache_dtype = jnp.dtype(cache_dtype)
    stored = cache_dtype == jnp.int8 if scaled else cache_dtype.itemsize == 2
    return (backend == "gpu" and devices == 1 and queries == 1 and stored and heads % BLOCK_HEADS == 0
            and _power_of_two(rank) and _power_of_two(rope))


def split_length(cache_len: int, keys: int = DEFAULT_TILING.keys) -> int:
    """Cached positions per program: a multiple of `keys` (a loop step's), at least `KEYS_PER_SPLIT`
    unless the cache is shorter, and at most `MAX_SPLITS` splits (enough programs to fill a GPU at
    batch 1)."""
    blocks = -(-cache_len // keys)
    splits = max(1, min(MAX_SPLITS, blocks * keys // KEYS_PER_SPLIT))
    return keys * -(-blocks // splits)


def _kernel(length_ref, q_ref, qpe_ref, c_ref, pe_ref, *refs, split_len: int, keys: int, scale: float,
            transposed: bool, scaled: bool):
    """One program: a block of heads of one row against one split of its cached positions. Scores are
    `[heads, keys]` and the context `[heads, r]`, or `[keys, heads]` and `[r, heads]` if `transposed`.
    `scaled`: the latents are int8 with a scale per position (`refs` begin with the scales), made
    the queries' dtype on chip (exact in bf16); the scales multiply the latents' scores and the
    probabilities, as `attention.scores` and `weighted_values` apply them."""
    scale_ref, (acc_ref, max_ref, sum_ref) = (refs[0], refs[1:]) if scaled else (None, refs)
    f32 = jnp.float32
    first = pl.program_id(1) * split_len
    end = jnp.minimum(jnp.minimum(first + split_len, length_ref[()]), c_ref.shape[0])
    q, qpe = q_ref[...], qpe_ref[...]
    offsets = jnp.arange(keys)
    key_axis = 0 if transposed else 1
    per_head = (lambda v: v[None, :]) if transposed else (lambda v: v[:, None])  # a [heads] vector against a tile
    per_key = (lambda v: v[:, None]) if transposed else (lambda v: v[None, :])

    def product(queries, cached):  # the scores of one part of the keys: latents or rotary
        return (plgpu.dot(cached, queries, trans_b=True) if transposed else plgpu.dot(queries, cached, trans_b=True)
                ).astype(f32)

    def values(probs, c):
        return (plgpu.dot(c, probs, trans_a=True) if transposed else plgpu.dot(probs, c)).astype(f32)

    def block(i, carry):
        acc, run_max, run_sum = carry
        start = first + i * keys
        valid = start + offsets < end
        rows = pl.ds(start, keys)
        c = plgpu.load(c_ref.at[rows, :], mask=valid[:, None], other=0).astype(q.dtype)
        pe = plgpu.load(pe_ref.at[rows, :], mask=valid[:, None], other=0.0)
        latent = product(q, c)
        if scaled:
            key_scale = per_key(plgpu.load(scale_ref.at[rows], mask=valid, other=0.0))
            latent = latent * key_scale
        s = (latent + product(qpe, pe)) * scale
        s = jnp.where(per_key(valid), s, -jnp.inf)  # every block run holds a valid position
        new_max = jnp.maximum(run_max, s.max(axis=key_axis))
        rescale = jnp.exp(run_max - new_max)
        probs = jnp.exp(s - per_head(new_max))
        weights = probs * key_scale if scaled else probs
        acc = acc * per_head(rescale) + values(weights.astype(c.dtype), c)
        return acc, new_max, run_sum * rescale + probs.sum(axis=key_axis)

    n_blocks = (jnp.maximum(end - first, 0) + keys - 1) // keys
    acc_shape = acc_ref.shape[::-1] if transposed else acc_ref.shape
    init = (jnp.zeros(acc_shape, f32), jnp.full(max_ref.shape, -jnp.inf, f32), jnp.zeros(sum_ref.shape, f32))
    acc, run_max, run_sum = jax.lax.fori_loop(0, n_blocks, block, init)
    acc_ref[...] = acc.T if transposed else acc
    max_ref[...] = run_max
    sum_ref[...] = run_sum


def cached_context(q: jax.Array, q_pe: jax.Array, c_cache: jax.Array, pe_cache: jax.Array, lengths: jax.Array,
                   scale: float, c_scale: jax.Array | None = None, interpret: bool = False,
                   tiling: Tiling | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial attention of `q [B, H, r]`, `q_pe [B, H, rope]` over the first `lengths[b]` cached
    latents `c_cache [B, S, r]`, `pe_cache [B, S, rope]`, per split of the positions: the unnormalized
    context `[B, splits, H, r]`, the running max and the sum of exponentials `[B, splits, H]` (float32).
    An int8 cache comes with its scales `c_scale [B, S]` (float32); the queries take `pe_cache`'s dtype.
    `tiling`: by default `INT8_TILING` for an int8 cache, else `DEFAULT_TILING`."""
    scaled = c_scale is not None
    tiling = tiling or (INT8_TILING if scaled else DEFAULT_TILING)
    b, h, rank = q.shape
    cache_len, rope = c_cache.shape[1], pe_cache.shape[-1]
    split_len = split_length(cache_len, tiling.keys)
    splits = -(-cache_len // split_len)
    heads = math.gcd(h, tiling.heads)  # `applies`: >= BLOCK_HEADS on GPU; interpret mode takes any
    q, q_pe = q.astype(pe_cache.dtype), q_pe.astype(pe_cache.dtype)
    row = lambda shape: pl.BlockSpec((None, *shape), lambda i, j, k: (k, *(0,) * len(shape)))  # noqa: E731
    heads_of = lambda width: pl.BlockSpec((None, heads, width), lambda i, j, k: (k, i, 0))  # noqa: E731
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_kernel, split_len=split_len, keys=tiling.keys, scale=scale, transposed=tiling.transposed,
                          scaled=scaled),
        grid=(h // heads, splits, b),  # head blocks vary fastest, each re-reading its split's latents
        in_specs=[pl.BlockSpec((None,), lambda i, j, k: (k,)), heads_of(rank), heads_of(rope),
                  row((cache_len, rank)), row((cache_len, rope))] + ([row((cache_len,))] if scaled else []),
        out_specs=[pl.BlockSpec((None, None, heads, rank), lambda i, j, k: (k, j, i, 0)),
                   pl.BlockSpec((None, None, heads), lambda i, j, k: (k, j, i)),
                   pl.BlockSpec((None, None, heads), lambda i, j, k: (k, j, i))],
        out_shape=[jax.ShapeDtypeStruct((b, splits, h, rank), f32), jax.ShapeDtypeStruct((b, splits, h), f32),
                   jax.ShapeDtypeStruct((b, splits, h), f32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiling.warps, num_stages=tiling.stages),
        interpret=interpret,
        name="mla_flash_decode",
    )(lengths.astype(jnp.int32), q, q_pe, c_cache, pe_cache, *([c_scale.astype(f32)] if scaled else []))


def combine(acc: jax.Array, run_max: jax.Array, run_sum: jax.Array, own_score: jax.Array,
            own_value: jax.Array) -> jax.Array:
    """The context `[B, H, r]` (float32) from the splits' partials (`cached_context`) and the new
    token's own score `[B, H]` and latent `[B, r]`, which joins the softmax as one more key."""
    top = jnp.maximum(run_max.max(axis=1), own_score)  # finite: the own key is always there
    weight = jnp.exp(run_max - top[:, None])  # [B, splits, H]; empty splits (max -inf) weigh 0
    own = jnp.exp(own_score - top)
    num = jnp.einsum("bjh,bjhr->bhr", weight, acc) + own[..., None] * own_value[:, None].astype(jnp.float32)
    return num / ((weight * run_sum).sum(axis=1) + own)[..., None]
