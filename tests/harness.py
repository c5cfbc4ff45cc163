"""Test harness: reference fixtures, the decode-versus-reference loop and subprocess helpers."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import dsr1

from . import reference

MIN_ROUTING_MARGIN = 2e-5  # below this, float32 rounding may legitimately flip an expert choice
TOLERANCE = 1e-4  # max |dlogit| <= TOLERANCE * max |logit|
EOS = 1

# The tiny preset with a small vocabulary, for tests that feed token ids rather than text: R1's
# 129,280-row embedding and head are 97% of the preset's parameters, and drawing them at the tests'
# compile level (`COMPILE_FLAGS`) is most of what a random model costs. Tests of text keep the
# preset, whose vocabulary is R1's tokenizer's.
TINY = dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=4096)


@dataclasses.dataclass(frozen=True)
class Fixture:
    name: str
    folder: Path
    hf_config: dict
    tokens: np.ndarray  # [B, T], right-padded (padding is 0)
    lengths: np.ndarray  # [B]
    reference: np.ndarray  # HF float32 logits [B, T, V]; valid at positions < lengths
    seed: int
    margin: float


def prompt_batch(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three prompts of different lengths, one holding EOS tokens inside it, reaching past
    original_max_position_embeddings (16) up to 40 positions."""
    rng = np.random.default_rng(1000 + seed)
    lengths = np.array([40, 29, 17], np.int32)
    tokens = rng.integers(2, vocab, (3, 40)).astype(np.int32)
    tokens[1, [5, 11]] = EOS
    for row, n in enumerate(lengths):
        tokens[row, n:] = 0
    return tokens, lengths


def build_fixture(root: Path, name: str, mtp: bool = False) -> Fixture:
    cfg = reference.hf_config(reference.CONFIGS[name])
    if mtp:
        cfg["num_nextn_predict_layers"] = 1
    for seed in range(20):
        folder = root / f"{name}-{seed}"
        reference.write_checkpoint(folder, cfg, reference.release_tensors(cfg, seed, mtp=mtp))
        tokens, lengths = prompt_batch(cfg["vocab_size"], seed)
        logits, margin = reference.reference_logits(folder, tokens)
        if margin >= MIN_ROUTING_MARGIN:
            return Fixture(name, folder, cfg, tokens, lengths, logits, seed, margin)
    raise RuntimeError(f"{name}: no seed gave a routing margin >= {MIN_ROUTING_MARGIN}")


def decode_logits(model, tokens: np.ndarray, lengths: np.ndarray,
                  prefix: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Prefill `prefix[b]` tokens of each row, then decode the rest of the row one token at a time.

    Returns the logits predicted at every position >= prefix - 1, keyed by (row, position): the
    prefill gives position prefix-1, each decode step the position of the token it was fed.
    """
    from dsr1.core.sharding import to_host

    b, t = tokens.shape
    steps = int((lengths - prefix).max())
    # Rows that finish early keep decoding (their logits are ignored), so leave room for them.
    logits, cache = model.prefill(tokens[:, : prefix.max()], prefix, max_len=int(prefix.max()) + steps)
    out = {(r, int(prefix[r]) - 1): to_host(logits)[r] for r in range(b)}
    for step in range(steps):
        pos = prefix + step
        feed = np.where(pos < lengths, tokens[np.arange(b), np.minimum(pos, t - 1)], 0)
        logits, cache = model.decode(cache, feed)
        host = to_host(logits)
        out.update({(r, int(pos[r])): host[r] for r in range(b) if pos[r] < lengths[r]})
    return out


DECODE_PREFIX = np.array([3, 20, 9], np.int32)  # rows decode 37, 9 and 8 tokens


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


# XLA:CPU compiles the tests' many small programs in about three quarters of the time without
# LLVM's optimizations, and in half again with its older loop emitters in place of the MLIR fusion
# emitters; numerics are unchanged (no fast-math). One LLVM module per program, not split into
# parts compiled on threads: the split adds work that its threads repay only on idle cores, and a
# run with a test worker per core has none. A test whose programs run long (the eight-device
# expert loops, which level 0 slows more than it saves) pass `optimized=True`: level 1.
COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def xla_flags(devices: int | None = None, optimized: bool = False) -> str:
    """This run's $XLA_FLAGS (the tests' compile flags, tests/conftest.py) with `devices` fake CPU
    devices in place of any device count (none: XLA's default); `optimized`: LLVM's level 1 in
    place of the tests' level 0."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
    if optimized:
        flags = [("--xla_backend_optimization_level=1" if f == COMPILE_FLAGS[0] else f) for f in flags]
    return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def subprocess_env(devices: int, optimized: bool = False) -> dict[str, str]:
    """The environment of a JAX subprocess with `devices` fake CPU devices (`xla_flags`), reading and
    writing the run's compilation cache ($MCJAX_JAX_CACHE, tests/conftest.py) whatever a program took
    to compile."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices, optimized)
    env["JAX_PLATFORMS"] = "cpu"
    if cache := os.environ.get("MCJAX_JAX_CACHE"):
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo_server(log: Path, *options: str, name: str = "demo",
                      timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """`python -m dsr1 serve` on the demo model in float32, served as `name`, `options` added, its
    output in `log`; returned with its URL once `/health` answers."""
    import httpx

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "dsr1", "serve", "--dtype", "float32", "--port", str(port),
                                "--served-model-name", name, *options],
                               stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=log.parent)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    process.terminate()
    raise AssertionError(f"dsr1 serve did not start:\n{log.read_text()}")


def stop_server(process: subprocess.Popen) -> None:
    """End a server process (its drain included), killing it past a minute."""
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_processes(module: str, args: list[str], count: int = 2, devices: int = 2) -> list[subprocess.Popen]:
    """`python -m module *args --process-id=i` for i < count, each with `devices` fake CPU devices."""
    return [subprocess.Popen([sys.executable, "-m", module, *args, f"--process-id={i}"], env=subprocess_env(devices),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(count)]


def wait_processes(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    """Wait for every process (killing them all on the way out) and fail with the stderr of one that failed."""
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]


def join_processes(num_processes: int, process_id: int, port: int) -> None:
    """In a worker: join the `jax.distributed` group of `num_processes` on loopback over gloo (no-op for 1)."""
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)


def count_products(monkeypatch, module) -> dict[str, list[int]]:
    """The rows of every `rowwise_matmul` (XLA, one row at a time) and `kernel_matmul` (dsr1's CPU
    kernel) product that `module` traces from now on (per group of rows, for `x [g, rows, in]`), and of
    the kernel's fused expert products (`swiglu_rows_dot`, `combine_rows_dot`; `swiglu_pairs`,
    `combine_pairs`: their tokens) traced from anywhere."""
    from dsr1.cpu import ffi as cpu_kernels

    calls = {"rowwise_matmul": [], "kernel_matmul": [], "swiglu_rows_dot": [], "combine_rows_dot": [],
             "swiglu_pairs": [], "combine_pairs": []}
    for name, rows in calls.items():
        owner = cpu_kernels if name.endswith(("_rows_dot", "_pairs")) else module
        original = getattr(owner, name)
        axis = 0 if name.endswith("_pairs") else -2
        monkeypatch.setattr(owner, name,
                            lambda x, *args, f=original, c=rows, a=axis: c.append(x.shape[a]) or f(x, *args))
    return calls


def v5e_chip():
    """One chip of a v5e:2x2 slice from libtpu's deviceless topology (no TPU needed), to compile for."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1).devices[0]
