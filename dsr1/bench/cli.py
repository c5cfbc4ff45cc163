"""`python -m dsr1.bench`: decode throughput against the memory roofline, and dsr1 against HF
transformers.

    python -m dsr1.bench decode --batch 1,8,32 --context 32,512,4096 [--quant int8] [--kv-cache-dtype int8]
    python -m dsr1.bench compare-hf [--preset bench] [--batch 1,8] [--new-tokens 32]

Results go to stdout as Markdown tables (progress to stderr); `--json PATH` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..api import load
from ..options import add_model_options, config_from_options, mesh_from_options, model_from_options
from .accounting import expert_bytes, fixed_weight_bytes
from .bandwidth import COPY_BYTES, copy_bandwidth, device_description, with_final_load
from .compare_hf import compare_row, dsr1_generate, hf_generate, load_hf, write_random_checkpoint
from .report import COMPARE_NOTES, DECODE_NOTES, compare_table, decode_table, device_line, model_line
from .timing import DECODE_COLUMNS, bench_decode_point


def _log(msg: str) -> None:
    """Progress goes to stderr so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """The `decode` command: time each (batch, context) point and print the table."""
    dev = device_description()
    copy_nbytes = args.copy_mb * 2**20
    _log(f"measuring copy bandwidth (x + 1 over {copy_nbytes / 1e6:.0f} MB) ...")
    copy_gbs = copy_bandwidth(copy_nbytes)
    model = model_from_options(args, seed=args.seed)
    name = args.model or config_from_options(args)[1]
    rows = []
    points = [(b, c) for b in args.batch for c in args.context]
    for i, (batch, context) in enumerate(points):
        _log(f"[{i + 1}/{len(points)}] batch {batch}, context {context}: compile, warm up, time {args.steps} steps ...")
        rows.append(bench_decode_point(model, batch, context, args.steps, copy_gbs, seed=args.seed,
                                       repeats=args.repeats))
        _log(f"    {rows[-1]['step_ms']:.1f} ms/step, {rows[-1]['achieved_gbs']:.2f} GB/s")
    dev = with_final_load(dev)
    print(device_line(dev))
    print(model_line(model, name))
    print(f"{args.steps} greedy decode steps in one jitted loop per point (best of {args.repeats})\n")
    print(decode_table(rows))
    print()
    print(DECODE_NOTES.format(copy_mb=copy_nbytes / 1e6, copy_gbs=copy_gbs))
    return {
        "command": "decode", "device": dev, "model": name, "config": dataclasses.asdict(model.cfg),
        "dtype": args.dtype, "quant": args.quant, "kv_cache_dtype": args.kv_cache_dtype, "steps": args.steps,
        "repeats": args.repeats, "weight_bytes": model.weight_bytes(), "expert_bytes": expert_bytes(model.params),
        "fixed_weight_bytes": fixed_weight_bytes(model.params), "copy_gbs": copy_gbs,
        "copy_definition": f"jitted x + 1 over {copy_nbytes} bytes of float32 (donated, in place), "
                           f"(bytes read + bytes written) / best of 5",
        "columns": list(DECODE_COLUMNS), "rows": rows,
    }


def run_compare_hf(args: argparse.Namespace) -> dict[str, Any]:
    """The `compare-hf` command: one random checkpoint through HF transformers and dsr1."""
    cfg, name = config_from_options(args)
    dev = device_description()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsr1-bench-") as tmp:
        folder = Path(tmp) / "checkpoint"
        _log(f"writing a random {name} checkpoint (release layout, bf16) ...")
        write_random_checkpoint(folder, cfg, seed=args.seed)
        _log(f"loading it into dsr1 ({args.dtype}{', int8' if args.quant else ''}) ...")
        model = load(folder, mesh=mesh_from_options(args), dtype=args.dtype, quant=args.quant,
                     kv_cache_dtype=args.kv_cache_dtype, progress=False)
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
    dev = with_final_load(dev)
    print(device_line(dev))
    print(f"{model_line(model, name)}; random weights, one bf16 checkpoint read by both (HF in bfloat16); "
          f"prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens; torch threads {os.cpu_count()}\n")
    print(compare_table(rows))
    print()
    print(COMPARE_NOTES)
    return {"command": "compare-hf", "device": dev, "model": name, "config": dataclasses.asdict(cfg),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch_threads": os.cpu_count(),
            "hf_dtype": "bfloat16", "dsr1_dtype": args.dtype, "quant": args.quant,
            "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = _ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return value[0]


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and caches (default: 0)")
    p.add_argument("--repeats", type=_positive, default=2, help="timed runs per point after a warm-up; the "
                   "fastest is reported (default: 2)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def parser() -> argparse.ArgumentParser:
    """The `python -m dsr1.bench` command line."""
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
    dec.add_argument("--steps", type=_positive, default=16, help="decode steps timed per point (default: 16)")
    dec.add_argument("--copy-mb", type=_positive, default=COPY_BYTES // 2**20,
                     help=f"MiB of the array whose x + 1 measures the copy bandwidth (default: {COPY_BYTES // 2**20})")
    add_model_options(dec, default_preset="bench")
    _run_options(dec)
    cmp = sub.add_parser("compare-hf", help="decode tok/s of HF transformers (torch, bf16) and dsr1 on the same "
                                            "random checkpoint",
                         description="Writes one random release-layout checkpoint (bf16), loads it into HF "
                                     "DeepseekV3ForCausalLM (torch, CPU, bf16) and into dsr1 (--dtype, --quant), "
                                     "and times greedy decode of both on the same prompts. Needs torch and "
                                     "transformers.")
    cmp.add_argument("--batch", type=_ints, default=[1, 8], help="comma-separated batch sizes (default: 1,8)")
    cmp.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per row, at least 2 (default: 32)")
    cmp.add_argument("--prompt-len", type=_positive, default=32, help="prompt tokens per row (default: 32)")
    add_model_options(cmp, default_preset="bench", checkpoints=False)
    _run_options(cmp)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark command; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "compare-hf" and args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (the first token comes from the prefill)")
    result = run_decode(args) if args.command == "decode" else run_compare_hf(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        _log(f"wrote {args.json}")
    return 0
