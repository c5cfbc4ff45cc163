"""`python -m dsr1.bench`: decode throughput against the memory roofline, and dsr1 against HF
transformers.

    python -m dsr1.bench decode --batch 1,8,32 --context 32,512,4096 [--quant int8] [--kv-cache-dtype int8]
    python -m dsr1.bench prefill --batch 1 --tokens 512,4096 [--preset deepseek-r1 --layers 4]
    python -m dsr1.bench moe --tokens 1,8,64,512 [--kernels ragged_dot,loop,gather,capacity,dense]
    python -m dsr1.bench attention --rows 1,8,32 --positions 32768 [--tilings 32x64x4x2,16x64x4x2]
        [--kv-cache-dtype int8]
    python -m dsr1.bench compare-hf [--preset bench] [--batch 1,8] [--new-tokens 32]
    python -m dsr1.bench serve --preset tiny --dtype float32 [--requests 64] [--rate 100] [--prefix-ttft 2000]
        [--disaggregate P:D]
    python -m dsr1.bench plan --preset deepseek-r1 --quant int8 [--target 8xH100|8xH200|v5e-64|v5p-64]
        [--mesh expert=8,tensor=8] [--hbm GIB]
    python -m dsr1.bench load [--preset bench | --model PATH] [--quant int8] [--cache cold|warm] [--repeats 3]
    python -m dsr1.bench quality [--model PATH] [--text FILE] [--draft-tokens 1,2,3] [--plot PNG]
    python -m dsr1.bench drafts [--model PATH] [--draft-tokens 1,2,3] [--dtype float32,bfloat16] [--batch-invariant]
    python -m dsr1.bench control [--processes 2,4,16] [--slots 66] [--max-seq-len 163840]
    python -m dsr1.bench paged [--lengths 32768,1024x63] [--page-size 16,64] [--kv-cache-dtype int8]
    python -m dsr1.bench eplb [--model PATH] [--devices 4] [--redundant 4,8] [--routing PATH.npy]
    python -m dsr1.bench shares --index model.safetensors.index-with-shapes.json.gz --target v5e-64

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

from ..api import Model, load
from ..options import (
    add_model_options,
    config_from_options,
    mesh_from_options,
    model_from_options,
    positive_int,
    positive_ints,
)
from .accounting import expert_bytes, fixed_weight_bytes
from .bandwidth import COPY_BYTES, copy_bandwidth, device_description, read_bandwidth, with_final_load
from .compare_hf import compare_row, dsr1_generate, hf_generate, load_hf, write_random_checkpoint
from .control import __doc__ as CONTROL_DOC
from .control import add_control_options, run_control
from .decode_attention import __doc__ as ATTENTION_DOC
from .decode_attention import add_attention_options, run_attention
from .drafts import __doc__ as DRAFTS_DOC
from .drafts import add_drafts_options, run_drafts
from .eplb import __doc__ as EPLB_DOC
from .eplb import add_eplb_options, run_eplb
from .experts import EXPERT_COLUMNS, KERNELS, bench_kernels
from .loading import add_load_options, run_load
from .paged import __doc__ as PAGED_DOC
from .paged import add_paged_options, run_paged
from .plan import add_plan_options, run_plan
from .prefill import PREFILL_COLUMNS, compute_dtype, matmul_peak_flops, prefill_flops, prefill_row, time_prefill
from .quality import __doc__ as QUALITY_DOC
from .quality import add_quality_options, run_quality
from .report import (
    COMPARE_NOTES,
    DECODE_NOTES,
    DISAGGREGATE_NOTES,
    EXPERT_NOTES,
    PREFILL_NOTES,
    SERVE_NOTES,
    compare_floor_table,
    compare_table,
    decode_table,
    device_line,
    expert_table,
    model_line,
    prefill_table,
    serve_table,
)
from .serve import (
    ARRIVAL_BOUND_TAIL,
    EngineShape,
    Workload,
    WorkloadSpec,
    arrival_bound,
    make_workload,
    prefix_ttft,
    run_engine,
    run_static,
    summarize,
)
from .shares import __doc__ as SHARES_DOC
from .shares import add_shares_options, run_shares
from .timing import DECODE_COLUMNS, bench_decode_point


def _log(msg: str) -> None:
    """Progress goes to stderr so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


