"""Serving: continuous batching over a paged latent cache, free of HTTP.

The device side is one primitive, `dsr1.programs.extend` (`dsr1.core.model.extend`): T new tokens
per batch slot against that slot's pages of a `PagedKVCache`, with fixed (bucketed) shapes so
sequences joining, growing and leaving never compile a new program. `dsr1.programs.step.serve_step`
runs it with per-request sampling. Design: docs/serving.md. The host side, one concept per module:

- `pages`: the page allocator (reference-counted, so sequences with a common prefix can share
  pages read-only), page-table arrays, page arithmetic and a check of `extend`'s host inputs.
- `request`: `Request`, a submitted prompt's thread-safe handle (tokens, log-probabilities, text,
  streaming, cancel).
- `prefix_cache`: full pages keyed by their token prefix (a trie of page-sized chunks), LRU
  eviction, offload to host memory and reload on a hit.
- `page_pool`: the device page pool and page copies to and from host memory (recorded by a
  `PageLog` on process 0, run by every process's `PagePool`).
- `scheduler`: admissions, chunked prefill interleaved with decode, pages, finishing requests.
- `work`: a step's device work as host arrays (`StepWork`) and the `DeviceRunner` that dispatches it.
- the per-slot device state and the engine's programs (with MTP drafts) are `dsr1.programs.step` and
  `dsr1.programs.draft_step`.
- `grammar`: llguidance matchers and the token bitmasks of constrained requests.
- `broadcast`: a `StepWork`'s wire format (page tables as changed entries), and a device-broadcast channel.
- `control`: the host control plane: process 0's `StepWork` to the other JAX processes over TCP.
- `engine`: `Engine`, the event loop over asynchronous dispatch (`submit`, `step`, `run`, `stats`;
  `follow` and `close` across processes).

    engine = dsr1.serving.Engine(model, max_seqs=8, page_size=16, num_pages=512)
    request = engine.submit("Why is the sky blue?", chat=True, max_new_tokens=64)
    engine.run()
    print(request.text)
"""

from ..generation.output import TokenLogprob
from .engine import Engine, EngineStats
from .request import FINISH_REASONS, Request

__all__ = ["FINISH_REASONS", "Engine", "EngineStats", "Request", "TokenLogprob"]
