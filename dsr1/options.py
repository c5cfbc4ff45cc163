"""Command-line options shared by `python -m dsr1` and `python -m dsr1.bench`: where the model
comes from (a checkpoint, the embedded demo model, a preset or a config.json with random weights),
its precision, and the mesh. One definition, so every command spells and defaults them the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jax.sharding import Mesh

from .api import Model, init_random, load
from .core.config import Config
from .core.sharding import LAYOUTS, MOE_DISPATCH, ShardingRules, layout_rules, make_mesh
from .weights.demo import demo_checkpoint


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An argparse type: one positive integer."""
    value = positive_ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return value[0]


def add_model_options(p: argparse.ArgumentParser, *, default_preset: str | None, checkpoints: bool = True) -> None:
    """`--model PATH` (when `checkpoints`) | `--preset NAME` | `--config PATH`, then dtype, int8
    weights and cache, and the mesh sizes. `default_preset=None`: without any of the three, the
    command runs the embedded demo model (`dsr1.demo_checkpoint()`)."""
    src = p.add_mutually_exclusive_group()
    if checkpoints:
        src.add_argument("--model", metavar="PATH",
                         help="HF release checkpoint folder or a converted one"
                         + (" (default: the embedded demo model)" if default_preset is None else ""))
    default = default_preset or "none: the embedded demo model"
    src.add_argument("--preset", default=default_preset,
                     help=f"random weights for a named config: deepseek-r1, deepseek-v3.1 (R1's shapes), tiny, bench "
                          f"or demo (default: {default})")
    src.add_argument("--config", metavar="PATH", help="random weights for a HF config.json")
    p.add_argument("--layers", type=int, metavar="N",
                   help="random weights with N layers of the preset's or config's shape (its dense layers kept up "
                        "to N - 1, so at least one is MoE): e.g. R1-shaped layers on one device")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the weights that are not int8 (default: bfloat16)")
    p.add_argument("--quant", choices=["int8"], help="int8 matmul weights with per-output-channel scales")
    p.add_argument("--kv-cache-dtype", choices=["int8"], help="int8 latent cache with per-token scales")
    p.add_argument("--expert", type=int, help="expert-parallel mesh size (default: automatic)")
    p.add_argument("--tensor", type=int, help="tensor-parallel mesh size (default: automatic)")
    p.add_argument("--layout", choices=LAYOUTS, default="tp",
                   help="tp: every device holds every row and its cache, attention heads split over the tensor axis "
                        "(lowest latency; default); dp: attention data parallelism, each device of the expert axis "
                        "owns a share of the rows and of their cache, with the all-to-all expert dispatch "
                        "(throughput; docs/layouts.md)")
    p.add_argument("--moe-dispatch", choices=MOE_DISPATCH,
                   help="how tokens reach the routed experts: psum (every device sees every token, partial outputs "
                        "summed; tp's default) or all_to_all (rows split over the expert axis, each token-expert "
                        "pair sent to its expert's device and back; dp's default; docs/layouts.md)")


def config_from_options(args: argparse.Namespace) -> tuple[Config, str]:
    """The config `--config` or `--preset` names (with `--layers` layers if given), and a name for reports."""
    cfg, name = (Config.from_hf(args.config), args.config) if args.config else (Config.preset(args.preset), args.preset)
    layers = getattr(args, "layers", None)
    if layers is None:
        return cfg, name
    if layers < 1:
        raise SystemExit(f"--layers must be at least 1, not {layers}")
    return with_layers(cfg, layers), f"{name} ({layers} layers)"


def with_layers(cfg: Config, layers: int) -> Config:
    """`cfg`'s shape with `layers` layers: its leading dense layers kept up to `layers - 1`, the rest MoE."""
    dense = min(cfg.first_k_dense_replace, layers - 1)
    return dataclasses.replace(cfg, num_hidden_layers=layers, first_k_dense_replace=dense)


def mesh_from_options(args: argparse.Namespace) -> Mesh:
    """The mesh `--expert` and `--tensor` ask for (automatic sizes where not given)."""
    return make_mesh(expert=args.expert, tensor=args.tensor)


def rules_from_options(args: argparse.Namespace) -> ShardingRules:
    """The sharding rules of `--layout`, with `--moe-dispatch` when given."""
    dispatch = getattr(args, "moe_dispatch", None)
    return layout_rules(getattr(args, "layout", "tp"), **({"moe_dispatch": dispatch} if dispatch else {}))


def checkpoint_from_options(args: argparse.Namespace) -> str | None:
    """The checkpoint folder the options name: `--model`, the embedded demo model when the command
    defaults to it and no `--preset` or `--config` is given, else None (random weights)."""
    model = getattr(args, "model", None)
    path = model or (str(demo_checkpoint()) if args.preset is None and args.config is None else None)
    if path is not None and getattr(args, "layers", None) is not None:
        raise SystemExit("--layers shapes random weights (--preset or --config), not a checkpoint")
    return path


def model_from_options(args: argparse.Namespace, *, seed: int = 0, mtp: bool = False) -> Model:
    """Load the checkpoint (`--model` or the demo model; `mtp`: with its MTP module), or build random
    weights (from `seed`) for `--config` / `--preset`; says on stderr which, since random weights
    write noise."""
    mesh = mesh_from_options(args)
    rules = rules_from_options(args)
    path = checkpoint_from_options(args)
    if path is not None:
        model = load(path, mesh=mesh, dtype=args.dtype, quant=args.quant, kv_cache_dtype=args.kv_cache_dtype,
                     mtp=mtp, rules=rules)
        print(f"model: {path} ({model.weight_bytes() / 2**30:.3f} GiB of weights)", file=sys.stderr)
        return model
    cfg, name = config_from_options(args)
    print(f"model: {name} with RANDOM weights (no checkpoint): the text is noise", file=sys.stderr)
    return init_random(cfg, seed=seed, mesh=mesh, dtype=args.dtype, quant=args.quant,
                       kv_cache_dtype=args.kv_cache_dtype, mtp=mtp and cfg.num_nextn_predict_layers > 0, rules=rules)
