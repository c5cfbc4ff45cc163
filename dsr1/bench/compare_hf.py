"""dsr1 against HF transformers on the same checkpoint: one random checkpoint in the release
layout, loaded into HF `DeepseekV3ForCausalLM` (torch, CPU, bf16) and into dsr1, greedy generation
of both timed on the same prompts. torch and transformers are imported only here, inside the
functions: they are test-only dependencies."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..api import Model
from ..core.config import Config
from ..core.sharding import to_host
from ..weights.release import expected_tensors
from ..weights.safetensors_io import write_safetensors
from .accounting import mean_step_bytes
from .timing import best_of, time_decode

CHECKPOINT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


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
    written tensor by tensor so host memory holds one tensor at a time. The tensor list is dsr1's
    own (`expected_tensors`), so both dsr1 and HF read every tensor written. Each tensor depends on
    `seed` and its name only."""
    folder = Path(folder)
    np_dtype = CHECKPOINT_DTYPES[dtype]
    shapes = {name: e.shape for name, e in sorted(expected_tensors(cfg).items())}

    def value(name: str) -> np.ndarray:
        return _release_value(name, shapes[name], np.random.default_rng([seed, zlib.crc32(name.encode())]))

    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", {n: (s, np_dtype) for n, s in shapes.items()}, value)
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "torch_dtype": dtype}, indent=1))
    return folder


@dataclasses.dataclass(frozen=True)
class GenerateTiming:
    """Greedy generation of `new_tokens` per row: prefill seconds, decode seconds for the remaining
    `new_tokens - 1` steps, the generated ids `[B, new_tokens]`, and (dsr1 only) the mean bytes a
    decode step read (`accounting.mean_step_bytes`)."""

    prefill_s: float
    decode_s: float
    tokens: np.ndarray
    step_bytes: int | None = None

    @property
    def decode_steps(self) -> int:
        return self.tokens.shape[1] - 1

    def decode_tok_s(self, batch: int) -> float:
        return batch * self.decode_steps / self.decode_s


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
    """HF greedy generate: prefill time = generate(1 token); decode time = from the first generated
    token to the last within one generate(N tokens), clocked by a streamer (HF hands it the prompt,
    then each step's tokens). Each the best of `repeats` after a warm-up. (Subtracting generate(1)
    from generate(N), as before, came out negative when a noisy machine slowed the shorter run.)"""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.from_numpy(prompts.astype(np.int64))

    def generate(n: int) -> tuple[float, float, np.ndarray]:
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, streamer=clock)
        # times: the prompt, then one entry per generated step; the first step is the prefill.
        return time.perf_counter() - start, clock.times[-1] - clock.times[1], out[:, ids.shape[1]:].numpy()

    generate(new_tokens)  # warm-up
    prefill = min(generate(1)[0] for _ in range(repeats))
    _, decode, tokens = min((generate(new_tokens) for _ in range(repeats)), key=lambda r: r[1])
    return GenerateTiming(prefill, decode, tokens)


def dsr1_generate(model: Model, prompts: np.ndarray, new_tokens: int, repeats: int = 2) -> GenerateTiming:
    """dsr1 greedy generate: prefill (first token), then one jitted loop of `new_tokens - 1` decode
    steps, each timed as the best of `repeats` after a warm-up. The decode runs start from copies of
    the prefilled cache (the loop consumes its cache; a copy is cheaper than another prefill)."""
    max_len = prompts.shape[1] + new_tokens
    prefill, (logits, cache) = best_of(lambda: model.prefill(prompts, max_len=max_len), repeats)
    first = to_host(logits).argmax(-1).astype(np.int32)
    run = time_decode(model, lambda i: jax.tree.map(jnp.copy, cache), first, new_tokens - 1, repeats)
    tokens = np.concatenate([run.tokens.T, run.last[:, None]], axis=1)  # fed tokens = generated ones, then the last
    nbytes = mean_step_bytes(model.params, model.cfg, model.kv_cache_dtype, prompts.shape[1], run.tokens,
                             run.expert_ids)
    return GenerateTiming(prefill, run.seconds, tokens, nbytes.total)


def compare_row(batch: int, ours: GenerateTiming, hf: GenerateTiming, prefill_flop: float,
                peak_flop_s: float, read_gbs: float) -> dict[str, Any]:
    """One line of the comparison: decode tok/s of both and their ratio, prefill times, dsr1's prefill
    FLOP/s (`prefill_flop` / its time) against `peak_flop_s` (`prefill.matmul_peak_flops`), agreement;
    and dsr1's decode against the memory: its achieved GB/s as a share of `read_gbs`
    (`bandwidth.read_bandwidth`), the step time that reading its bytes at that rate takes (the floor),
    and the ratio to HF a step at the floor would give."""
    flop_s = prefill_flop / ours.prefill_s
    step_s = ours.decode_s / ours.decode_steps
    floor_s = ours.step_bytes / (read_gbs * 1e9)
    return {
        "batch": batch, "dsr1_tok_s": ours.decode_tok_s(batch), "hf_tok_s": hf.decode_tok_s(batch),
        "ratio": ours.decode_tok_s(batch) / hf.decode_tok_s(batch),
        "dsr1_prefill_s": ours.prefill_s, "hf_prefill_s": hf.prefill_s, "prefill_ratio": hf.prefill_s / ours.prefill_s,
        "prefill_gflop_s": flop_s / 1e9, "prefill_pct_of_peak": 100 * flop_s / peak_flop_s,
        "dsr1_decode_s": ours.decode_s, "hf_decode_s": hf.decode_s,
        "read_gbs": read_gbs, "dsr1_mb_per_step": ours.step_bytes / 1e6, "dsr1_step_ms": 1e3 * step_s,
        "floor_step_ms": 1e3 * floor_s,
        "hf_step_ms": 1e3 * hf.decode_s / hf.decode_steps, "pct_of_read_bw": 100 * floor_s / step_s,
        "ratio_at_floor": hf.decode_s / hf.decode_steps / floor_s,
        "same_first_token": float(np.mean(ours.tokens[:, 0] == hf.tokens[:, 0])),
        "same_tokens": float(np.mean(ours.tokens == hf.tokens)),
    }
