"""Printing benchmark results: Markdown tables (readable in a terminal, pasteable into docs), the
device line and the model line. Units: MB = 1e6 bytes, GB/s = 1e9 bytes per second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..api import Model

DECODE_NOTES = """\
MB read/step: bytes a decode step must read (MB = 1e6 B): attention, dense-MLP and shared-expert weights,
  routers, norms and lm_head; the embedding rows of the step's tokens; only the distinct routed experts the
  batch hit in each MoE layer (experts/layer, averaged over the steps); and the cached latents up to each
  row's length, all layers (int8 values + scales when quantized).
achieved GB/s = MB read/step / step time. % of copy BW = achieved GB/s / the measured copy bandwidth
  (a jitted x + 1 over {copy_mb:.0f} MB: bytes read + written per second) = {copy_gbs:.2f} GB/s.
% of read BW = achieved GB/s / the measured read bandwidth (a jitted max over {copy_mb:.0f} MB of bfloat16: bytes
  read per second) = {read_gbs:.2f} GB/s: a step that only streams its bytes from memory reaches 100%; weights
  the caches still hold from the last step can take it past."""

PREFILL_NOTES = """\
GFLOP = the matmul FLOPs of the prefill (2 per multiply-add): every projection, the routed experts each token is
  routed to, causal attention, lm_head at each row's last token (dsr1.bench.prefill.prefill_flops).
% of peak = GFLOP/s / the matmul peak measured in this run (model FLOPs utilization)."""

EXPERT_NOTES = """\
experts hit: distinct routed experts the tokens chose; MB hit: their gate, up and down bytes (what an ideal kernel
  reads). GB/s = MB hit / time; GFLOP/s = the routed work (2 x tokens x top-k x 3 x hidden x moe_intermediate) / time
  (dense computes every expert: experts / top-k times that).
rel. diff = max |out - {reference}'s out| / max |{reference}'s out|."""

COMPARE_NOTES = """\
decode tok/s = batch x (new tokens - 1) / decode time. HF decode time: first to last generated token within
generate(N), clocked by a streamer; prefill time = generate(1). dsr1: prefill, then one jitted loop of N - 1 steps.
same first token: rows whose first greedy token (from the prefill) agrees; bf16 rounding differs between the
two, so later tokens may diverge.
Decode against the memory: MB read/step as `decode` counts it, for dsr1's decode loop (prompt + generated
  positions, the experts its tokens hit); floor ms = MB read/step / read GB/s, the read bandwidth measured just before
  and just after dsr1's runs of that batch (the faster of the two; a jitted max over {read_mb:.0f} MB of bfloat16):
  a step cannot stream its bytes faster (caches aside).
  dsr1 / HF at the floor = HF ms/step / floor ms: the most a decode bound by this memory can gain on HF."""


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A right-aligned Markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
                     + [line(r) for r in rows])


def decode_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `decode` command's table, one line per (batch, context)."""
    headers = ("batch", "context", "tok/s per seq", "aggregate tok/s", "MB read/step", "achieved GB/s",
               "% of copy BW", "% of read BW", "ms/step", "experts/layer")
    cells = [(str(r["batch"]), str(r["context"]), f"{r['tok_s_per_seq']:.1f}", f"{r['tok_s']:.1f}",
              f"{r['mb_per_step']:.1f}", f"{r['achieved_gbs']:.2f}", f"{r['pct_of_copy_bw']:.1f}%",
              f"{r['pct_of_read_bw']:.1f}%",
              f"{r['step_ms']:.1f}", f"{r['distinct_experts_per_layer']:.1f}") for r in rows]
    return markdown_table(headers, cells)


def prefill_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `prefill` command's table, one line per (batch, tokens)."""
    headers = ("batch", "tokens", "ms", "tok/s", "GFLOP", "GFLOP/s", "% of matmul peak")
    cells = [(str(r["batch"]), str(r["tokens"]), f"{r['ms']:.1f}", f"{r['tok_s']:.0f}", f"{r['gflop']:.1f}",
              f"{r['gflop_s']:.1f}", f"{r['pct_of_peak']:.1f}%") for r in rows]
    return markdown_table(headers, cells)


def expert_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `moe` command's table, one line per (token count, kernel)."""
    headers = ("kernel", "tokens", "ms", "experts hit", "MB hit", "GB/s", "GFLOP/s", "rel. diff")
    cells = [(r["kernel"], str(r["tokens"]), f"{r['ms']:.2f}", str(r["experts_hit"]), f"{r['mb_hit']:.1f}",
              f"{r['gb_s']:.2f}", f"{r['gflop_s']:.1f}", f"{r['max_rel_diff']:.1e}") for r in rows]
    return markdown_table(headers, cells)


