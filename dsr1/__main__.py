"""Command line: `generate` streams a completion, `chat` is a multi-turn REPL, `serve` runs an
OpenAI-compatible HTTP server, `convert` writes dsr1's checkpoint format (or `--check`s a release checkpoint).

    python -m dsr1 generate --prompt "Why is the sky blue?" --chat --temperature 0.6
    python -m dsr1 generate --model /ckpt/DeepSeek-R1 --quant int8 --prompt "..."
    python -m dsr1 chat --model /ckpt/r1-int8
    python -m dsr1 serve --model /ckpt/r1-int8 --max-seqs 16 --port 8000
    python -m dsr1 convert --hf /ckpt/DeepSeek-R1 --out /ckpt/r1-int8 --quant int8

Without --model, the embedded demo model runs (`dsr1.demo_checkpoint()`: a small DeepSeek-V3 trained on
Shakespeare, with its own tokenizer); `--preset tiny` runs random weights with R1's tokenizer (noise).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import jax

from .options import add_model_options, model_from_options
from .server.options import add_serve_arguments
from .weights import convert


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


def _template_kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _template_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-kwargs", type=_template_kwargs, metavar="JSON",
                   help='the chat template\'s switches, as vLLM takes them: \'{"thinking": true}\' opens V3.1\'s, '
                        'V3.2\'s and V4\'s reasoning (their default is chat mode); V3.2 and V4 also take '
                        '"drop_thinking", V4 "reasoning_effort" ("high" or "max")')


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsr1", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion for one or more prompts, then report speed",
                         description="Generate for the prompts (one batch) and stream the first row's text.")
    add_model_options(gen, default_preset=None)
    gen.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text (repeat for a batch; default: a short question)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _template_args(gen)
    gen.add_argument("--draft-tokens", type=int, default=0, metavar="K",
                     help="MTP speculative decoding: draft K tokens per step with the model's MTP module (0 = off)")
    gen.add_argument("--no-warmup", action="store_true",
                     help="skip the warm-up run (then the speed figures include compilation)")
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive multi-turn chat (/reset clears, /exit or Ctrl-D quits)")
    add_model_options(chat, default_preset=None)
    chat.add_argument("--system", help="system prompt")
    _template_args(chat)
    _sampling_args(chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                           description="Serve the model over HTTP with OpenAI's API, on the serving engine.")
    add_model_options(serve, default_preset=None)
    add_serve_arguments(serve)
    conv = sub.add_parser("convert", help="convert a HF release checkpoint to dsr1's format, or --check one",
                          description=convert.__doc__.split("\n\n")[0])
    convert.add_arguments(conv)
    return ap



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

    model = model_from_options(args, mtp=args.draft_tokens > 0)  # text in and out with the model's own tokenizer
    prompts = args.prompt or ["Why is the sky blue?"]
    sampling = _sampling(args)
    kwargs = dict(sampling=sampling, chat=args.chat, draft_tokens=args.draft_tokens,
                  chat_template_kwargs=args.chat_template_kwargs)
    if not args.no_warmup:
        generate(model, prompts, **kwargs)  # compiles the programs this run uses
    result = generate(model, prompts, stream=_echo, **kwargs)
    print()
    for i, c in enumerate(result.completions[1:], start=1):
        print(f"--- prompt {i + 1}: {c.text}")
    first = result.completions[0]
    if args.chat:
        print(f"[reasoning: {len(first.reasoning)} chars, answer: {len(first.answer)} chars]", file=sys.stderr)
    drafts = f" | drafts accepted: {result.draft_acceptance:.0%}" if args.draft_tokens else ""
    print(f"[{first.finish_reason}] {_speed(result)}{drafts} on {jax.device_count()} {jax.devices()[0].platform} "
          "device(s)", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace, stdin=sys.stdin) -> int:
    from dsr1.generation.batch import generate

    model = model_from_options(args)
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
        result = generate(model, [system + history], sampling=sampling, stream=_echo,
                          chat_template_kwargs=args.chat_template_kwargs)
        print()
        # Earlier turns go back without their reasoning, as the chat templates render them.
        history.append({"role": "assistant", "content": result.completions[0].answer})
        print(f"[{_speed(result)}]", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server.cli import run  # FastAPI, uvicorn and prometheus_client load only to serve
    except ModuleNotFoundError as e:
        if e.name not in ("fastapi", "uvicorn", "prometheus_client", "pydantic", "starlette"):
            raise
        print(f"error: serving needs the server extra ({e.name} is missing): pip install 'dsr1[server]'",
              file=sys.stderr)
        return 1
    return run(args)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "convert":
        return convert.run(ap, args)
    try:
        if args.command == "serve":
            return _serve(args)
        return run_generate(args) if args.command == "generate" else run_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
