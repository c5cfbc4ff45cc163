"""Benchmarks, one concern per module (the command line is `python -m dsr1.bench`):

- `accounting`: the bytes a decode step must read (weights touched, experts hit, cache).
- `bandwidth`: the device's measured copy bandwidth and its description.
- `timing`: greedy decode timed in one jitted loop on a cache built at any context.
- `prefill`: prefill timed, its FLOPs counted and set against the matmul peak measured in the run.
- `experts`: the routed-expert kernels (`ragged_dot`, the expert loop, dense) side by side.
- `compare_hf`: the same random checkpoint through HF transformers and dsr1.
- `serve`: a seeded serving workload through the engine (continuous batching) and through static
  batches of `generate`; latency and throughput summaries; time to first token with a shared prefix.
- `plan`: a capacity plan: decode and prefill compiled from abstract sharded weights on a fake CPU
  mesh; weight bytes per device, cache bytes per token, the batch x context that fits.
- `report`: Markdown tables and the device and model lines.
- `cli`: the `decode`, `prefill`, `moe`, `compare-hf`, `serve`, `plan`, `load` and `quality` commands.
"""
