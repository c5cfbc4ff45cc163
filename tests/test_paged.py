"""`extend` over the paged latent cache against the contiguous model: chunked prefill equals
`Model.forward`, paged decode (T = 1) equals `Model.decode` (float32 and int8 caches), nothing
compiles again after warm-up, 8 fake devices give the 1-device logits, and a bf16 model's paged
decode runs dsr1's CPU attention kernel.

Rows sit in batch slots among idle ones (count 0, whose page tables point at live pages: a stray
read or write would show), join late, finish early, and own interleaved, out-of-order pages of a
fragmented allocator; page size 6 divides none of the prompt lengths.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import dsr1
from dsr1 import programs
from dsr1.core.attention import absorbed_crossover, use_absorbed
from dsr1.core.cache import SCRATCH_PAGE
from dsr1.core.sharding import put_replicated, to_host
from dsr1.cpu import ffi as cpu_kernels

from .harness import DECODE_PREFIX, TOLERANCE, decode_logits, relative_error, subprocess_env
from .paged_harness import MESH_PLANS, NUM_PAGES, PAGE_SIZE, SLOTS, WIDTH, Plan, mesh_logits, new_cache, run_chunks

SAME = 1e-5  # sharded vs single device: only the order of float32 sums differs


@pytest.fixture(scope="module")
def fx(all_fixtures):
    """The R1-like reference fixture (group-limited routing, q_lora): its prompts have routing margins
    far above the float32 differences between extend and forward."""
    return all_fixtures["grouped_qlora"]


@pytest.fixture(scope="module")
def model(fx):
    return dsr1.load(fx.folder, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def forward(fx, model):
    return np.asarray(model.forward(fx.tokens, fx.lengths))


def _worst(ours: dict, ref) -> tuple[float, tuple[int, int]]:
    errors = {key: relative_error(v, ref[key]) for key, v in ours.items()}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def _final_norm_logits(model, hidden: np.ndarray) -> np.ndarray:
    """The lm_head applied to `hidden` after the final norm, in numpy."""
    x = hidden / np.sqrt(np.mean(hidden * hidden, axis=-1, keepdims=True) + model.cfg.rms_norm_eps)
    return (x * np.asarray(model.params["final_norm"])) @ np.asarray(model.params["lm_head"])


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.slow
def test_chunked_extend_matches_forward(fx, model, forward, chunk, absorbed):
    logits, hidden, _, zero_ok = run_chunks(model, new_cache(model), fx.tokens, fx.lengths,
                                            [Plan(chunk, absorbed, block_pages=3)])
    assert sorted(logits) == [(r, p) for r, n in enumerate(fx.lengths) for p in range(n)]
    error, worst = _worst(logits, forward)
    print(f"\n[extend, chunks of {chunk}, {'absorbed' if absorbed else 'expanded'}] vs forward: "
          f"{len(logits)} positions, worst {error:.2e} at (row, position) {worst}")
    assert error <= TOLERANCE
    assert zero_ok, "logits and hidden past a slot's count must be zero"
    key = (0, int(fx.lengths[0]) - 1)
    assert relative_error(_final_norm_logits(model, hidden[key]), logits[key]) <= TOLERANCE, \
        "hidden must be the final norm's input"


@pytest.mark.slow
def test_paged_decode_matches_contiguous_decode(fx, model):
    """Prefill each row's prefix in one 64-token chunk, then decode one token per step (T = 1)."""
    contiguous = decode_logits(model, fx.tokens, fx.lengths, DECODE_PREFIX)
    plans = [Plan(64, False, block_pages=3, first=tuple(DECODE_PREFIX), join=(0, 0, 0)), Plan(1, True, block_pages=3)]
    paged, _, _, _ = run_chunks(model, new_cache(model), fx.tokens, fx.lengths, plans, steps_per_plan=[1])
    error, worst = _worst({k: paged[k] for k in contiguous}, contiguous)
    print(f"\n[paged decode] vs contiguous decode: {len(contiguous)} positions, worst {error:.2e} at {worst}")
    assert error <= TOLERANCE


@pytest.fixture(scope="module")
def int8_decode(fx):
    """The model with an int8 latent cache, and its contiguous decode logits."""
    int8 = dsr1.load(fx.folder, dtype="float32", progress=False, kv_cache_dtype="int8")
    return int8, decode_logits(int8, fx.tokens, fx.lengths, DECODE_PREFIX)


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.slow
def test_int8_paged_decode_matches_contiguous_int8_decode(fx, model, int8_decode, absorbed):
    """int8 pages (default block size): the prompt chunk, then decode steps reading int8 pages in
    either form, where the scales multiply scores and probabilities."""
    int8, contiguous = int8_decode
    cfg = int8.cfg
    plans = [Plan(64, use_absorbed(cfg, 64), None, first=tuple(DECODE_PREFIX), join=(0, 0, 0)),
             Plan(1, absorbed, None)]
    cache = new_cache(int8, "int8")
    assert cache.c_kv.dtype == np.int8 and cache.c_scale.shape == (cfg.num_hidden_layers, NUM_PAGES, PAGE_SIZE)
    paged, _, _, _ = run_chunks(int8, cache, fx.tokens, fx.lengths, plans, steps_per_plan=[1])
    error, worst = _worst({k: paged[k] for k in contiguous}, contiguous)
    float_cache, _ = _worst(contiguous, decode_logits(model, fx.tokens, fx.lengths, DECODE_PREFIX))
    print(f"\n[int8 paged decode, {'absorbed' if absorbed else 'expanded'}] vs contiguous int8 decode: worst "
          f"{error:.2e} at {worst} (int8 vs float32 cache: {float_cache:.2e})")
    assert error <= TOLERANCE
    assert float_cache > 10 * TOLERANCE, "the int8 cache must actually differ from float32 for this to test it"


