"""`python -m dsr1.bench`: decode throughput against the memory roofline, and dsr1 against HF transformers.

    python -m dsr1.bench decode --batch 1,8,32 --context 32,512,4096 [--quant int8] [--kv-cache-dtype int8]
    python -m dsr1.bench compare-hf [--preset bench] [--batch 1,8] [--new-tokens 32]

`decode` times `--steps` greedy decode steps inside one jitted program (a `fori_loop` feeding back
the argmax token, the cache donated) on a cache built directly at the asked context length (no
prefill), and counts the bytes each step must read: every weight a step touches, the embedding
rows of its tokens, only the routed experts the batch actually hit in each MoE layer (from the ids
`decode_step` returns), and the cached latents up to each row's length. Bytes / step time is the
achieved bandwidth, reported against the device's *measured* copy bandwidth (a jitted `x + 1` on a
large array: bytes read + bytes written per second).

`compare-hf` writes one random checkpoint in the release layout, loads it into HF
`DeepseekV3ForCausalLM` (torch, bf16) and into dsr1, and times greedy decode of both on the same
prompts. torch and transformers are imported only there: they are test-only dependencies.

Units: MB = 1e6 bytes, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from ..api import Model, init_random, load
from ..core.cache import KVCache, check_kv_cache_dtype, quantize_latent
from ..weights.release import expected_tensors
from ..core.config import Config
from ..core.model import decode_step
from ..core.params import Params
from ..core.sharding import make_mesh, replicated, to_host

COPY_BYTES = 2**29  # 512 MiB: far beyond any cache, so the copy runs at memory speed
ROUTED = ("gate", "up", "down")  # the routed-expert stacks under params["moe_layers"]["moe"]
DECODE_COLUMNS = ("batch", "context", "tok_s_per_seq", "tok_s", "mb_per_step", "achieved_gbs", "pct_of_copy_bw")


def _log(msg: str) -> None:
    """Progress goes to stderr so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


# ---- what a decode step reads --------------------------------------------------------------------

