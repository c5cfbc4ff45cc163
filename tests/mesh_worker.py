"""Run a checkpoint on a mesh in this process (or as one of several processes) and save the logits.

Used by test_sharding.py in subprocesses, because the device count (XLA_FLAGS) and
`jax.distributed` must be set up before JAX starts.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from tests.harness import join_processes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--inputs", required=True, help="npz with tokens, lengths, prefix")
    ap.add_argument("--out", required=True)
    ap.add_argument("--expert", type=int)
    ap.add_argument("--tensor", type=int)
    ap.add_argument("--assemble-on-devices", action="store_true",
                    help="load as onto accelerators: stacks assembled on the devices, FP8 experts dequantized there")
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()

    join_processes(args.num_processes, args.process_id, args.port)

    import dsr1
    from dsr1.core.sharding import to_host
    from tests.harness import decode_logits

    if args.assemble_on_devices:
        from dsr1.weights import loading
        loading.LoadPlan.accelerators = property(lambda plan: True)
    inputs = np.load(args.inputs)
    mesh = dsr1.make_mesh(expert=args.expert, tensor=args.tensor)
    model = dsr1.load(args.folder, mesh=mesh, dtype="float32", progress=False)
    forward = to_host(model.forward(inputs["tokens"], inputs["lengths"]))
    decoded = decode_logits(model, inputs["tokens"], inputs["lengths"], inputs["prefix"])
    experts = model.params["moe_layers"]["moe"]["gate"]
    heads = model.params["moe_layers"]["q_b"]
    if jax.process_index() == 0:
        keys = sorted(decoded)
        np.savez(args.out, forward=forward, decode_keys=np.array(keys), decode=np.stack([decoded[k] for k in keys]),
                 mesh_shape=np.array([mesh.shape["expert"], mesh.shape["tensor"]]),
                 processes=jax.process_count(), devices=jax.device_count(),
                 local_expert_shard=np.array(experts.addressable_shards[0].data.shape),
                 local_head_shard=np.array(heads.addressable_shards[0].data.shape))


if __name__ == "__main__":
    main()
