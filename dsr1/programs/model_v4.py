"""DeepSeek-V4's passes as programs: `forward`, `prefill`, `decode`, `extend`, `streams` (`extend_streams`)
and `mtp_extend` of `dsr1.core.model_v4` (the contiguous cache: window rings, compressed entries and
compressor states per row)."""

from __future__ import annotations

import jax

from ..core import model_v4

__all__ = ["decode", "extend", "forward", "mtp_extend", "prefill", "streams"]

_MODEL = ("cfg", "mesh", "rules")  # the static arguments every program shares

forward = jax.jit(model_v4.forward, static_argnames=_MODEL)
prefill = jax.jit(model_v4.prefill, static_argnames=(*_MODEL, "max_len"))
decode = jax.jit(model_v4.decode, static_argnames=_MODEL, donate_argnames=("cache",))
extend = jax.jit(model_v4.extend, static_argnames=_MODEL, donate_argnames=("cache",))
mtp_extend = jax.jit(model_v4.mtp_extend, static_argnames=_MODEL, donate_argnames=("cache",))
streams = jax.jit(model_v4.extend_streams, static_argnames=_MODEL)
