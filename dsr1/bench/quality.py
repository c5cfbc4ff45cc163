"""`python -m dsr1.bench quality`: what a trained model with an MTP module loses to each precision,
and what MTP speculative decoding buys on it.

- Held-out bits per byte (NLL in bits of the text-token targets over their UTF-8 bytes; special
  tokens are not text) of float32, bf16 and int8 weights and of an FP8 round trip (every weight the
  release stores in FP8 written as e4m3 with 128x128 block scales, then read by `dsr1.load`), on
  the full-sequence path; and of the bf16 and int8 latent caches through the decode path, which is
  where the cache is read (prefill attends to its own unquantized latents).
- The first-draft acceptance of the MTP module on held-out text, teacher-forced: at position t the
  module (hidden state h_t and the true token t+1) predicts token t+2, the model at t+1 predicts the
  same token; acceptance is the share of positions where their argmaxes agree.
- Greedy `dsr1.generate` at batch 1 on held-out prompts with `draft_tokens=k`: the share of drafts
  accepted, decode tokens/s and the speedup over k=0 in the same run, and whether the tokens equal
  k=0's (they must).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from .. import programs
from ..api import Model, load
from ..core.config import Config
from ..generation.batch import generate
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer, load_tokenizer
from ..options import positive_int, positive_ints
from ..weights.release import expected_tensors, quantize_fp8

WEIGHTS = "model.safetensors"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def held_out_text(path: str | Path | None, max_bytes: int) -> str:
    """`path`'s text, or the held-out plays of `python -m dsr1.train`'s corpus; at most `max_bytes`
    UTF-8 bytes (cut at a line end)."""
    if path is not None:
        text = Path(path).read_text()
    else:
        from ..train.corpus import load_corpus

        text = "\n\n".join(load_corpus().held_out.values())
    data = text.encode()[:max_bytes].decode(errors="ignore")
    return data[:data.rfind("\n") + 1] or data


def held_out_tokens(tok: Tokenizer, path: str | Path | None, max_bytes: int) -> np.ndarray:
    """The held-out token stream: `BOS text` of `path` (at most `max_bytes`), or else the stream
    `python -m dsr1.train` evaluates (`BOS play EOS` for each held-out play, `dsr1.train.data.
    encode_documents`) cut after the token that brings its text to `max_bytes`."""
    if path is not None:
        return np.asarray(tok.encode(held_out_text(path, max_bytes), add_bos=True), np.int32)
    from ..train.corpus import load_corpus
    from ..train.data import encode_documents

    stream = encode_documents(tok, load_corpus().held_out, chat=False)
    text_bytes = np.cumsum(token_bytes_table(tok)[stream])
    return stream[:max(int(np.searchsorted(text_bytes, max_bytes, side="right")), 2)]


def model_folder(path: str | Path | None) -> Path:
    """`path`, or the embedded demo model (`dsr1.demo_checkpoint()`) when it is None."""
    if path is not None:
        return Path(path)
    try:
        from ..weights.demo import demo_checkpoint

        return Path(demo_checkpoint())
    except (ImportError, FileNotFoundError) as e:
        raise SystemExit(f"no --model given and no embedded demo model ({e}): pass --model PATH, a release-layout "
                         "folder with an MTP layer") from None


def token_bytes_table(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for; 0 for special tokens (not text)."""
    from ..train.data import token_byte_lengths

    return token_byte_lengths(tok)


def windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping `[N, seq_len + 1]` windows of `ids` (the tail dropped)."""
    n = (len(ids) - 1) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens: too few for one window of {seq_len + 1}")
    return np.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


def _nll_bits(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Bits of each target under float32 `logits [..., V]`."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return (lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]) / np.log(2.0)


def bits_per_byte(model: Model, rows: np.ndarray, nbytes: np.ndarray, batch: int = 8) -> tuple[float, int]:
    """Bits per byte of `rows [N, T + 1]` (inputs and targets) through `model.forward`, and the bytes scored."""
    bits = total = 0.0
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        logits = np.asarray(model.forward(part[:, :-1]))
        b = nbytes[part[:, 1:]]
        bits += float(np.where(b > 0, _nll_bits(logits, part[:, 1:]), 0.0).sum())
        total += float(b.sum())
    return bits / max(total, 1.0), int(total)


def bits_per_byte_decoded(model: Model, rows: np.ndarray, nbytes: np.ndarray) -> tuple[float, int]:
    """Bits per byte of `rows` scored one token at a time through the latent cache (`prefill` of the
    first token, then `decode`): the path that reads an int8 cache."""
    t = rows.shape[1] - 1
    logits, cache = model.prefill(rows[:, :1], max_len=t + 1)
    scored = [np.asarray(logits)]
    for i in range(1, t):
        logits, cache = model.decode(cache, rows[:, i])
        scored.append(np.asarray(logits))
    targets = rows[:, 1:]
    bits = np.where(nbytes[targets] > 0, _nll_bits(np.stack(scored, 1), targets), 0.0).sum()
    total = float(nbytes[targets].sum())
    return float(bits) / max(total, 1.0), int(total)


def fp8_round_trip(folder: Path, out: Path) -> Path:
    """A copy of the release folder whose FP8-stored weights are e4m3 with 128x128 block
    `weight_scale_inv`, as the release ships them."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = Config.from_hf(folder)
    fp8 = {name for name, want in expected_tensors(cfg, mtp=True).items() if want.fp8_in_release}
    tensors = load_file(str(folder / WEIGHTS))
    written: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        if name in fp8:
            written[name], written[name + "_scale_inv"] = quantize_fp8(w.astype(np.float32))
        else:
            written[name] = w
    save_file(written, str(out / WEIGHTS), metadata={"format": "pt"})
    for f in folder.iterdir():
        if f.name != WEIGHTS:
            (out / f.name).write_bytes(f.read_bytes())
    return out


