"""The GPU flash-decoding kernel of absorbed MLA (`dsr1.core.flash_decode`), run in Pallas' interpret
mode on CPU: against a float64 reference, and inside the model's decode against the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1 import programs
from dsr1.core import flash_decode

from .harness import TINY


def _reference(q, q_pe, c, pe, lengths, own_score, own_value, scale, c_scale=None):
    """float64 softmax over each row's first `lengths[b]` latents plus its own key (`c_scale`: the
    latents' scales, dequantizing them)."""
    c = c if c_scale is None else c * c_scale[..., None]
    out = np.zeros(q.shape)
    for b, n in enumerate(lengths):
        s = (q[b] @ c[b, :n].T + q_pe[b] @ pe[b, :n].T) * scale
        s = np.concatenate([s, own_score[b][:, None]], axis=1)
        probs = np.exp(s - s.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        out[b] = probs[:, :n] @ c[b, :n] + probs[:, n:] * own_value[b][None]
    return out


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 4e-3)])
@pytest.mark.slow
def test_kernel_matches_softmax_attention(dtype, tolerance):
    """Rows of 37 (one partial block, three empty splits), 2,000 (every split, a ragged last block)
    and 513 positions of a 2,000-position cache; bf16 rounds the probabilities for the values' product."""
    rng = np.random.default_rng(0)
    b, h, rank, rope, cache_len = 3, 16, 32, 16, 2000
    lengths = np.array([37, 2000, 513], np.int32)
    q, q_pe = rng.standard_normal((b, h, rank)), rng.standard_normal((b, h, rope))
    c, pe = rng.standard_normal((b, cache_len, rank)), rng.standard_normal((b, cache_len, rope))
    own_score, own_value = rng.standard_normal((b, h)), rng.standard_normal((b, rank))
    q, q_pe, c, pe = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, q_pe, c, pe))  # the kernel's inputs
    acc, run_max, run_sum = flash_decode.cached_context(*(jnp.asarray(a, dtype) for a in (q, q_pe, c, pe)),
                                                        jnp.asarray(lengths), 0.1, interpret=True)
    assert acc.shape == (b, 4, h, rank) and flash_decode.split_length(cache_len) == 512
    ctx = flash_decode.combine(acc, run_max, run_sum, jnp.asarray(own_score, jnp.float32),
                               jnp.asarray(own_value, jnp.float32))
    ref = _reference(q, q_pe, c, pe, lengths, own_score, own_value, 0.1)
    assert np.abs(np.asarray(ctx) - ref).max() / np.abs(ref).max() < tolerance


@pytest.mark.parametrize("tiling", [None, flash_decode.Tiling(16, 64, 4, 2, transposed=True)])
def test_kernel_reads_an_int8_cache(tiling):
    """int8 latents (from -128 to 127) with a scale per position, bf16 queries and rotary keys: the
    float64 softmax of the dequantized keys, within the bf16 rounding of the probabilities (an empty
    split, a ragged last block, a row of one position), under the int8 default and transposed."""
    rng = np.random.default_rng(2)
    b, h, rank, rope, cache_len = 3, 16, 64, 16, 1100
    lengths = np.array([1100, 1, 600], np.int32)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
    q, q_pe, pe = (bf16(rng.standard_normal(shape)) for shape in ((b, h, rank), (b, h, rope), (b, cache_len, rope)))
    c = rng.integers(-128, 128, (b, cache_len, rank))
    c_scale = rng.uniform(0.005, 0.02, (b, cache_len)).astype(np.float32)
    own_score, own_value = rng.standard_normal((b, h)), rng.standard_normal((b, rank))
    partials = flash_decode.cached_context(
        *(jnp.asarray(a, jnp.bfloat16) for a in (q, q_pe)), jnp.asarray(c, jnp.int8), jnp.asarray(pe, jnp.bfloat16),
        jnp.asarray(lengths), 0.3, jnp.asarray(c_scale), interpret=True, tiling=tiling)
    ctx = flash_decode.combine(*partials, jnp.asarray(own_score, jnp.float32), jnp.asarray(own_value, jnp.float32))
    ref = _reference(q, q_pe, c.astype(np.float64), pe, lengths, own_score, own_value, 0.3, c_scale.astype(np.float64))
    assert np.abs(np.asarray(ctx) - ref).max() / np.abs(ref).max() < 4e-3