def _nbytes(tree: Any) -> int:
    """Bytes of every array in a pytree (int8 values and their scales both count)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def expert_bytes(params: Params) -> int:
    """Bytes of ONE routed expert of one layer: its gate, up and down weights (with int8 scales)."""
    moe = params.get("moe_layers", {}).get("moe")
    if moe is None:
        return 0
    layers, experts = moe["gate"].shape[:2]
    return _nbytes([moe[k] for k in ROUTED]) // (layers * experts)


def fixed_weight_bytes(params: Params) -> int:
    """Bytes every decode step reads whatever the tokens: all weights except the embedding table
    (a step reads only its tokens' rows), the routed experts (only those hit) and the MTP module
    (decode never runs it)."""
    total = _nbytes({k: v for k, v in params.items() if k not in ("embed", "moe_layers", "mtp")})
    if "moe_layers" in params:
        stack = params["moe_layers"]
        total += _nbytes({k: v for k, v in stack.items() if k != "moe"})
        total += _nbytes({k: v for k, v in stack["moe"].items() if k not in ROUTED})
    return total


def cache_token_bytes(cfg: Config, dtype: Any, kv_cache_dtype: str | None) -> int:
    """Bytes of one cached position of one layer: the latent `c_kv` (int8 + a float32 scale with the
    int8 cache) and `k_pe` (always in the model's dtype)."""
    item = jnp.dtype(dtype).itemsize
    latent = cfg.kv_lora_rank + 4 if check_kv_cache_dtype(kv_cache_dtype) == "int8" else cfg.kv_lora_rank * item
    return latent + cfg.qk_rope_head_dim * item


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """What one decode step reads, split by kind (bytes)."""

    fixed_weights: int  # attention, dense MLP, shared experts, routers, norms, lm_head
    experts: int  # the distinct routed experts hit, summed over MoE layers
    embed: int  # the embedding rows of the step's (distinct) tokens
    cache: int  # cached latents up to each row's length, all layers
    distinct_experts: float  # mean distinct routed experts per MoE layer

    @property
    def total(self) -> int:
        return self.fixed_weights + self.experts + self.embed + self.cache


def step_bytes(params: Params, cfg: Config, kv_cache_dtype: str | None, lengths: np.ndarray, tokens: np.ndarray,
               expert_ids: np.ndarray | None) -> StepBytes:
    """Bytes one decode step reads, given its rows' cached `lengths [B]`, its input `tokens [B]` and
    the routed expert ids it chose, `[L_moe, B, K]` (None without MoE layers)."""
    embed = params["embed"]
    per_layer = [] if expert_ids is None else [len(np.unique(layer)) for layer in np.asarray(expert_ids)]
    cache = int(np.asarray(lengths, np.int64).sum()) * cfg.num_hidden_layers
    return StepBytes(
        fixed_weights=fixed_weight_bytes(params),
        experts=sum(per_layer) * expert_bytes(params),
        embed=len(np.unique(np.asarray(tokens))) * embed.shape[1] * embed.dtype.itemsize,
        cache=cache * cache_token_bytes(cfg, embed.dtype, kv_cache_dtype),
        distinct_experts=float(np.mean(per_layer)) if per_layer else 0.0,
    )


def mean_step_bytes(params: Params, cfg: Config, kv_cache_dtype: str | None, context: int, tokens: np.ndarray,
                    expert_ids: np.ndarray | None) -> StepBytes:
    """`step_bytes` averaged over a run: `tokens [steps, B]` fed at each step, `expert_ids
    [steps, L_moe, B, K]`; at step i every row holds `context + i` cached positions."""
    steps, batch = tokens.shape
    per_step = [step_bytes(params, cfg, kv_cache_dtype, np.full(batch, context + i), tokens[i],
                           None if expert_ids is None else expert_ids[i]) for i in range(steps)]
    mean = lambda f: sum(getattr(s, f) for s in per_step) / steps  # noqa: E731
    return StepBytes(*(round(mean(f)) for f in ("fixed_weights", "experts", "embed", "cache")),
                     distinct_experts=mean("distinct_experts"))


# ---- the device's copy bandwidth -----------------------------------------------------------------

def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Measured memory bandwidth in GB/s: the best of `repeats` runs of a jitted `x + 1` over
    `nbytes` of float32 (in place: the input is donated), counting bytes read plus bytes written.
    `x + 1` cannot be elided, unlike a copy of an unchanged buffer."""
    bump = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = jax.block_until_ready(bump(jnp.zeros(nbytes // 4, jnp.float32)))  # compile, touch every page
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(bump(x))
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def device_description() -> dict[str, Any]:
    """The device the benchmark ran on, for the report."""
    dev = jax.devices()[0]
    desc = {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "jax": jax.__version__}
    if dev.platform == "cpu":
        # Other processes share a CPU: the load average tells how much of it the benchmark had.
        desc.update(cpu=_cpu_model(), cores=os.cpu_count(), load_avg_start=os.getloadavg()[0])
    return desc


def _finish(dev: dict[str, Any]) -> dict[str, Any]:
    """The device description with the load average at the end of the run (CPU only)."""
    return {**dev, "load_avg_end": os.getloadavg()[0]} if "cpu" in dev else dev


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---- the timed decode loop -----------------------------------------------------------------------

def _decode_loop(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                 steps: int) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """`steps` greedy decode steps in one program. Returns the grown cache, the tokens fed at each
    step `[steps, B]` (the first is `tokens`, then each step's argmax) and the routed expert ids of
    each step `[steps, L_moe, B, K]`, and the last step's argmax `[B]`."""
    batch, k = tokens.shape[0], cfg.num_experts_per_tok
    fed = jnp.zeros((steps, batch), jnp.int32)
    ids = jnp.zeros((steps, cfg.num_moe_layers, batch, k), jnp.int32)

    def body(i, carry):
        cache, tokens, fed, ids = carry
        logits, cache, routed = decode_step(params, cache, tokens, cfg=cfg, mesh=mesh)
        fed = fed.at[i].set(tokens)
        if routed is not None:
            ids = ids.at[i].set(routed)
        return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), fed, ids

    cache, last, fed, ids = jax.lax.fori_loop(0, steps, body, (cache, tokens, fed, ids))
    return cache, fed, ids, last


decode_loop = jax.jit(_decode_loop, static_argnames=("cfg", "mesh", "steps"), donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "context", "max_len", "dtype", "kv_cache_dtype", "mesh"))
def _random_cache(key: jax.Array, *, cfg: Config, batch: int, context: int, max_len: int, dtype: Any,
                  kv_cache_dtype: str | None, mesh: Mesh) -> KVCache:
    layers = cfg.num_hidden_layers
    k_lat, k_pe = jax.random.split(key)
    c_kv = jax.random.normal(k_lat, (layers, batch, max_len, cfg.kv_lora_rank), jnp.float32)
    pe = jax.random.normal(k_pe, (layers, batch, max_len, cfg.qk_rope_head_dim), jnp.float32).astype(dtype)
    if kv_cache_dtype == "int8":
        c_kv, c_scale = quantize_latent(c_kv)
    else:
        c_kv, c_scale = c_kv.astype(dtype), None
    cache = KVCache(c_kv, pe, c_scale, jnp.full((batch,), context, jnp.int32))
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, replicated(mesh)), cache)