def draft_agreement(model: Model, tokens: Any, batch: int = 16) -> np.ndarray:
    """Teacher-forced agreement `[B, T - 1]` (bool) of `tokens [T]` or `[B, T]`: at t, whether the MTP
    module's argmax for token t+2 (from h_t and the true token t+1) equals the model's argmax at t+1,
    i.e. whether greedy speculative decoding would accept the first draft. Needs `mtp=True`."""
    if "mtp" not in model.params:
        raise ValueError("teacher-forced acceptance needs the MTP module: load the model with mtp=True")
    tokens = np.atleast_2d(np.asarray(tokens, np.int32))
    if tokens.shape[1] < 2:
        raise ValueError(f"teacher-forced acceptance needs at least 2 tokens per row, got {tokens.shape[1]}")
    agree = []
    for i in range(0, len(tokens), batch):  # [batch, T, V] logits at a time
        rows = jnp.asarray(tokens[i:i + batch])
        main, draft = map(np.asarray, programs.greedy_main_and_draft(model.params, rows, **model.program_kwargs))
        agree.append(draft[:, :-1] == main[:, 1:])  # the draft at T-1 has no true next token
    return np.concatenate(agree)


def teacher_forced_acceptance(model: Model, tokens: Any, batch: int = 16) -> float:
    """The MTP module's first-draft acceptance on `tokens [T]` (or `[B, T]`) under greedy decoding,
    teacher-forced: the share of positions t (0 <= t <= T - 2) where the module's argmax for token
    t+2 (from h_t and the true token t+1) equals the model's argmax at t+1 (`draft_agreement`).
    Needs a model loaded with `mtp=True`."""
    return float(draft_agreement(model, tokens, batch).mean())


def draft_rows(model: Model, tok: Tokenizer, prompts: list[list[int]], new_tokens: int, ks: list[int],
               repeats: int = 2) -> list[dict[str, Any]]:
    """Greedy generation at batch 1 of each prompt with `draft_tokens=k` for k in `ks` (0 first).

    Per k: `draft_acceptance`, the share of all drafted tokens accepted (`GenerationResult.
    draft_acceptance`, mean over the prompts), which at k=1 is the first-draft acceptance;
    `accepted_per_step` (that share times k: drafts accepted per verify step); decode tok/s (all
    prompts' decode tokens over their decode seconds, the best of `repeats` passes alternating k,
    after a compiling warm-up per k); the speedup over k=0; and whether every prompt's tokens equal
    k=0's (greedy drafts must not change the output)."""
    greedy = Sampling(temperature=0.0)
    for k in ks:
        _log(f"draft_tokens={k}: compiling ...")
        generate(model, [prompts[0]], tokenizer=tok, max_new_tokens=new_tokens, sampling=greedy, draft_tokens=k)
    runs: dict[int, list] = {}
    speed = dict.fromkeys(ks, 0.0)
    for i in range(repeats):
        for k in ks:
            _log(f"pass {i + 1}/{repeats}, draft_tokens={k}: {len(prompts)} prompts ...")
            runs[k] = [generate(model, [p], tokenizer=tok, max_new_tokens=new_tokens, sampling=greedy,
                                draft_tokens=k) for p in prompts]
            rate = sum(r.decode_tokens for r in runs[k]) / max(sum(r.decode_seconds for r in runs[k]), 1e-9)
            speed[k] = max(speed[k], rate)
    rows = []
    for k in ks:
        share = float(np.mean([r.draft_acceptance for r in runs[k]])) if k else None
        rows.append({"draft_tokens": k, "draft_acceptance": share,
                     "first_draft_acceptance": share if k == 1 else None,
                     "accepted_per_step": share * k if k else 0.0, "decode_tok_s": speed[k],
                     "speedup": speed[k] / max(speed[ks[0]], 1e-9),
                     "same_tokens": all(a.completions[0].tokens == b.completions[0].tokens
                                        for a, b in zip(runs[k], runs[ks[0]]))})
    return rows


