"""Command line: `python -m dsr1 generate` streams a completion; `python -m dsr1 chat` is a multi-turn REPL.

    python -m dsr1 generate --prompt "Why is the sky blue?" --chat --temperature 0.6
    python -m dsr1 generate --model /ckpt/DeepSeek-R1 --quant int8 --prompt "..."
    python -m dsr1 chat --model /ckpt/r1-int8

Without --model, a random-weight `tiny` model with R1's tokenizer runs (its text is noise).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax


def _model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", help="HF release checkpoint folder or a converted one")
    src.add_argument("--preset", default="tiny", help="random weights for a named config (default: tiny)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype")
    p.add_argument("--quant", choices=["int8"], help="int8 matmul weights (per-output-channel scales)")
    p.add_argument("--kv-cache-dtype", choices=["int8"], help="int8 latent cache (per-token scales)")
    p.add_argument("--expert", type=int, help="expert-parallel mesh size (default: automatic)")
    p.add_argument("--tensor", type=int, help="tensor-parallel mesh size (default: automatic)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); R1 suggests 0.6")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style, on prompt and output tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI-style, on output tokens")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI-style, on output tokens")
    g.add_argument("--seed", type=int, help="sampling seed (same seed, same output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsr1", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion for one or more prompts, then report speed",
                         description="Generate for the prompts (one batch) and stream the first row's text.")
    _model_args(gen)
    gen.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text (repeat for a batch; default: a short question)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in R1's chat template")
    gen.add_argument("--no-warmup", action="store_true",
                     help="skip the warm-up run (then the speed figures include compilation)")
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive multi-turn chat (/reset clears, /exit or Ctrl-D quits)")
    _model_args(chat)
    chat.add_argument("--system", help="system prompt")
    _sampling_args(chat)
    return ap


def _load(args: argparse.Namespace):
    import dsr1
    from dsr1.generation.tokenizer import load_tokenizer

    mesh = dsr1.make_mesh(expert=args.expert, tensor=args.tensor)
    if args.model:
        model = dsr1.load(args.model, mesh=mesh, dtype=args.dtype, quant=args.quant, kv_cache_dtype=args.kv_cache_dtype)
        print(f"model: {args.model} ({model.weight_bytes() / 2**30:.2f} GiB of weights)", file=sys.stderr)
        return model, load_tokenizer(args.model)
    model = dsr1.init_random(dsr1.Config.preset(args.preset), mesh=mesh, dtype=args.dtype, quant=args.quant,
                             kv_cache_dtype=args.kv_cache_dtype)
    print(f"model: preset {args.preset!r} with RANDOM weights (no checkpoint): the text is noise", file=sys.stderr)
    return model, load_tokenizer()


def _sampling(args: argparse.Namespace):
    from dsr1.generation.sampling import Sampling

    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, seed=args.seed, stop_strings=tuple(args.stop),
                    max_new_tokens=args.max_new_tokens)


def _echo(row: int, text: str) -> None:
    if row == 0:
        sys.stdout.write(text)
        sys.stdout.flush()


def _speed(result: Any) -> str:
    return (f"prefill: {result.prefill_tokens} tokens, {result.prefill_tokens_per_second:,.1f} tok/s | "
            f"decode: {result.decode_tokens} tokens, {result.decode_tokens_per_second:,.1f} tok/s")


def run_generate(args: argparse.Namespace) -> int:
    from dsr1.generation.batch import generate

    model, tokenizer = _load(args)
    prompts = args.prompt or ["Why is the sky blue?"]
    sampling = _sampling(args)
    kwargs = dict(sampling=sampling, tokenizer=tokenizer, chat=args.chat)
    if not args.no_warmup:
        generate(model, prompts, **kwargs)  # compiles the programs this run uses
    result = generate(model, prompts, stream=_echo, **kwargs)
    print()
    for i, c in enumerate(result.completions[1:], start=1):
        print(f"--- prompt {i + 1}: {c.text}")
    first = result.completions[0]
    if args.chat:
        print(f"[reasoning: {len(first.reasoning)} chars, answer: {len(first.answer)} chars]", file=sys.stderr)
    print(f"[{first.finish_reason}] {_speed(result)} on {jax.device_count()} {jax.devices()[0].platform} device(s)",
          file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace, stdin=sys.stdin) -> int:
    from dsr1.generation.batch import generate

    model, tokenizer = _load(args)
    sampling = _sampling(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    print("chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        print("you> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        print("r1> ", end="", file=sys.stderr, flush=True)
        result = generate(model, [system + history], sampling=sampling, tokenizer=tokenizer, stream=_echo)
        print()
        # The template drops earlier turns' reasoning itself, so the whole text is kept.
        history.append({"role": "assistant", "content": result.completions[0].text})
        print(f"[{_speed(result)}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run_generate(args) if args.command == "generate" else run_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