def _print_report(dev: dict[str, Any], model: Model, name: str, heading: str, table: str, notes: str) -> None:
    """A command's results on stdout: the device and model lines, what was run, the table, its notes."""
    print(device_line(dev))
    print(model_line(model, name))
    print(f"{heading}\n")
    print(table)
    print()
    print(notes)


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """The `decode` command: time each (batch, context) point and print the table."""
    dev = device_description()
    copy_nbytes = args.copy_mb * 2**20
    _log(f"measuring copy and read bandwidth (x + 1 and max over {copy_nbytes / 1e6:.0f} MB) ...")
    copy_gbs, read_gbs = copy_bandwidth(copy_nbytes), read_bandwidth(copy_nbytes)
    model = model_from_options(args, seed=args.seed)
    name = args.model or config_from_options(args)[1]
    rows = []
    points = [(b, c) for b in args.batch for c in args.context]
    for i, (batch, context) in enumerate(points):
        _log(f"[{i + 1}/{len(points)}] batch {batch}, context {context}: compile, warm up, time {args.steps} steps ...")
        rows.append(bench_decode_point(model, batch, context, args.steps, copy_gbs, read_gbs, seed=args.seed,
                                       repeats=args.repeats))
        _log(f"    {rows[-1]['step_ms']:.1f} ms/step, {rows[-1]['achieved_gbs']:.2f} GB/s")
    dev = with_final_load(dev)
    _print_report(dev, model, name, f"{args.steps} greedy decode steps in one jitted loop per point (best of "
                  f"{args.repeats})", decode_table(rows), DECODE_NOTES.format(copy_mb=copy_nbytes / 1e6,
                                                                              copy_gbs=copy_gbs, read_gbs=read_gbs))
    return {
        "command": "decode", "device": dev, "model": name, "config": dataclasses.asdict(model.cfg),
        "dtype": args.dtype, "quant": args.quant, "kv_cache_dtype": args.kv_cache_dtype, "steps": args.steps,
        "repeats": args.repeats, "weight_bytes": model.weight_bytes(), "expert_bytes": expert_bytes(model.params),
        "fixed_weight_bytes": {str(b): fixed_weight_bytes(model.params, b) for b in args.batch}, "copy_gbs": copy_gbs,
        "copy_definition": f"jitted x + 1 over {copy_nbytes} bytes of float32 (donated, in place), "
                           f"(bytes read + bytes written) / best of 5",
        "read_gbs": read_gbs,
        "read_definition": f"jitted max over {copy_nbytes} bytes of bfloat16, bytes read / best of 5",
        "columns": list(DECODE_COLUMNS), "rows": rows,
    }


def run_prefill(args: argparse.Namespace) -> dict[str, Any]:
    """The `prefill` command: time each (batch, tokens) prefill and its FLOP/s against the matmul peak."""
    dev = device_description()
    model = model_from_options(args, seed=args.seed)
    name = args.model or config_from_options(args)[1]
    dtype = compute_dtype(model)
    _log(f"measuring the {dtype.name} matmul peak ...")
    peak = matmul_peak_flops(dtype)
    rows = []
    points = [(b, t) for b in args.batch for t in args.tokens]
    for i, (batch, tokens) in enumerate(points):
        _log(f"[{i + 1}/{len(points)}] batch {batch}, {tokens} tokens: compile, warm up, time ...")
        seconds = time_prefill(model, batch, tokens, args.repeats, seed=args.seed)
        rows.append(prefill_row(model.cfg, batch, tokens, seconds, peak))
        _log(f"    {rows[-1]['ms']:.1f} ms, {rows[-1]['pct_of_peak']:.1f}% of the matmul peak")
    dev = with_final_load(dev)
    _print_report(dev, model, name, f"prefill of random prompts (best of {args.repeats}); {dtype.name} matmul "
                  f"peak {peak / 1e9:.1f} GFLOP/s (measured in this run)", prefill_table(rows), PREFILL_NOTES)
    return {"command": "prefill", "device": dev, "model": name, "config": dataclasses.asdict(model.cfg),
            "dtype": args.dtype, "quant": args.quant, "compute_dtype": dtype.name, "matmul_peak_flop_s": peak,
            "repeats": args.repeats, "columns": list(PREFILL_COLUMNS), "rows": rows}