def plot(bpb_rows: list[dict], spec_rows: list[dict], path: str | Path) -> None:
    """Two panels: bits per byte by variant; acceptance and speedup by draft tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1.3, 1]})
    labels = [f"{r['variant']}\n({r['path']}, {r['bytes']:,} B)" for r in bpb_rows]
    bars = left.barh(labels, [r["bpb"] for r in bpb_rows],
                     color=["tab:blue" if r["path"] == "forward" else "tab:cyan" for r in bpb_rows])
    left.bar_label(bars, fmt="%.3f", padding=2)
    left.set(xlabel="held-out bits per byte", xlim=(0, max(r["bpb"] for r in bpb_rows) * 1.25))
    left.tick_params(axis="y", labelsize=7)
    left.invert_yaxis()
    drafted = [r for r in spec_rows if r["draft_tokens"]]
    ks = [str(r["draft_tokens"]) for r in drafted]
    right.bar(ks, [r["draft_acceptance"] for r in drafted], color="tab:blue", label="share of drafts accepted")
    right.set(xlabel="draft tokens k", ylabel="share of drafts accepted", ylim=(0, 1))
    twin = right.twinx()
    twin.plot(ks, [r["speedup"] for r in drafted], "o-", color="tab:red")
    twin.set_ylabel("decode tok/s vs k=0", color="tab:red")
    twin.axhline(1.0, color="tab:red", lw=0.5, ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bpb_rows(folder: Path, rows: np.ndarray, nbytes: np.ndarray, decode_windows: int) -> list[dict[str, Any]]:
    """Bits per byte of each precision variant; the cache rows through prefill + decode (see module doc)."""
    out = []

    def add(variant: str, path: str, model: Model, score, scored: np.ndarray, start: float) -> None:
        bpb, nb = score(model, scored, nbytes)
        out.append({"variant": variant, "path": path, "bpb": bpb, "bytes": nb})
        _log(f"{variant} ({path}): {bpb:.4f} bits per byte over {nb:,} bytes ({time.perf_counter() - start:.0f} s)")

    for variant, kwargs in (("float32 weights", {"dtype": "float32"}), ("bf16 weights", {"dtype": "bfloat16"}),
                            ("int8 weights", {"quant": "int8", "dtype": "bfloat16"})):
        t = time.perf_counter()
        add(variant, "forward", load(folder, progress=False, **kwargs), bits_per_byte, rows, t)
    with tempfile.TemporaryDirectory(prefix="dsr1-fp8-") as tmp:
        t = time.perf_counter()
        fp8 = load(fp8_round_trip(folder, Path(tmp) / "fp8"), dtype="float32", progress=False)
        add("FP8 128x128 round trip (read in float32)", "forward", fp8, bits_per_byte, rows, t)
    cached = rows[:decode_windows]
    for variant, cache_dtype in (("bf16 weights, bf16 cache", None), ("bf16 weights, int8 cache", "int8")):
        t = time.perf_counter()
        model = load(folder, dtype="bfloat16", kv_cache_dtype=cache_dtype, progress=False)
        add(variant, f"decode, {len(cached)} window{'s' * (len(cached) > 1)}", model, bits_per_byte_decoded,
            cached, t)
    return out


def print_tables(result: dict[str, Any]) -> None:
    """The results as Markdown to stdout."""
    spec = result["speculative"]
    print(f"model: {result['model']}; held-out text: {result['text'] or 'the held-out plays'} "
          f"({result['tokens']:,} tokens, windows of {result['seq_len']}); device: {result['device']}\n")
    print("| variant | path | bits per byte | bytes scored |\n|---|---|---|---|")
    for r in result["bits_per_byte"]:
        print(f"| {r['variant']} | {r['path']} | {r['bpb']:.4f} | {r['bytes']:,} |")
    print("\nforward: the full-sequence path (`Model.forward`), which never reads the latent cache; decode: prefill "
          "of each window's first token, then one `Model.decode` step per token, so every later position attends "
          "to the cached (for int8: quantized) latents; compare the two decode rows with each other.\n")
    print(f"Teacher-forced first-draft acceptance on {result['acceptance_positions']:,} held-out positions (float32 "
          f"weights; the MTP module's argmax at t, from h_t and the true token t+1, against the model's argmax at "
          f"t+1): **{result['teacher_forced_acceptance']:.1%}**\n")
    print(f"Greedy generation at batch 1, {result['speculative_dtype']} weights, {result['prompts']} held-out "
          f"prompts of {result['prompt_len']} tokens, {result['new_tokens']} new tokens each:\n")
    print("| draft tokens k | share of drafts accepted | first-draft acceptance | accepted drafts per step "
          "| decode tok/s | speedup vs k=0 | same tokens as k=0 |")
    print("|---|---|---|---|---|---|---|")
    for r in spec:
        share = f"{r['draft_acceptance']:.1%}" if r["draft_acceptance"] is not None else "-"
        first = f"{r['first_draft_acceptance']:.1%}" if r["first_draft_acceptance"] is not None else "-"
        print(f"| {r['draft_tokens']} | {share} | {first} | {r['accepted_per_step']:.2f} | {r['decode_tok_s']:.1f} "
              f"| {r['speedup']:.2f}x | {r['same_tokens']} |")
    print("\nshare of drafts accepted: `GenerationResult.draft_acceptance`, accepted / drafted tokens (mean over "
          "prompts); it is the first-draft acceptance only at k=1 (generate does not expose per-position counts). "
          "decode tok/s: decode tokens / decode seconds over all prompts, best pass after a compiling warm-up. "
          "same tokens: every prompt's greedy tokens equal k=0's (in bfloat16 a near tie may round differently in "
          "the multi-token verify step than in the one-token decode step).")


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    """The `quality` command: bits per byte by variant, teacher-forced acceptance, drafting runs."""
    folder = model_folder(args.model)
    tok = load_tokenizer(folder)
    ids = held_out_tokens(tok, args.text, args.max_bytes)
    nbytes = token_bytes_table(tok)
    rows = windows(ids, args.seq_len)
    if len(ids) < args.prompt_len + 1:
        raise SystemExit(f"the held-out text has {len(ids)} tokens: too few for prompts of {args.prompt_len}")
    bpb = bpb_rows(folder, rows, nbytes, args.decode_windows)
    acceptance = teacher_forced_acceptance(load(folder, dtype="float32", mtp=True, progress=False), rows[:, :-1])
    _log(f"teacher-forced first-draft acceptance: {acceptance:.1%}")
    starts = np.linspace(0, len(ids) - args.prompt_len - 1, args.prompts).astype(int)
    prompts = [ids[s:s + args.prompt_len].tolist() for s in starts]
    ks = [0, *sorted(set(args.draft_tokens))]
    spec = draft_rows(load(folder, dtype=args.dtype, mtp=True, progress=False), tok, prompts, args.new_tokens, ks,
                      args.repeats)
    result = {"command": "quality", "model": str(folder), "text": args.text, "max_bytes": args.max_bytes,
              "tokens": int(len(ids)), "seq_len": args.seq_len, "bits_per_byte": bpb,
              "teacher_forced_acceptance": acceptance, "acceptance_positions": int(rows.shape[0] * (args.seq_len - 1)),
              "prompts": len(prompts), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "speculative": spec, "speculative_dtype": args.dtype, "device": jax.devices()[0].device_kind}
    print_tables(result)
    if args.plot:
        plot(bpb, spec, args.plot)
        _log(f"wrote {args.plot}")
    return result


def add_quality_options(p: argparse.ArgumentParser) -> None:
    """The `quality` command's options."""
    p.add_argument("--model", help="a release-layout folder with an MTP layer (default: the embedded demo model, "
                   "dsr1.demo_checkpoint())")
    p.add_argument("--text", help="held-out UTF-8 text file (default: the held-out plays of python -m dsr1.train's "
                   "corpus, as it evaluates them)")
    p.add_argument("--max-bytes", type=positive_int, default=200_000,
                   help="bytes of held-out text at most (default: 200000)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per scored window (default: 256)")
    p.add_argument("--decode-windows", type=positive_int, default=4,
                   help="windows scored token by token through the cache (default: 4)")
    p.add_argument("--prompts", type=positive_int, default=8,
                   help="held-out prompts for the drafting runs (default: 8)")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="greedy tokens per prompt (default: 64)")
    p.add_argument("--draft-tokens", type=positive_ints, default=[1, 2, 3],
                   help="comma-separated k to run besides k=0 (default: 1,2,3)")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"),
                   help="weights of the drafting runs (default: float32; in bfloat16 the multi-token verify step and "
                        "the one-token decode step round differently, so a near tie can change a greedy token)")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed passes over the prompts per k; the fastest "
                   "is reported (default: 2)")
    p.add_argument("--plot", metavar="PNG", help="write the two-panel figure (matplotlib) here")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