def random_cache(model: Model, batch: int, context: int, max_len: int, seed: int = 0) -> KVCache:
    """A cache as if `batch` prompts of `context` tokens had been prefilled (random latents of the
    model's cache dtype), with room for `max_len` positions, replicated on the model's mesh."""
    return _random_cache(jax.random.key(seed), cfg=model.cfg, batch=batch, context=context, max_len=max_len,
                         dtype=model.dtype, kv_cache_dtype=model.kv_cache_dtype, mesh=model.mesh)


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """One timed decode loop: wall time, and what was fed and routed at each step (host arrays)."""

    seconds: float
    tokens: np.ndarray  # [steps, B] tokens fed
    expert_ids: np.ndarray | None  # [steps, L_moe, B, K]
    last: np.ndarray  # [B] the argmax after the last step


def time_decode(model: Model, make_cache: Callable[[int], KVCache], tokens: np.ndarray, steps: int,
                repeats: int = 1) -> DecodeRun:
    """Compile and warm up the decode loop, then time it `repeats` times on fresh caches
    (`make_cache(i)`: the loop consumes its cache) and keep the fastest run."""
    put = lambda x: jax.device_put(np.asarray(x, np.int32), replicated(model.mesh))  # noqa: E731
    run = functools.partial(decode_loop, model.params, cfg=model.cfg, mesh=model.mesh, steps=steps)
    jax.block_until_ready(run(make_cache(0), put(tokens)))  # compile + warm-up
    best = None
    for i in range(repeats):
        cache, start_tokens = jax.block_until_ready((make_cache(i + 1), put(tokens)))
        start = time.perf_counter()
        out = jax.block_until_ready(run(cache, start_tokens))
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, out[1:])  # drop the grown cache: only what was fed and routed is kept
        del cache, out
    seconds, (fed, ids, last) = best
    return DecodeRun(seconds, to_host(fed), to_host(ids) if model.cfg.num_moe_layers else None, to_host(last))


def decode_row(batch: int, context: int, steps: int, seconds: float, nbytes: StepBytes,
               copy_gbs: float) -> dict[str, Any]:
    """One line of the decode table. `achieved_gbs` = bytes per step / step time."""
    step_s = seconds / steps
    achieved = nbytes.total / step_s / 1e9
    return {
        "batch": batch, "context": context, "tok_s_per_seq": 1 / step_s, "tok_s": batch / step_s,
        "mb_per_step": nbytes.total / 1e6, "achieved_gbs": achieved, "pct_of_copy_bw": 100 * achieved / copy_gbs,
        "step_ms": 1e3 * step_s, "bytes_per_step": nbytes.total, "distinct_experts_per_layer": nbytes.distinct_experts,
        "bytes": {"fixed_weights": nbytes.fixed_weights, "experts": nbytes.experts, "embed": nbytes.embed,
                  "cache": nbytes.cache},
    }


