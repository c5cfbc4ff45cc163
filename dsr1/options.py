"""Command-line options shared by `python -m dsr1` and `python -m dsr1.bench`: where the model
comes from (a checkpoint, a preset or a config.json with random weights), its precision, and the
mesh. One definition, so every command spells and defaults them the same way.
"""

from __future__ import annotations

import argparse
import sys

from jax.sharding import Mesh

from .api import Model, init_random, load
from .core.config import Config
from .core.sharding import make_mesh


def add_model_options(p: argparse.ArgumentParser, *, default_preset: str, checkpoints: bool = True) -> None:
    """`--model PATH` (when `checkpoints`) | `--preset NAME` | `--config PATH`, then dtype, int8
    weights and cache, and the mesh sizes."""
    src = p.add_mutually_exclusive_group()
    if checkpoints:
        src.add_argument("--model", metavar="PATH", help="HF release checkpoint folder or a converted one")
    src.add_argument("--preset", default=default_preset,
                     help=f"random weights for a named config: deepseek-r1, tiny or bench (default: {default_preset})")
    src.add_argument("--config", metavar="PATH", help="random weights for a HF config.json")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the weights that are not int8 (default: bfloat16)")
    p.add_argument("--quant", choices=["int8"], help="int8 matmul weights with per-output-channel scales")
    p.add_argument("--kv-cache-dtype", choices=["int8"], help="int8 latent cache with per-token scales")
    p.add_argument("--expert", type=int, help="expert-parallel mesh size (default: automatic)")
    p.add_argument("--tensor", type=int, help="tensor-parallel mesh size (default: automatic)")


def config_from_options(args: argparse.Namespace) -> tuple[Config, str]:
    """The config `--config` or `--preset` names, and a name for reports."""
    if args.config:
        return Config.from_hf(args.config), args.config
    return Config.preset(args.preset), args.preset


def mesh_from_options(args: argparse.Namespace) -> Mesh:
    """The mesh `--expert` and `--tensor` ask for (automatic sizes where not given)."""
    return make_mesh(expert=args.expert, tensor=args.tensor)


def model_from_options(args: argparse.Namespace, *, seed: int = 0) -> Model:
    """Load `--model`, or build random weights (from `seed`) for `--config` / `--preset`; says on
    stderr which, since random weights write noise."""
    mesh = mesh_from_options(args)
    if getattr(args, "model", None):
        model = load(args.model, mesh=mesh, dtype=args.dtype, quant=args.quant, kv_cache_dtype=args.kv_cache_dtype)
        print(f"model: {args.model} ({model.weight_bytes() / 2**30:.2f} GiB of weights)", file=sys.stderr)
        return model
    cfg, name = config_from_options(args)
    print(f"model: {name} with RANDOM weights (no checkpoint): the text is noise", file=sys.stderr)
    return init_random(cfg, seed=seed, mesh=mesh, dtype=args.dtype, quant=args.quant,
                       kv_cache_dtype=args.kv_cache_dtype)
