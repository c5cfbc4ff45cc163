"""`python -m dsr1 serve`: load the model, build the engine, warm it up and serve the app until
SIGTERM (see `lifecycle` for the graceful shutdown).

    python -m dsr1 serve --model /ckpt/DeepSeek-R1 --quant int8 --max-seqs 16 --port 8000
    python -m dsr1 serve                                          # the embedded demo model
    python -m dsr1 serve --draft-tokens 1                         # ... with MTP speculative decoding
    python -m dsr1 serve --model ... --layout dp --redundant-experts 32   # EPLB, rebalanced while serving
    python -m dsr1 serve --preset tiny --dtype float32            # random weights: the text is noise
    DSR1_API_KEY=secret python -m dsr1 serve --host 0.0.0.0 ...   # any non-loopback address needs a key
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..api import Model
from ..generation.tokenizer import load_tokenizer
from ..options import checkpoint_from_options, model_from_options
from ..serving import Engine
from .app import create_app
from .lifecycle import serve
from .options import ServerConfig, bind_refusal

__all__ = ["run"]

EXIT_REFUSED = 2  # as argparse's usage errors: the command line asks for something unsafe


def model_name(args: argparse.Namespace) -> str:
    """The id clients use: `--served-model-name`, else the checkpoint folder's name, the config
    file's stem or the preset."""
    if args.served_model_name:
        return args.served_model_name
    checkpoint = checkpoint_from_options(args)
    if checkpoint is not None:
        return Path(checkpoint).resolve().name
    return Path(args.config).stem if args.config else args.preset


def build_engine(args: argparse.Namespace) -> Engine:
    """The model (`--model`, the demo model, `--preset` or `--config`) and an engine of the requested sizes, warmed up
    unless `--no-warmup` (so that no request waits for a compilation). On a cluster every process
    builds it; only process 0 warms it up (the others join in `follow()`)."""
    model = model_from_options(args, mtp=args.draft_tokens > 0)
    if args.redundant_experts:
        model = with_redundant_experts(model, args.redundant_experts)
    engine = Engine(model, max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
                    prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
                    decode_steps=args.decode_steps, host_cache_bytes=args.host_cache_bytes,
                    max_seq_len=args.max_seq_len, draft_tokens=args.draft_tokens,
                    prefix_caching=not args.no_prefix_caching, tokenizer=load_tokenizer(checkpoint_from_options(args)),
                    rebalance_every=args.rebalance_every if args.redundant_experts else 0)
    if engine.is_leader and not args.no_warmup:
        print("compiling the engine's programs...", file=sys.stderr, flush=True)
        engine.warm_up()
    return engine


def with_redundant_experts(model: Model, redundant: int) -> Model:
    """`Model.with_redundant_experts`, its refusal (the slots must split over an expert axis of several
    devices) as the command's error."""
    try:
        return model.with_redundant_experts(redundant)
    except ValueError as e:
        raise SystemExit(f"--redundant-experts {redundant}: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; 0 after a graceful stop, 2 when the bind address is refused.

    On a cluster (`jax.distributed` initialized) process 0 serves HTTP and decides each step; the
    other processes run the same programs on process 0's schedule until it stops."""
    refusal = bind_refusal(args.host, args.api_key)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    config = ServerConfig(model_name=model_name(args), api_key=args.api_key or None, max_waiting=args.max_waiting,
                          default_max_tokens=args.default_max_tokens, shutdown_timeout=args.shutdown_timeout,
                          allowed_origins=tuple(args.allowed_origins), stall_timeout=args.health_stall_timeout,
                          max_reasoning_tokens=args.max_reasoning_tokens)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = build_engine(args)
    if not engine.is_leader:
        engine.follow()
        return 0
    app = create_app(engine, config)
    print(f"serving '{config.model_name}' on http://{args.host}:{args.port}/v1 "
          f"({'API key required' if config.api_key else 'no API key'})", file=sys.stderr, flush=True)
    try:
        serve(app, host=args.host, port=args.port, shutdown_timeout=config.shutdown_timeout,
              log_level=args.log_level)
    finally:
        engine.close()  # release the other processes' follow()
    print("server stopped", file=sys.stderr)
    return 0