def bench_decode_point(model: Model, batch: int, context: int, steps: int, copy_gbs: float, seed: int = 0,
                       repeats: int = 1) -> dict[str, Any]:
    """Time `steps` decode steps at one (batch, context) and account their bytes."""
    cfg = model.cfg
    max_len = context + steps + 1
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"context {context} + {steps} steps exceeds max_position_embeddings={cfg.max_position_embeddings}")
    tokens = np.random.default_rng(seed).integers(2, cfg.vocab_size, batch)
    make_cache = lambda i: random_cache(model, batch, context, max_len, seed=seed + i)  # noqa: E731
    run = time_decode(model, make_cache, tokens, steps, repeats)
    nbytes = mean_step_bytes(model.params, cfg, model.kv_cache_dtype, context, run.tokens, run.expert_ids)
    return decode_row(batch, context, steps, run.seconds, nbytes, copy_gbs)


# ---- printing --------------------------------------------------------------------------------------

def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into docs)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
                     + [line(r) for r in rows])


def decode_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ("batch", "context", "tok/s per seq", "aggregate tok/s", "MB read/step", "achieved GB/s",
               "% of copy BW", "ms/step", "experts/layer")
    cells = [(str(r["batch"]), str(r["context"]), f"{r['tok_s_per_seq']:.1f}", f"{r['tok_s']:.1f}",
              f"{r['mb_per_step']:.1f}", f"{r['achieved_gbs']:.2f}", f"{r['pct_of_copy_bw']:.1f}%",
              f"{r['step_ms']:.1f}", f"{r['distinct_experts_per_layer']:.1f}") for r in rows]
    return _table(headers, cells)


DECODE_NOTES = """\
MB read/step: bytes a decode step must read (MB = 1e6 B): attention, dense-MLP and shared-expert weights,
  routers, norms and lm_head; the embedding rows of the step's tokens; only the distinct routed experts the
  batch hit in each MoE layer (experts/layer, averaged over the steps); and the cached latents up to each
  row's length, all layers (int8 values + scales when quantized).
achieved GB/s = MB read/step / step time. % of copy BW = achieved GB/s / the measured copy bandwidth
  (a jitted x + 1 over {copy_mb:.0f} MB: bytes read + written per second) = {copy_gbs:.2f} GB/s."""


def _describe(model: Model, preset: str) -> str:
    cfg = model.cfg
    return (f"model: {preset}, {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} "
            f"MoE), {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, weights {model.dtype}"
            f"{' int8' if model.quant else ''} {model.weight_bytes() / 1e6:.0f} MB, "
            f"KV cache {model.kv_cache_dtype or model.dtype}")


def _device_line(dev: dict[str, Any]) -> str:
    line = f"device: {dev['device_kind']} ({dev['platform']}, {dev['device_count']} device(s)"
    if "cpu" in dev:
        line += (f", {dev['cpu']}, {dev['cores']} cores; 1-min load average {dev['load_avg_start']:.1f} at the start, "
                 f"{dev['load_avg_end']:.1f} at the end")
    return line + f"), jax {dev['jax']}"


# ---- the decode command -------------------------------------------------------------------------------

def _config(args: argparse.Namespace) -> tuple[Config, str]:
    if args.config:
        return Config.from_hf(args.config), str(args.config)
    return Config.preset(args.preset), args.preset


