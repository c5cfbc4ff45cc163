"""Load checkpoints as one of several processes and report what this process read.

Used by test_convert.py in subprocesses (`jax.distributed` and the device count must be set up
before JAX starts). For each folder and mesh it writes, per process, the bytes it read, the bytes
its plan says it reads (`loading.planned_reads`) and the tensors it read with their byte counts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from tests.harness import join_processes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", action="append", required=True, help="a checkpoint folder (repeatable)")
    ap.add_argument("--mesh", action="append", required=True, help="EXPERTxTENSOR (repeatable)")
    ap.add_argument("--out", required=True, help="folder for one JSON per process")
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()

    join_processes(args.num_processes, args.process_id, args.port)

    import dsr1
    from dsr1.core.sharding import DEFAULT_RULES
    from dsr1.weights.loading import load_params, plan_load, planned_reads
    from dsr1.weights.safetensors_io import ReadLog

    report = {}
    for folder in args.folder:
        cfg = dsr1.Config.from_hf(folder)
        for shape in args.mesh:
            expert, tensor = map(int, shape.split("x"))
            mesh = dsr1.make_mesh(expert=expert, tensor=tensor)
            plan = planned_reads(plan_load(folder, cfg, mesh, DEFAULT_RULES, "float32", mtp=True))
            _, read = load_params(folder, cfg, mesh, DEFAULT_RULES, "float32", mtp=True, progress=False)
            by_name: dict[str, list] = {}
            for info, region in read.reads.regions:
                by_name.setdefault(info.name, []).append((info, region))
            tensors = {name: ReadLog(regions).bytes() for name, regions in by_name.items()}
            report[f"{Path(folder).name} {shape}"] = {"read": read.bytes, "planned": plan.bytes(),
                                                     "tensors": tensors}
    (Path(args.out) / f"{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