def compare_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `compare-hf` command's table, one line per batch size."""
    headers = ("batch", "dsr1 decode tok/s", "HF decode tok/s", "dsr1 / HF", "dsr1 prefill ms", "HF prefill ms",
               "HF / dsr1 prefill", "dsr1 prefill GFLOP/s", "% of matmul peak", "same first token", "same tokens")
    cells = [(str(r["batch"]), f"{r['dsr1_tok_s']:.1f}", f"{r['hf_tok_s']:.1f}", f"{r['ratio']:.2f}x",
              f"{1e3 * r['dsr1_prefill_s']:.0f}", f"{1e3 * r['hf_prefill_s']:.0f}", f"{r['prefill_ratio']:.2f}x",
              f"{r['prefill_gflop_s']:.1f}", f"{r['prefill_pct_of_peak']:.1f}%",
              f"{100 * r['same_first_token']:.0f}%", f"{100 * r['same_tokens']:.0f}%") for r in rows]
    return markdown_table(headers, cells)


def compare_floor_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `compare-hf` command's second table: dsr1's decode step against the read bandwidth."""
    headers = ("batch", "MB read/step", "read GB/s", "dsr1 ms/step", "floor ms/step", "% of read BW", "HF ms/step",
               "dsr1 / HF", "dsr1 / HF at the floor")
    cells = [(str(r["batch"]), f"{r['dsr1_mb_per_step']:.1f}", f"{r['read_gbs']:.2f}", f"{r['dsr1_step_ms']:.2f}",
              f"{r['floor_step_ms']:.2f}",
              f"{r['pct_of_read_bw']:.1f}%", f"{r['hf_step_ms']:.2f}", f"{r['ratio']:.2f}x",
              f"{r['ratio_at_floor']:.2f}x") for r in rows]
    return markdown_table(headers, cells)


SERVE_NOTES = """\
continuous: dsr1.serving.Engine; static: dsr1.generate on the requests in arrival order, in batches of max_seqs, each
  batch starting when its last request has arrived and the previous batch is done (programs compiled beforehand).
tok/s = generated tokens / (last token - first arrival). TTFT = first token on the host - arrival. ITL = per request,
  (last token - first token) / (tokens - 1); static rows count their tokens at the batch's decode step time, as if
  streamed. prefix hits = prompt tokens served from the prefix cache / prompt tokens. host / device ms per step: the
  engine loop's own work per step (planning, dispatch, reading tokens) and the device's time per step."""


DISAGGREGATE_NOTES = """\
mixed: one dsr1.serving.Engine on every device, its prefill and decode calls taking turns; disaggregated P:D:
  Engine(disaggregate=(P, D)), prompts prefilled on the first P devices and requests decoded on the next D, each side
  with its own weights and page pool, prefilled pages moved to the decode side as they are written. Columns as for
  continuous batching (the `serve` command without --disaggregate)."""


def serve_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `serve` command's table, one line per way of serving the workload."""
    headers = ("serving", "requests", "tokens", "seconds", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms", "prefix hits", "host ms/step", "device ms/step")

    def maybe(row: dict[str, Any], key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    cells = [(r["name"], str(r["requests"]), str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tok_s']:.1f}",
              f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}", f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
              maybe(r, "prefix_hit_rate", ".1%"), maybe(r, "host_ms_per_step", ".1f"),
              maybe(r, "device_ms_per_step", ".1f")) for r in rows]
    return markdown_table(headers, cells)


def model_line(model: Model, name: str) -> str:
    """The model's shape and precision in one line."""
    cfg = model.cfg
    return (f"model: {name}, {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} "
            f"MoE), {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, weights {model.dtype}"
            f"{' int8' if model.quant else ''} {model.weight_bytes() / 1e6:.0f} MB, "
            f"KV cache {model.kv_cache_dtype or model.dtype}")


def device_line(dev: dict[str, Any]) -> str:
    """The device description (`bandwidth.device_description`) in one line."""
    line = f"device: {dev['device_kind']} ({dev['platform']}, {dev['device_count']} device(s)"
    if "cpu" in dev:
        line += (f", {dev['cpu']}, {dev['cores']} cores; 1-min load average {dev['load_avg_start']:.1f} at the start, "
                 f"{dev['load_avg_end']:.1f} at the end")
    return line + f"), jax {dev['jax']}"