@contextlib.contextmanager
def counting_compilations():
    """Count XLA compilations (jax.monitoring's backend-compile events) inside the block."""
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.slow
def test_no_compilation_after_warm_up(model):
    """Rows joining, growing, leaving and moving to other pages reuse the bucket's program."""
    rng = np.random.default_rng(0)
    chunk = 7

    def step(cache, starts, counts):
        tables = np.stack([rng.permutation(np.arange(1, NUM_PAGES))[:WIDTH] for _ in range(SLOTS)]).astype(np.int32)
        tokens = rng.integers(0, model.cfg.vocab_size, (SLOTS, chunk)).astype(np.int32)
        logits_at = rng.integers(0, chunk, (SLOTS, chunk)).astype(np.int32)
        args = put_replicated((tokens, np.asarray(starts, np.int32), np.asarray(counts, np.int32), tables, logits_at),
                              model.mesh)
        logits, _, cache = programs.extend(model.params, cache, *args, **model.program_kwargs, absorbed=True,
                                           block_pages=3)
        return to_host(logits), cache

    cache = new_cache(model)
    _, cache = step(cache, [0] * SLOTS, [chunk] * SLOTS)  # warm-up (compiled already if other tests ran)
    with counting_compilations() as compiled:
        jax.jit(lambda x: x + 1)(np.ones(3))  # the counter sees a compilation
        assert len(compiled) == 1
        for starts, counts in [([7, 0, 30, 12, 0], [7, 0, 3, 1, 7]), ([59, 1, 0, 0, 40], [7, 2, 0, 0, 5]),
                               ([0, 0, 0, 0, 0], [0, 0, 0, 0, 0])]:
            logits, cache = step(cache, starts, counts)
        assert not logits.any(), "idle slots return zero logits"
    assert compiled == compiled[:1], f"extend compiled again after warm-up: {compiled[1:]}"


@pytest.mark.slow
def test_eight_fake_devices_match_one(fx, model, tmp_path):
    """expert=2 x tensor=4 (one head per device): both attention forms, pages read across steps."""
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, tokens=fx.tokens, lengths=fx.lengths)
    out = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-m", "tests.paged_harness", "--folder", str(fx.folder), "--inputs",
                           str(inputs), "--out", str(out), "--expert=2", "--tensor=4"], env=subprocess_env(8),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(np.load(out))
    assert int(result["devices"]) == 8 and result["local_head_shard"][2] == 1
    one = mesh_logits(model, fx.tokens, fx.lengths)
    assert [tuple(k) for k in result["keys"]] == sorted(one)
    error = max(relative_error(v, one[tuple(k)]) for k, v in zip(result["keys"], result["logits"]))
    plans = ", ".join(f"T={p.chunk} " + ("absorbed" if p.absorbed else "expanded") for p in MESH_PLANS)
    print(f"\n[extend on 8 devices, expert=2 x tensor=4] vs 1 device: worst {error:.1e} ({plans})")
    assert error <= SAME


def test_absorbed_crossover_follows_the_flop_count():
    """For R1 absorbed attention is cheaper below ~171 new tokens per row (see absorbed_crossover)."""
    r1 = dsr1.Config.preset("deepseek-r1")
    assert absorbed_crossover(r1) == pytest.approx(512 * 256 / 768)
    assert use_absorbed(r1, 1) and use_absorbed(r1, 170) and not use_absorbed(r1, 171)
    assert SCRATCH_PAGE == 0


@pytest.mark.skipif(not cpu_kernels.available(), reason="dsr1's CPU kernel is not built here")
@pytest.mark.slow
def test_bf16_paged_decode_reads_the_pages_with_the_kernel(fx):
    """A bf16 model on one CPU device: `extend` with one token per row (paged decode) is one kernel call
    per layer reading the pool through the page tables (`cpu_kernels.mla_decode_context`; its output
    against the contiguous kernel's and XLA's: tests/test_cpu_kernels.py), where chunks of several
    tokens keep XLA's page loop."""
    bf16 = dsr1.load(fx.folder, dtype="bfloat16", progress=False)
    cache = new_cache(bf16)
    for chunk, kernel in ((1, True), (7, False)):
        args = put_replicated((np.zeros((SLOTS, chunk), np.int32), np.full(SLOTS, 3, np.int32),
                               np.ones(SLOTS, np.int32), np.ones((SLOTS, WIDTH), np.int32),
                               np.zeros((SLOTS, 1), np.int32)), bf16.mesh)
        lowered = programs.extend.lower(bf16.params, cache, *args, **bf16.program_kwargs, absorbed=True,
                                        block_pages=3)
        assert ("mla_decode_context" in lowered.as_text()) == kernel
