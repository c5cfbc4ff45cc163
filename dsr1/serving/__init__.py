"""Serving: continuous batching over a paged latent cache.

The device side is one primitive, `dsr1.programs.extend` (`dsr1.core.model.extend`): T new tokens
per batch slot against that slot's pages of a `PagedKVCache`, with fixed (bucketed) shapes so
sequences joining, growing and leaving never compile a new program. The host side decides which
pages each sequence owns:

- `pages`: the page allocator (reference-counted, so sequences with a common prefix can share
  pages read-only), page-table arrays, page arithmetic and a check of `extend`'s host inputs.
"""
