"""`python -m dsr1.bench shares`: what each host of a TPU slice asks the disk for when it loads the
release checkpoint, computed from the release's tensor index (no weights needed).

A host reads the regions of the checkpoint's tensors that its chips hold, plus the tensors every
chip holds whole (`dsr1.weights.loading.planned_reads`, the regions `dsr1.load` reads and logs).
The mesh is laid out over the slice's real topology (libtpu's deviceless topology: which chip
belongs to which host), as `dsr1.make_mesh` lays it out on the pod. Bytes are counted exactly (the
regions' bytes) and in whole 4 KiB pages (what the page cache reads for them; in the index a
tensor's offset within its shard is unknown, so pages are counted from the tensor's start).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..core.config import Config
from ..core.sharding import LAYOUTS, layout_rules
from ..weights.loading import plan_load, planned_reads
from ..weights.release import CheckpointIndex
from ..weights.safetensors_io import DTYPES, PAGE_BYTES, page_ranges, ranges_bytes
from .chips import SLICES
from .plan import TARGETS, parse_mesh
from .tpu import topology_mesh


def add_shares_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", required=True, metavar="PATH",
                   help="the release's tensor index with shapes (model.safetensors.index-with-shapes.json[.gz]: "
                        "{name: {shape, dtype, file}}) or a release folder")
    p.add_argument("--config", metavar="PATH", help="its config.json (default: the deepseek-r1 preset)")
    p.add_argument("--target", required=True, choices=sorted(SLICES), help="the TPU slice")
    p.add_argument("--mesh", type=parse_mesh, metavar="expert=E,tensor=T",
                   help="mesh axis sizes (default: the slice's plan mesh)")
    p.add_argument("--layout", choices=LAYOUTS, default="tp", help="sharding layout (default: tp)")
    p.add_argument("--quant", choices=["int8"], help="int8 matmul weights (what is read does not change)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def _index(path: Path) -> CheckpointIndex:
    return CheckpointIndex.open(path) if path.is_dir() else CheckpointIndex.from_shape_index(path)


def host_shares(index: CheckpointIndex, cfg: Config, mesh: Any, layout: str, quant: str | None) -> list[dict]:
    """Per host (process) of `mesh`'s devices: its chips, the bytes it reads (exact and in 4 KiB
    pages) and the routed experts' part of them."""
    plan = plan_load(index.folder, cfg, mesh, layout_rules(layout), "bfloat16", quant=quant, mtp=False, index=index)
    hosts = sorted({d.process_index for d in mesh.devices.flat})
    rows = []
    for host in tqdm(hosts, desc="hosts", file=sys.stderr):
        row = {"host": host, "chips": sum(d.process_index == host for d in mesh.devices.flat),
               "bytes": 0, "page_bytes": 0, "expert_bytes": 0, "expert_page_bytes": 0}
        for info, runs in planned_reads(plan, host).tensor_runs():
            exact, pages = ranges_bytes(runs), ranges_bytes(page_ranges(runs, PAGE_BYTES))
            kinds = ("", "expert_") if ".mlp.experts." in info.name else ("",)
            for kind in kinds:
                row[kind + "bytes"] += exact
                row[kind + "page_bytes"] += pages
        rows.append(row)
    return rows


def run_shares(args: argparse.Namespace) -> dict[str, Any]:
    index = _index(Path(args.index))
    cfg = Config.from_hf(args.config) if args.config else Config.preset("deepseek-r1")
    slice_ = SLICES[args.target]
    sizes = args.mesh or dict(TARGETS[args.target].mesh)
    mesh = topology_mesh(slice_, sizes)
    rows = host_shares(index, cfg, mesh, args.layout, args.quant)
    mtp = f"model.layers.{cfg.num_hidden_layers}."  # the MTP module: not loaded here
    total = sum(int(np.prod(info.shape, dtype=np.int64)) * DTYPES[info.dtype].itemsize
                for name, info in index.tensors.items() if not name.startswith(mtp))
    per_host = np.array([r["bytes"] for r in rows])
    result = {"target": args.target, "topology": slice_.topology, "mesh": sizes, "layout": args.layout,
              "hosts": len(rows), "checkpoint_bytes": total, "rows": rows,
              "max_host_bytes": int(per_host.max()), "mean_host_bytes": float(per_host.mean())}
    print(shares_table(result))
    return result


def shares_table(result: dict[str, Any]) -> str:
    gb = 1e9
    rows = result["rows"]
    lines = [f"{result['target']} ({result['topology']}), mesh expert={result['mesh']['expert']},"
             f"tensor={result['mesh']['tensor']}, layout {result['layout']}: {result['hosts']} hosts; "
             f"checkpoint (no MTP) {result['checkpoint_bytes'] / gb:.1f} GB", "",
             "| host | chips | reads GB | in 4 KiB pages GB | routed experts GB | experts in pages GB |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['host']} | {r['chips']} | {r['bytes'] / gb:.2f} | {r['page_bytes'] / gb:.2f} | "
              f"{r['expert_bytes'] / gb:.2f} | {r['expert_page_bytes'] / gb:.2f} |" for r in rows]
    return "\n".join(lines)