def run_moe(args: argparse.Namespace) -> dict[str, Any]:
    """The `moe` command: the routed-expert kernels on the first MoE layer at each token count."""
    dev = device_description()
    model = model_from_options(args, seed=args.seed)
    name = args.model or config_from_options(args)[1]
    rows = bench_kernels(model, args.kernels, args.tokens, args.repeats, seed=args.seed, log=_log)
    dev = with_final_load(dev)
    _print_report(dev, model, name, f"the first MoE layer's routed experts on random activations (best of "
                  f"{args.repeats})", expert_table(rows), EXPERT_NOTES.format(reference=args.kernels[0]))
    return {"command": "moe", "device": dev, "model": name, "config": dataclasses.asdict(model.cfg),
            "dtype": args.dtype, "quant": args.quant, "repeats": args.repeats, "columns": list(EXPERT_COLUMNS),
            "rows": rows}


def _kernels(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated kernels among {', '.join(KERNELS)}, got {text!r}")
    return names


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
        dtype = compute_dtype(model)
        _log(f"measuring the {dtype.name} matmul peak ...")
        peak = matmul_peak_flops(dtype)
        rng = np.random.default_rng(args.seed)
        for batch in args.batch:
            prompts = rng.integers(2, cfg.vocab_size, (batch, args.prompt_len)).astype(np.int32)
            _log(f"batch {batch}: dsr1, between two reads of {COPY_BYTES / 1e6:.0f} MB ...")
            # The memory's speed drifts within a run: the floor takes the faster read next to dsr1's decode.
            read_before = read_bandwidth()
            ours = dsr1_generate(model, prompts, args.new_tokens, args.repeats)
            read_gbs = max(read_before, read_bandwidth())
            _log(f"batch {batch}: HF transformers ...")
            hf = hf_generate(hf_model, prompts, args.new_tokens, args.repeats)
            rows.append(compare_row(batch, ours, hf, prefill_flops(cfg, batch, args.prompt_len), peak, read_gbs))
    dev = with_final_load(dev)
    print(device_line(dev))
    print(f"{model_line(model, name)}; random weights, one bf16 checkpoint read by both (HF in bfloat16); "
          f"prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens; torch threads {os.cpu_count()}; "
          f"{dtype.name} matmul peak {peak / 1e9:.1f} GFLOP/s (2048^3, measured in this run)\n")
    print(compare_table(rows))
    print()
    print(compare_floor_table(rows))
    print()
    print(COMPARE_NOTES.format(read_mb=COPY_BYTES / 1e6))
    return {"command": "compare-hf", "device": dev, "model": name, "config": dataclasses.asdict(cfg),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch_threads": os.cpu_count(),
            "hf_dtype": "bfloat16", "dsr1_dtype": args.dtype, "quant": args.quant,
            "kv_cache_dtype": args.kv_cache_dtype, "matmul_peak_flop_s": peak, "rows": rows}


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """The `serve` command: the workload through the engine and through static batches of generate."""
    dev = device_description()
    model = model_from_options(args, seed=args.seed)
    name = args.model or config_from_options(args)[1]
    spec = WorkloadSpec(requests=args.requests, rate=args.rate, prompt_len=tuple(args.prompt_len),
                        output_len=tuple(args.output_len), output_dist=args.output_dist, output_mean=args.output_mean,
                        shared_prefix=args.shared_prefix, shared_fraction=args.shared_fraction, seed=args.seed)
    shape = EngineShape(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
                        prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
                        host_cache_bytes=args.host_cache_mb * 2**20, decode_steps=args.decode_steps)
    workload = make_workload(spec, model.cfg.vocab_size)
    _log(f"{len(workload)} requests, {sum(workload.max_new_tokens)} output tokens at most")
    if args.disaggregate:
        return _run_disaggregated(args, model, name, spec, workload, shape, dev)
    continuous, static, stats = None, None, None
    for i in range(args.repeats):  # alternating, so that both see the same moments of a shared machine
        _log(f"[{i + 1}/{args.repeats}] continuous batching ...")
        timings, run_stats = run_engine(model, workload, shape)
        row = _engine_row("continuous", timings, run_stats)
        _log(f"    {row['tok_s']:.1f} tok/s; static batches of {shape.max_seqs}"
             f"{' (compile pass, then timed)' if i == 0 else ''} ...")
        if continuous is None or row["tok_s"] > continuous["tok_s"]:
            continuous, stats = row, run_stats
        row = {"name": f"static (generate, batch {shape.max_seqs})",
               **summarize(run_static(model, workload, shape.max_seqs, compiled=i > 0))}
        _log(f"    {row['tok_s']:.1f} tok/s")
        static = row if static is None or row["tok_s"] > static["tok_s"] else static
    ratio = continuous["tok_s"] / static["tok_s"]
    prefix = prefix_ttft(model, args.prefix_ttft, shape, seed=args.seed) if args.prefix_ttft else None
    dev = with_final_load(dev)
    print(device_line(dev))
    print(model_line(model, name))
    print(f"workload: {spec.requests} requests, Poisson arrivals at {spec.rate:g}/s, prompts {spec.prompt_len[0]}-"
          f"{spec.prompt_len[1]} tokens ({spec.shared_fraction:.0%} begin with a shared {spec.shared_prefix}-token "
          f"prefix), outputs {spec.output_len[0]}-{spec.output_len[1]} tokens ({spec.output_dist}"
          f"{f', mean {spec.output_mean:g}' if spec.output_dist == 'exponential' else ''}), greedy, seed {spec.seed}")
    print(f"engine: {dataclasses.asdict(shape)}; the faster of {args.repeats} alternating run(s) of each\n")
    print(serve_table([continuous, static]))
    print(f"\ncontinuous / static throughput: {ratio:.2f}x\n")
    bound = [row["name"] for row in (continuous, static) if arrival_bound(row)]
    if bound:
        print(f"note: arrival-bound ({' and '.join(bound)}): the run ended within {ARRIVAL_BOUND_TAIL:.0%} of its "
              f"length after the last arrival, so its throughput measures the arrival rate ({spec.rate:g}/s), not the "
              "server; raise --rate (or inf) to compare capacities\n")
    if prefix:
        print(f"shared prefix of {prefix['prefix_len']} tokens ({prefix['prompt_len']}-token prompts): time to first "
              f"token {prefix['first_ttft_ms']:.0f} ms for the first request, {prefix['second_ttft_ms']:.0f} ms for "
              f"the second ({prefix['second_cached_tokens']} tokens cached): {prefix['ratio']:.1f}x lower\n")
    print(SERVE_NOTES)
    return {"command": "serve", "device": dev, "model": name, "config": dataclasses.asdict(model.cfg),
            "dtype": args.dtype, "quant": args.quant, "kv_cache_dtype": args.kv_cache_dtype,
            "workload": dataclasses.asdict(spec), "engine": dataclasses.asdict(shape), "engine_stats": stats,
            "repeats": args.repeats, "rows": [continuous, static], "throughput_ratio": ratio,
            "arrival_bound": bound, "prefix_ttft": prefix}


def _engine_row(name: str, timings: list, stats: dict[str, Any]) -> dict[str, Any]:
    """A `serve_table` row of one engine run: its timings' summary and the engine's own figures."""
    return {"name": name, **summarize(timings),
            "prefix_hit_rate": stats["prefix_hit_tokens"] / max(stats["prompt_tokens"], 1),
            "host_ms_per_step": stats["host_ms_per_step"], "device_ms_per_step": stats["device_ms_per_step"],
            "wait_ms_per_step": stats["wait_ms_per_step"], "steps": stats["steps"]}


def _run_disaggregated(args: argparse.Namespace, model: Model, name: str, spec: WorkloadSpec, workload: Workload,
                       shape: EngineShape, dev: dict[str, Any]) -> dict[str, Any]:
    """`serve --disaggregate P:D`: the workload through the mixed engine on the mesh's devices, then
    through the engine with prefill on the first P of them and decode on the next D."""
    split = tuple(args.disaggregate)
    if sum(split) != model.mesh.size:
        raise SystemExit(f"--disaggregate {split[0]}:{split[1]} splits {sum(split)} devices; the mesh has "
                         f"{model.mesh.size} (JAX_NUM_CPU_DEVICES={sum(split)} fakes them on CPU)")
    variants = {"mixed": shape, f"disaggregated {split[0]}:{split[1]}": dataclasses.replace(shape, disaggregate=split)}
    best: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for i in range(args.repeats):  # alternating, so that both see the same moments of a shared machine
        for label, variant in variants.items():
            _log(f"[{i + 1}/{args.repeats}] {label} ...")
            tokens: list[list[int]] = []
            timings, run_stats = run_engine(model, workload, variant, tokens)
            outputs[label] = tokens
            row = _engine_row(label, timings, run_stats)
            _log(f"    {row['tok_s']:.1f} tok/s")
            if label not in best or row["tok_s"] > best[label]["tok_s"]:
                best[label] = row
    mixed, split_tokens = outputs.values()
    same = sum(a == b for a, b in zip(mixed, split_tokens))
    rows = list(best.values())
    dev = with_final_load(dev)
    print(device_line(dev))
    print(model_line(model, name))
    print(f"workload: {spec.requests} requests, Poisson arrivals at {spec.rate:g}/s, prompts {spec.prompt_len[0]}-"
          f"{spec.prompt_len[1]} tokens ({spec.shared_fraction:.0%} begin with a shared {spec.shared_prefix}-token "
          f"prefix), outputs {spec.output_len[0]}-{spec.output_len[1]} tokens, greedy, seed {spec.seed}")
    print(f"engine: {dataclasses.asdict(shape)}; the faster of {args.repeats} alternating run(s) of each\n")
    print(serve_table(rows))
    print(f"\ndisaggregated / mixed throughput: {rows[1]['tok_s'] / rows[0]['tok_s']:.2f}x; greedy tokens equal for "
          f"{same} of {len(mixed)} requests\n")
    print(DISAGGREGATE_NOTES)
    return {"command": "serve", "device": dev, "model": name, "config": dataclasses.asdict(model.cfg),
            "dtype": args.dtype, "quant": args.quant, "kv_cache_dtype": args.kv_cache_dtype,
            "workload": dataclasses.asdict(spec), "engine": dataclasses.asdict(shape), "disaggregate": list(split),
            "repeats": args.repeats, "rows": rows, "same_tokens": same}


def _split(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected P:D, prefill and decode device counts >= 1, got {text!r}")
    return int(parts[0]), int(parts[1])


def _range(text: str) -> list[int]:
    values = positive_ints(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with MIN <= MAX, got {text!r}")
    return values


def _serve_options(p: argparse.ArgumentParser) -> None:
    w, e = WorkloadSpec(), EngineShape()
    p.add_argument("--requests", type=positive_int, default=w.requests, help=f"requests (default: {w.requests})")
    p.add_argument("--rate", type=float, default=w.rate, help="arrivals per second, Poisson; inf: all at once "
                   f"(default: {w.rate:g})")
    p.add_argument("--prompt-len", type=_range, default=list(w.prompt_len), metavar="MIN,MAX",
                   help="prompt tokens, uniform (default: %(default)s)")
    p.add_argument("--output-len", type=_range, default=list(w.output_len), metavar="MIN,MAX",
                   help="output tokens (default: %(default)s)")
    p.add_argument("--output-dist", choices=["exponential", "uniform"], default=w.output_dist,
                   help="output lengths: exponential (clipped to --output-len) or uniform (default: %(default)s)")
    p.add_argument("--output-mean", type=float, default=w.output_mean,
                   help="mean of the exponential output lengths before clipping (default: %(default)s)")
    p.add_argument("--shared-prefix", type=int, default=w.shared_prefix,
                   help="tokens of the prefix some prompts share (default: %(default)s)")
    p.add_argument("--shared-fraction", type=float, default=w.shared_fraction,
                   help="share of the prompts that begin with it (default: %(default)s)")
    p.add_argument("--max-seqs", type=positive_int, default=e.max_seqs,
                   help="engine decode rows, and the static batch size (default: %(default)s)")
    p.add_argument("--page-size", type=positive_int, default=e.page_size, help="(default: %(default)s)")
    p.add_argument("--num-pages", type=positive_int, default=e.num_pages, help="(default: %(default)s)")
    p.add_argument("--prefill-chunk", type=positive_int, default=e.prefill_chunk, help="(default: %(default)s)")
    p.add_argument("--prefill-rows", type=positive_int, default=e.prefill_rows,
                   help="engine prompts prefilled per step, and slots beyond --max-seqs (default: %(default)s)")
    p.add_argument("--decode-steps", type=positive_int, default=e.decode_steps,
                   help="decode steps per engine decode call (default: %(default)s)")
    p.add_argument("--host-cache-mb", type=int, default=0, help="host memory for offloaded prefix pages, MiB "
                   "(default: 0)")
    p.add_argument("--prefix-ttft", type=int, default=0, metavar="N", help="also measure the time to first token of "
                   "two requests sharing an N-token prefix (default: 0, off)")
    p.add_argument("--disaggregate", type=_split, metavar="P:D", help="compare the mixed engine with prefill on the "
                   "first P devices and decode on the next D (P + D: the mesh's devices; instead of static batches)")


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and caches (default: 0)")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed runs per point after a warm-up; the "
                   "fastest is reported (default: 2)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def _decode_command(sub: Any) -> None:
    """The `decode` command's options."""
    dec = sub.add_parser("decode", help="decode tok/s and achieved bandwidth vs the measured copy and read bandwidths",
                         description="Times greedy decode steps in one jitted loop at each (batch, context) on a "
                                     "directly built cache, and reports the bytes a step must read against the "
                                     "device's measured copy bandwidth.")
    dec.add_argument("--batch", type=positive_ints, default=[1, 8, 32],
                     help="comma-separated batch sizes (default: 1,8,32)")
    dec.add_argument("--context", type=positive_ints, default=[32, 512, 4096],
                     help="comma-separated cached lengths per row (default: 32,512,4096)")
    dec.add_argument("--steps", type=positive_int, default=16, help="decode steps timed per point (default: 16)")
    dec.add_argument("--copy-mb", type=positive_int, default=COPY_BYTES // 2**20,
                     help=f"MiB of the arrays whose x + 1 and max measure the copy and read bandwidths "
                          f"(default: {COPY_BYTES // 2**20})")
    add_model_options(dec, default_preset="bench")
    _run_options(dec)


def _prefill_command(sub: Any) -> None:
    """The `prefill` command's options."""
    pre = sub.add_parser("prefill", help="prefill time and FLOP/s against the measured matmul peak (MFU)",
                         description="Times the prefill of random prompts at each (batch, tokens) and reports "
                                     "its FLOP/s against the matmul peak of the dtype the device computes in, "
                                     "measured in the same run (model FLOPs utilization).")
    pre.add_argument("--batch", type=positive_ints, default=[1], help="comma-separated batch sizes (default: 1)")
    pre.add_argument("--tokens", type=positive_ints, default=[512, 4096],
                     help="comma-separated prompt lengths (default: 512,4096)")
    add_model_options(pre, default_preset="bench")
    _run_options(pre)


def _moe_command(sub: Any) -> None:
    """The `moe` command's options."""
    kern = sub.add_parser("moe", help="routed-expert kernels side by side: ragged_dot, the expert loop, gather, "
                                      "capacity, dense",
                          description="Runs the first MoE layer's routed experts on random activations with each "
                                      "kernel (ragged_dot: grouped matmuls, the TPU default; loop: each hit expert "
                                      "sliced in place, the CPU default; gather: each pair's expert gathered into one "
                                      "multiply-reduce, GPU decode; capacity: per-expert buffers and batched "
                                      "matmuls, GPU beyond decode; dense: every expert on every token) "
                                      "and reports time, the bytes of the experts hit, GB/s, GFLOP/s, and the "
                                      "difference from the first kernel's output.")
    kern.add_argument("--tokens", type=positive_ints, default=[1, 8, 64, 512],
                      help="comma-separated token counts (default: 1,8,64,512)")
    kern.add_argument("--kernels", type=_kernels, default=list(KERNELS),
                      help=f"comma-separated kernels, the first the reference (default: {','.join(KERNELS)})")
    add_model_options(kern, default_preset="bench")
    _run_options(kern)


def _compare_hf_command(sub: Any) -> None:
    """The `compare-hf` command's options."""
    cmp = sub.add_parser("compare-hf", help="decode tok/s of HF transformers (torch, bf16) and dsr1 on the same "
                                            "random checkpoint",
                         description="Writes one random release-layout checkpoint (bf16), loads it into HF "
                                     "DeepseekV3ForCausalLM (torch, CPU, bf16) and into dsr1 (--dtype, --quant), "
                                     "and times greedy decode of both on the same prompts. Needs torch and "
                                     "transformers.")
    cmp.add_argument("--batch", type=positive_ints, default=[1, 8], help="comma-separated batch sizes (default: 1,8)")
    cmp.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per row, at least 2 (default: 32)")
    cmp.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens per row (default: 32)")
    add_model_options(cmp, default_preset="bench", checkpoints=False)
    _run_options(cmp)


def _serve_command(sub: Any) -> None:
    """The `serve` command's options."""
    srv = sub.add_parser("serve", help="continuous batching (dsr1.serving.Engine) against static batches of "
                                       "dsr1.generate on one workload",
                         description="Runs a seeded workload (Poisson arrivals, mixed prompt and output lengths, "
                                     "a share with a common prefix) through the serving engine and through static "
                                     "batches of generate, and reports throughput, time to first token, "
                                     "inter-token latency, prefix hit rate and the engine's host vs device time "
                                     "per step (docs/benchmarks.md, \"Serving\").")
    _serve_options(srv)
    add_model_options(srv, default_preset="tiny")
    srv.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload (default: 0)")
    srv.add_argument("--repeats", type=positive_int, default=1,
                     help="runs of each, alternating; the fastest of each is reported (default: 1)")
    srv.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def parser() -> argparse.ArgumentParser:
    """The `python -m dsr1.bench` command line."""
    ap = argparse.ArgumentParser(prog="python -m dsr1.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    _decode_command(sub)
    _prefill_command(sub)
    _moe_command(sub)
    _compare_hf_command(sub)
    _serve_command(sub)
    pln = sub.add_parser("plan", help="capacity plan: compile decode and prefill for a full-size model on a fake "
                                      "CPU mesh; weight and cache bytes per device, the batch x context that fits",
                         description="Lowers and compiles the real decode step and prefill from abstract sharded "
                                     "weights (no memory) on a mesh of fake CPU devices, and reports weight bytes "
                                     "per device, cache bytes per token, XLA's memory analysis, compile times and "
                                     "the largest batch x context that fits --hbm. Fails when a weight that should "
                                     "be split over the mesh would be replicated.")
    add_plan_options(pln)
    att = sub.add_parser("attention", help="decode attention alone: XLA's path, the GPU flash kernel per tiling, "
                                           "the CPU kernel (ms, cache GB/s, TFLOP/s, error)",
                         description=ATTENTION_DOC)
    add_attention_options(att)
    lod = sub.add_parser("load", help="dsr1.load GB/s against the raw read bandwidth of the same files",
                         description="Writes a random checkpoint in the release layout and precision (FP8 blocks "
                                     "with scales; or takes --model), then alternates a raw sequential read of its "
                                     "files and a dsr1.load of it, and reports both in GB/s and their ratio.")
    add_load_options(lod)
    qua = sub.add_parser("quality", help="held-out bits per byte by precision, and MTP speculative decoding "
                                         "(acceptance, speedup) of a trained model (default: the demo model)",
                         description=QUALITY_DOC.split("\n\n")[0])
    add_quality_options(qua)
    dra = sub.add_parser("drafts", help="MTP drafts' decode speedup at batch 1 (k = 1, 2, 3; float32 and bf16; "
                                        "alternated rounds, medians), and the exact mode's",
                         description=DRAFTS_DOC.split("\n\n")[0])
    add_drafts_options(dra)
    ctl = sub.add_parser("control", help="the serving control plane's host cost per step at 2 to 16 processes",
                         description=CONTROL_DOC.split("\n\n")[0])
    add_control_options(ctl)
    pag = sub.add_parser("paged", help="a ragged batch's attention bytes on a TPU chip: the ragged paged kernel "
                                       "against XLA's page loop (deviceless compile, needs libtpu)",
                         description=PAGED_DOC.split("\n\n")[0])
    add_paged_options(pag)
    epl = sub.add_parser("eplb", help="redundant experts: the busiest device's expert load over the mean, with and "
                                      "without a balanced placement, on recorded routings",
                         description=EPLB_DOC.split("\n\n")[0])
    add_eplb_options(epl)
    sha = sub.add_parser("shares", help="what each host of a TPU slice reads when loading the release checkpoint, "
                                        "from its tensor index (needs libtpu for the topology)",
                         description=SHARES_DOC.split("\n\n")[0])
    add_shares_options(sha)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark command; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "compare-hf" and args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (the first token comes from the prefill)")
    commands = {"decode": run_decode, "prefill": run_prefill, "moe": run_moe, "compare-hf": run_compare_hf,
                "serve": run_serve, "plan": run_plan, "load": run_load, "quality": run_quality, "drafts": run_drafts,
                "attention": run_attention, "control": run_control, "paged": run_paged, "eplb": run_eplb,
                "shares": run_shares}
    result = commands[args.command](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        _log(f"wrote {args.json}")
    return 0