def cmd_decode(args: argparse.Namespace) -> dict[str, Any]:
    cfg, name = _config(args)
    dev = device_description()
    copy_nbytes = args.copy_mb * 2**20
    _log(f"measuring copy bandwidth (x + 1 over {copy_nbytes / 1e6:.0f} MB) ...")
    copy_gbs = copy_bandwidth(copy_nbytes)
    _log(f"building {name} (random weights{', int8' if args.quant else ''}) ...")
    model = init_random(cfg, seed=args.seed, mesh=make_mesh(), dtype=args.dtype, quant=args.quant,
                        kv_cache_dtype=args.kv_cache_dtype)
    rows = []
    points = [(b, c) for b in args.batch for c in args.context]
    for i, (batch, context) in enumerate(points):
        _log(f"[{i + 1}/{len(points)}] batch {batch}, context {context}: compile, warm up, time {args.steps} steps ...")
        rows.append(bench_decode_point(model, batch, context, args.steps, copy_gbs, seed=args.seed,
                                       repeats=args.repeats))
        _log(f"    {rows[-1]['step_ms']:.1f} ms/step, {rows[-1]['achieved_gbs']:.2f} GB/s")
    dev = _finish(dev)
    print(_device_line(dev))
    print(_describe(model, name))
    print(f"{args.steps} greedy decode steps in one jitted loop per point (best of {args.repeats})\n")
    print(decode_table(rows))
    print()
    print(DECODE_NOTES.format(copy_mb=copy_nbytes / 1e6, copy_gbs=copy_gbs))
    result = {
        "command": "decode", "device": dev, "model": name, "config": dataclasses.asdict(cfg), "dtype": args.dtype,
        "quant": args.quant, "kv_cache_dtype": args.kv_cache_dtype, "steps": args.steps, "repeats": args.repeats,
        "weight_bytes": model.weight_bytes(), "expert_bytes": expert_bytes(model.params),
        "fixed_weight_bytes": fixed_weight_bytes(model.params), "copy_gbs": copy_gbs,
        "copy_definition": f"jitted x + 1 over {copy_nbytes} bytes of float32 (donated, in place), "
                           f"(bytes read + bytes written) / best of 5",
        "columns": list(DECODE_COLUMNS), "rows": rows,
    }
    return result


# ---- compare-hf: the same checkpoint through HF transformers and dsr1 -------------------------------

def _release_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random release-layout tensor (float32): norms 1, small correction biases, unit-variance
    embeddings, and linear `[out, in]` weights of std 1/sqrt(in)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith("e_score_correction_bias"):
        return rng.uniform(-0.01, 0.01, shape).astype(np.float32)
    w = rng.standard_normal(shape, np.float32)
    return w if "embed_tokens" in name else w * np.float32(shape[-1] ** -0.5)


