"""`python -m dsr1.bench drafts`: what MTP drafts buy in decode speed, batch 1, greedy.

`dsr1.generate` on held-out prompts, one at a time, with `draft_tokens=k` for k = 0 and each asked k,
in float32 and bfloat16 weights: every round runs every k once over the prompts (alternated in one
process, so a shared machine's load falls on all of them alike), and each figure is the median
over the rounds of decode tokens over decode seconds. Per k: the share of drafts accepted, the
speedup over k=0 of the same round, and whether every prompt's tokens equal k=0's. With
`--batch-invariant` the same rows again in `dsr1.generate(..., batch_invariant=True)`, the exact
mode: its speedups are against the default mode's k=0 (what the mode costs), its tokens against
its own k=0 (what it guarantees).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import numpy as np

from ..api import Model, load
from ..generation.batch import generate
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer, load_tokenizer
from ..options import positive_int, positive_ints
from .quality import held_out_tokens, model_folder

GREEDY = Sampling(temperature=0.0)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _round(model: Model, tok: Tokenizer, prompts: list[list[int]], new_tokens: int, k: int,
           batch_invariant: bool) -> tuple[float, list[list[int]], float | None]:
    """One pass over the prompts: decode tok/s, each prompt's tokens and the mean share of drafts accepted."""
    runs = [generate(model, [p], tokenizer=tok, max_new_tokens=new_tokens, sampling=GREEDY, draft_tokens=k,
                     batch_invariant=batch_invariant) for p in prompts]
    rate = sum(r.decode_tokens for r in runs) / max(sum(r.decode_seconds for r in runs), 1e-9)
    share = float(np.mean([r.draft_acceptance for r in runs])) if k else None
    return rate, [r.completions[0].tokens for r in runs], share


def draft_speed_rows(model: Model, tok: Tokenizer, prompts: list[list[int]], new_tokens: int, ks: list[int],
                     rounds: int, modes: tuple[bool, ...]) -> list[dict[str, Any]]:
    """The rows of one dtype (module doc): per mode (`batch_invariant` False, then True if asked) and k."""
    runs = [(mode, k) for mode in modes for k in [0, *ks]]
    for mode, k in runs:
        _log(f"batch_invariant={mode}, draft_tokens={k}: compiling ...")
        _round(model, tok, prompts[:1], new_tokens, k, mode)
    rates: dict[tuple[bool, int], list[float]] = {run: [] for run in runs}
    tokens, shares = {}, {}
    for i in range(rounds):
        _log(f"round {i + 1}/{rounds} ...")
        for run in runs:
            rate, tokens[run], shares[run] = _round(model, tok, prompts, new_tokens, run[1], run[0])
            rates[run].append(rate)
    plain = np.asarray(rates[(False, 0)])
    return [{"batch_invariant": mode, "draft_tokens": k, "draft_acceptance": shares[(mode, k)],
             "decode_tok_s": float(np.median(rates[(mode, k)])),
             "speedup": float(np.median(np.asarray(rates[(mode, k)]) / plain)),
             "same_tokens": tokens[(mode, k)] == tokens[(mode, 0)]} for mode, k in runs]


def run_drafts(args: argparse.Namespace) -> dict[str, Any]:
    """The `drafts` command."""
    folder = model_folder(args.model)
    tok = load_tokenizer(folder)
    ids = held_out_tokens(tok, args.text, args.max_bytes)
    if len(ids) < args.prompt_len + 1:
        raise SystemExit(f"the held-out text has {len(ids)} tokens: too few for prompts of {args.prompt_len}")
    starts = np.linspace(0, len(ids) - args.prompt_len - 1, args.prompts).astype(int)
    prompts = [ids[s:s + args.prompt_len].tolist() for s in starts]
    modes = (False, True) if args.batch_invariant else (False,)
    rows = []
    for dtype in args.dtype:
        model = load(folder, dtype=dtype, mtp=True, progress=False)
        for row in draft_speed_rows(model, tok, prompts, args.new_tokens, sorted(set(args.draft_tokens)),
                                    args.rounds, modes):
            rows.append({"dtype": dtype, **row})
    result = {"command": "drafts", "model": str(folder), "prompts": len(prompts), "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows,
              "device": jax.devices()[0].device_kind}
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    """The rows as Markdown to stdout."""
    print(f"model: {result['model']}; {result['prompts']} held-out prompts of {result['prompt_len']} tokens, "
          f"{result['new_tokens']} new tokens each, batch 1, greedy; median of {result['rounds']} alternated rounds; "
          f"device: {result['device']}\n")
    print("| weights | mode | draft tokens k | share of drafts accepted | decode tok/s | speedup vs plain "
          "| same tokens as k=0 |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in result["rows"]:
        share = f"{r['draft_acceptance']:.1%}" if r["draft_acceptance"] is not None else "-"
        mode = "batch_invariant" if r["batch_invariant"] else "default"
        print(f"| {r['dtype']} | {mode} | {r['draft_tokens']} | {share} | {r['decode_tok_s']:.0f} "
              f"| {r['speedup']:.2f}x | {r['same_tokens']} |")


def add_drafts_options(p: argparse.ArgumentParser) -> None:
    """The `drafts` command's options."""
    p.add_argument("--model", help="a release-layout folder with an MTP layer (default: the embedded demo model, "
                   "dsr1.demo_checkpoint())")
    p.add_argument("--text", help="held-out UTF-8 text file (default: the held-out plays of python -m dsr1.train's "
                   "corpus)")
    p.add_argument("--max-bytes", type=positive_int, default=200_000,
                   help="bytes of held-out text at most (default: 200000)")
    p.add_argument("--prompts", type=positive_int, default=4, help="held-out prompts (default: 4)")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="greedy tokens per prompt (default: 128)")
    p.add_argument("--draft-tokens", type=positive_ints, default=[1, 2, 3],
                   help="comma-separated k to run besides k=0 (default: 1,2,3)")
    p.add_argument("--dtype", type=lambda s: s.split(","), default=["float32", "bfloat16"],
                   help="comma-separated weight dtypes (default: float32,bfloat16)")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="alternated rounds over every k; medians are reported (default: 5)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also run the exact mode, dsr1.generate(..., batch_invariant=True)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