@pytest.mark.parametrize("tiling", [flash_decode.Tiling(16, 32, 4, 2), flash_decode.Tiling(64, 128, 8, 1),
                                    flash_decode.Tiling(32, 64, 4, 2, transposed=True)])
@pytest.mark.parametrize("h", [64, 48])  # programs of 16, 32 or 64 heads; 48: gcd(48, heads) = 16 for all
@pytest.mark.slow
def test_every_tiling_computes_the_same_context(tiling, h):
    """Programs of gcd(h, tiling.heads) heads, other loop steps and splits, the products transposed:
    the same context as the default tiling, to float32 rounding."""
    rng = np.random.default_rng(1)
    b, rank, rope, cache_len = 2, 32, 16, 700
    args = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for shape in ((b, h, rank), (b, h, rope), (b, cache_len, rank), (b, cache_len, rope))]
    own = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((b, h), (b, rank))]
    lengths = jnp.asarray([700, 65], jnp.int32)
    want, got = (flash_decode.combine(*flash_decode.cached_context(*args, lengths, 0.1, interpret=True, tiling=t), *own)
                 for t in (flash_decode.DEFAULT_TILING, tiling))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
@pytest.mark.slow
def test_decode_with_the_kernel_matches_the_xla_path(monkeypatch, kv_cache_dtype):
    """Three greedy decode steps of the tiny model from a random 40-position cache (float32 or int8
    latents), the kernel forced on (interpret mode): the latents it writes and the tokens it picks
    equal the XLA path's."""
    model = dsr1.init_random(TINY, seed=1, dtype="float32")
    tokens = jnp.asarray([[5], [9]], jnp.int32)[:, 0]

    def decode():
        cache = programs.random_cache(jax.random.key(2), cfg=model.cfg, mesh=model.mesh, batch=2, context=40,
                                      max_len=100, dtype=model.dtype, kv_cache_dtype=kv_cache_dtype)
        cache, fed, _, last = programs.greedy_decode(model.params, cache, tokens, **model.program_kwargs, steps=3)
        return np.asarray(cache.c_kv), np.asarray(fed), np.asarray(last)

    xla = decode()
    calls = []

    def kernel_in_interpret_mode(*args, **kwargs):
        calls.append(args[0].shape)
        return run_kernel(*args, **{**kwargs, "interpret": True})

    run_kernel = flash_decode.cached_context
    monkeypatch.setattr(flash_decode, "applies", lambda *args, **kwargs: True)
    monkeypatch.setattr(flash_decode, "cached_context", kernel_in_interpret_mode)
    jax.clear_caches()  # the decode program is traced again, now with the kernel
    try:
        kernel = decode()
    finally:
        jax.clear_caches()
    assert calls and calls[0] == (2, model.cfg.num_attention_heads, model.cfg.kv_lora_rank)
    np.testing.assert_array_equal(kernel[1], xla[1])
    np.testing.assert_array_equal(kernel[2], xla[2])
    np.testing.assert_allclose(kernel[0], xla[0], rtol=1e-5, atol=1e-5 * np.abs(xla[0]).max())


def test_kernel_applies_to_gpu_decode_only():
    """R1's decode (128 heads, r 512, rope 64, bf16 or int8 cache) on one GPU; not on CPU or TPU,
    several devices, several queries per row (speculative verification), int8 without scales (or
    scales on a 16-bit cache), or widths Triton cannot tile."""
    r1 = dict(heads=128, rank=512, rope=64, queries=1, cache_dtype=jnp.bfloat16, scaled=False, devices=1)
    assert flash_decode.applies(**r1, backend="gpu")
    assert not flash_decode.applies(**r1, backend="cpu") and not flash_decode.applies(**r1, backend="tpu")
    assert flash_decode.applies(**{**r1, "cache_dtype": jnp.int8, "scaled": True}, backend="gpu")
    for change in (dict(devices=8), dict(queries=2), dict(cache_dtype=jnp.int8), dict(scaled=True),
                   dict(cache_dtype=jnp.float32), dict(heads=8), dict(rank=576)):
        assert not flash_decode.applies(**{**r1, **change}, backend="gpu"), change
    assert [flash_decode.split_length(n) for n in (40, 4113, 32801, 200_000)] == [64, 576, 1088, 6272]