def write_random_checkpoint(folder: Path, cfg: Config, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A random checkpoint in the DeepSeek release layout (one safetensors file, `config.json`),
    tensor by tensor so host memory holds one tensor at a time. The tensor list is dsr1's own
    (`checkpoint.expected_tensors`), so both dsr1 and HF read every tensor written."""
    np_dtype, st_dtype = {"bfloat16": (ml_dtypes.bfloat16, "BF16"), "float32": (np.float32, "F32")}[dtype]
    tensors = {name: e.shape for name, e in sorted(expected_tensors(cfg).items())}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in tensors.items():
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            f.write(np.ascontiguousarray(_release_value(name, shape, rng).astype(np_dtype)).tobytes())
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "torch_dtype": dtype}, indent=1))
    return folder


@dataclasses.dataclass(frozen=True)
class GenerateTiming:
    """Greedy generation of `new_tokens` per row: prefill seconds, decode seconds for the remaining
    `new_tokens - 1` steps, and the generated ids `[B, new_tokens]`."""

    prefill_s: float
    decode_s: float
    tokens: np.ndarray

    def decode_tok_s(self, batch: int) -> float:
        return batch * (self.tokens.shape[1] - 1) / self.decode_s


def load_hf(folder: Path) -> Any:
    """HF transformers' DeepseekV3ForCausalLM (torch, CPU, bf16) from a release-layout folder, with
    torch using every core."""
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(os.cpu_count() or 1)
    return DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()


def hf_generate(model: Any, prompts: np.ndarray, new_tokens: int, repeats: int = 2) -> GenerateTiming:
    """HF greedy generate. Decode time = generate(N tokens) minus generate(1 token) (which is the
    prefill), each the best of `repeats` after a warm-up."""
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))

    def generate(n: int) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out[:, ids.shape[1]:].numpy()

    generate(new_tokens)  # warm-up
    prefill = min(generate(1)[0] for _ in range(repeats))
    full, tokens = min((generate(new_tokens) for _ in range(repeats)), key=lambda r: r[0])
    return GenerateTiming(prefill, full - prefill, tokens)


def dsr1_generate(model: Model, prompts: np.ndarray, new_tokens: int, repeats: int = 2) -> GenerateTiming:
    """dsr1 greedy generate: prefill (first token), then one jitted loop of `new_tokens - 1` decode
    steps, each timed as the best of `repeats` after a warm-up. The decode runs start from copies of
    the prefilled cache (the loop consumes its cache; a copy is cheaper than another prefill)."""
    max_len = prompts.shape[1] + new_tokens
    jax.block_until_ready(model.prefill(prompts, max_len=max_len))  # compile
    prefill = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        logits, cache = jax.block_until_ready(model.prefill(prompts, max_len=max_len))
        prefill = min(prefill, time.perf_counter() - start)
    first = to_host(logits).argmax(-1).astype(np.int32)
    run = time_decode(model, lambda i: jax.tree.map(jnp.copy, cache), first, new_tokens - 1, repeats)
    tokens = np.concatenate([run.tokens.T, run.last[:, None]], axis=1)  # fed tokens = generated ones, then the last
    return GenerateTiming(prefill, run.seconds, tokens)


def cmd_compare_hf(args: argparse.Namespace) -> dict[str, Any]:
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (the first token comes from the prefill)")
    cfg, name = _config(args)
    dev = device_description()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsr1-bench-") as tmp:
        folder = Path(tmp) / "checkpoint"
        _log(f"writing a random {name} checkpoint (release layout, bf16) ...")
        write_random_checkpoint(folder, cfg, seed=args.seed)
        _log(f"loading it into dsr1 ({args.dsr1_dtype}) ...")
        model = load(folder, mesh=make_mesh(), dtype=args.dsr1_dtype, progress=False)
        _log("loading it into HF transformers (bf16) ...")
        hf_model = load_hf(folder)
        rng = np.random.default_rng(args.seed)
        for batch in args.batch:
            prompts = rng.integers(2, cfg.vocab_size, (batch, args.prompt_len)).astype(np.int32)
            _log(f"batch {batch}: dsr1 ...")
            ours = dsr1_generate(model, prompts, args.new_tokens, args.repeats)
            _log(f"batch {batch}: HF transformers ...")
            hf = hf_generate(hf_model, prompts, args.new_tokens, args.repeats)
            rows.append(compare_row(batch, ours, hf))
    dev = _finish(dev)
    print(_device_line(dev))
    print(f"model: {name}, random weights (one bf16 checkpoint read by both; HF in bfloat16, dsr1 in "
          f"{args.dsr1_dtype}); prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens; "
          f"torch threads {os.cpu_count()}\n")
    print(compare_table(rows))
    print("\ndecode tok/s = batch x (new tokens - 1) / decode time. HF decode time = generate(N) - generate(1); "
          "dsr1: prefill, then one jitted loop of N - 1 steps.\nsame first token: rows whose first greedy token "
          "(from the prefill) agrees; bf16 rounding differs between the two, so later tokens may diverge.")
    return {"command": "compare-hf", "device": dev, "model": name, "config": dataclasses.asdict(cfg),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch_threads": os.cpu_count(),
            "hf_dtype": "bfloat16", "dsr1_dtype": args.dsr1_dtype,
            "rows": rows}


def compare_row(batch: int, ours: GenerateTiming, hf: GenerateTiming) -> dict[str, Any]:
    return {
        "batch": batch, "dsr1_tok_s": ours.decode_tok_s(batch), "hf_tok_s": hf.decode_tok_s(batch),
        "ratio": ours.decode_tok_s(batch) / hf.decode_tok_s(batch),
        "dsr1_prefill_s": ours.prefill_s, "hf_prefill_s": hf.prefill_s,
        "dsr1_decode_s": ours.decode_s, "hf_decode_s": hf.decode_s,
        "same_first_token": float(np.mean(ours.tokens[:, 0] == hf.tokens[:, 0])),
        "same_tokens": float(np.mean(ours.tokens == hf.tokens)),
    }


def compare_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ("batch", "dsr1 decode tok/s", "HF decode tok/s", "dsr1 / HF", "dsr1 prefill ms", "HF prefill ms",
               "same first token", "same tokens")
    cells = [(str(r["batch"]), f"{r['dsr1_tok_s']:.1f}", f"{r['hf_tok_s']:.1f}", f"{r['ratio']:.2f}x",
              f"{1e3 * r['dsr1_prefill_s']:.0f}", f"{1e3 * r['hf_prefill_s']:.0f}",
              f"{100 * r['same_first_token']:.0f}%", f"{100 * r['same_tokens']:.0f}%") for r in rows]
    return _table(headers, cells)


# ---- command line ----------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="bench", help="named config with random weights (default: bench, "
                     "~1 GB of bf16 weights, memory-bound on CPU; tiny for a quick check)")
    src.add_argument("--config", metavar="PATH", help="a HF config.json instead of a preset (random weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and caches (default: 0)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point after a warm-up; the fastest "
                   "is reported (default: 2)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsr1.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    dec = sub.add_parser("decode", help="decode tok/s and achieved bandwidth vs the measured copy bandwidth",
                         description="Times greedy decode steps in one jitted loop at each (batch, context) on a "
                                     "directly built cache, and reports the bytes a step must read against the "
                                     "device's measured copy bandwidth.")
    dec.add_argument("--batch", type=_ints, default=[1, 8, 32], help="comma-separated batch sizes (default: 1,8,32)")
    dec.add_argument("--context", type=_ints, default=[32, 512, 4096],
                     help="comma-separated cached lengths per row (default: 32,512,4096)")
    dec.add_argument("--steps", type=int, default=16, help="decode steps timed per point (default: 16)")
    dec.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype")
    dec.add_argument("--quant", choices=["int8"], help="int8 matmul weights with per-channel scales")
    dec.add_argument("--kv-cache-dtype", choices=["int8"], help="int8 latent cache with per-token scales")
    dec.add_argument("--copy-mb", type=int, default=COPY_BYTES // 2**20,
                     help=f"MiB of the array whose x + 1 measures the copy bandwidth (default: {COPY_BYTES // 2**20})")
    _model_args(dec)
    cmp = sub.add_parser("compare-hf", help="decode tok/s of HF transformers (torch, bf16) and dsr1 on the same "
                                            "random checkpoint",
                         description="Writes one random release-layout checkpoint, loads it into HF "
                                     "DeepseekV3ForCausalLM (torch, CPU, bf16) and into dsr1, and times greedy "
                                     "decode of both on the same prompts. Needs torch and transformers.")
    cmp.add_argument("--batch", type=_ints, default=[1, 8], help="comma-separated batch sizes (default: 1,8)")
    cmp.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per row (default: 32)")
    cmp.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row (default: 32)")
    cmp.add_argument("--dsr1-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                     help="dtype dsr1 holds the (bf16) checkpoint in; HF always runs bf16 (default: bfloat16)")
    _model_args(cmp)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "steps", 1) < 1 or args.repeats < 1:
        raise SystemExit("--steps and --repeats must be at least 1")
    result = cmd_decode(args) if args.command == "decode" else cmd_compare_hf(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        _log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
