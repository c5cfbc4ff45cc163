"""Every jitted program of the package, defined once, built on the model core (`dsr1.core`).

The `Model` methods, `generate`, the serving engine, the benchmarks and the profiles call these,
so each compiles once per shape and static setting. Static arguments are the hashable description
of the program (`cfg`, `mesh`, `rules`, sizes and dtypes); arrays are the weights, tokens, caches
and device state. A cache or state passed to a program that donates it is reused for the result,
so the caller must not use it again.

- `model`: the model's passes. `forward`, `prefill`, `decode` (`dsr1.core.model`); `init_params`
  (`random_params`): random weights made in their shardings in one program; `extend` and
  `paged_cache`: T new tokens per row against each row's pages of a `PagedKVCache` (donated),
  compiled once per (B, T, P, K) bucket whatever the rows' starts, counts and page tables, and an
  empty page pool on the mesh; `greedy_decode`: `steps` greedy steps in one `fori_loop`, recording
  the tokens fed and the experts routed (what benchmarks and profiles account for);
  `greedy_main_and_draft`: the model's and the MTP module's teacher-forced argmaxes (`dsr1.bench quality`);
  `random_cache`: a cache as if prompts had been prefilled, for timing decode at any context.
- `model_v4`: DeepSeek-V4's passes (`dsr1.core.model_v4`): `forward`, `prefill`, `decode`, `extend`
  (T new tokens per row against the contiguous `V4Cache`, donated), `streams` (the residual streams
  the MTP module reads) and `mtp_extend`.
- `decoding`: `generate`'s device loop. `generate_start`, `generate_chunk`: prefill and sample the
  first token, then up to `steps` decode-and-sample steps in one `lax.while_loop` that leaves early
  when every row is done; `speculative_start`, `speculative_chunk`: the same with MTP drafts
  (`speculative`).
- `step`: the serving engine's step and device state. `serve_step` (extend plus per-slot sampling),
  `slot_state`, `admit_slot`, `copy_pages`, `restore_pages`; `draft_step`: the same with MTP drafts
  (`serve_draft_step`, `serve_draft_prefill`, `draft_slot_state`, `admit_draft_slot`,
  `take_mtp_hidden`, `mtp_paged_cache`).
- `eplb`: the redundant experts' weight moves (`with_placement`, `moved_to`: device to device, a
  layer at a time; the placements themselves are `dsr1.core.eplb`).
- `sampling`: what the programs sample with (`sample`, penalties, token rules, log-probabilities,
  logits split over the vocabulary); a request's settings are `dsr1.Sampling` on the host.

This package imports the model core only: nothing above it (`dsr1.api`, `dsr1.generation`,
`dsr1.serving`, the server, the workbench, the benchmarks) is imported here.
"""

from __future__ import annotations

from .decoding import generate_chunk, generate_start, speculative_chunk, speculative_start
from .draft_step import (
    admit_draft_slot,
    draft_slot_state,
    mtp_paged_cache,
    serve_draft_prefill,
    serve_draft_step,
    take_mtp_hidden,
)
from .eplb import moved_to, with_placement
from .model import (
    decode,
    extend,
    forward,
    greedy_decode,
    greedy_main_and_draft,
    init_params,
    paged_cache,
    prefill,
    random_cache,
    random_params,
)
from .step import admit_slot, copy_pages, restore_pages, serve_step, slot_state

__all__ = ["admit_draft_slot", "admit_slot", "copy_pages", "decode", "draft_slot_state", "extend", "forward",
           "generate_chunk", "generate_start", "greedy_decode", "greedy_main_and_draft", "init_params", "moved_to",
           "mtp_paged_cache", "paged_cache", "prefill", "random_cache", "random_params", "restore_pages",
           "serve_draft_prefill", "serve_draft_step", "serve_step", "slot_state", "speculative_chunk",
           "speculative_start", "take_mtp_hidden", "with_placement"]
