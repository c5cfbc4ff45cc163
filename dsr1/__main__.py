"""Command line: `python -m dsr1 demo` runs prefill and greedy absorbed decode and reports timings."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsr1", description="DeepSeek-V3/R1 inference in pure JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="prefill random prompts and decode greedily, printing token ids and speed",
                          description="Runs a model end to end: prefill a batch of random prompts of different "
                                      "lengths, then decode greedily with the absorbed-latent cache.")
    src = demo.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", help="HF checkpoint folder in the release layout")
    src.add_argument("--preset", default="tiny", help="random weights for a named config (default: tiny)")
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    demo.add_argument("--batch", type=int, default=4, help="prompts in the batch (default: 4)")
    demo.add_argument("--prompt-len", type=int, default=32, help="longest prompt, in tokens (default: 32)")
    demo.add_argument("--new-tokens", type=int, default=32, help="tokens to decode per row (default: 32)")
    demo.add_argument("--expert", type=int, help="expert-parallel mesh size (default: automatic)")
    demo.add_argument("--tensor", type=int, help="tensor-parallel mesh size (default: automatic)")
    demo.add_argument("--seed", type=int, default=0)
    return ap


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def demo(args: argparse.Namespace) -> None:
    import dsr1
    from dsr1.sharding import to_host

    mesh = dsr1.make_mesh(expert=args.expert, tensor=args.tensor)
    if args.model:
        model = dsr1.load(args.model, mesh=mesh, dtype=args.dtype)
        print(f"model: {args.model}")
    else:
        model = dsr1.init_random(dsr1.Config.preset(args.preset), seed=args.seed, mesh=mesh, dtype=args.dtype)
        print(f"model: preset {args.preset!r} with RANDOM weights (no checkpoint): the tokens are meaningless")
    cfg = model.cfg
    n_params = sum(x.size for x in jax.tree.leaves(model.params))
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    print(f"  {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} MoE), "
          f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, {n_params / 1e6:.1f}M parameters, "
          f"{n_bytes / 2**20:.1f} MiB in {model.dtype}")
    print(f"  mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{jax.process_count()} process(es)")

    rng = np.random.default_rng(args.seed)
    lengths = np.linspace(args.prompt_len, max(1, args.prompt_len // 2), args.batch).astype(np.int32)
    tokens = rng.integers(2, cfg.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
    max_len = args.prompt_len + args.new_tokens
    model.prefill(tokens, lengths, max_len=max_len)  # compile
    (logits, cache), t_prefill = _timed(model.prefill, tokens, lengths, max_len)
    generated = [to_host(logits).argmax(-1)]
    model.decode(model.prefill(tokens, lengths, max_len=max_len)[1], generated[0])  # compile decode
    start = time.perf_counter()
    for _ in range(args.new_tokens - 1):
        logits, cache = model.decode(cache, generated[-1])
        generated.append(to_host(logits).argmax(-1))
    t_decode = time.perf_counter() - start
    out = np.stack(generated, axis=1)
    for row in range(args.batch):
        print(f"  row {row}: prompt {lengths[row]} tokens -> {out[row].tolist()}")
    steps = max(1, args.new_tokens - 1)
    print(f"prefill: {lengths.sum() / t_prefill:,.0f} tok/s ({t_prefill * 1e3:.1f} ms for {lengths.sum()} tokens)")
    print(f"decode:  {steps / t_decode:,.1f} steps/s x batch {args.batch} = {steps * args.batch / t_decode:,.0f} tok/s "
          f"(cache {cache.nbytes() / 2**20:.2f} MiB for {max_len} positions)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        demo(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
