"""A generation widget for the notebook workbench: prompt, chat toggle, sampling controls, a
Generate button and streaming output.

On a cluster the model is split across processes, so every process must run the same generation
(same programs, same stop decisions) or the collectives wait forever. Given the cluster, the
widget therefore submits the identical call to every engine (non-blocking), runs it in the kernel
with streaming, then waits for the engines, under the watchdog of `%%everywhere`
(`dsr1.workbench.engines.watch`): an engine that dies or raises ends the generation with an error
naming it and showing its traceback. The engines use their own `model` and `tokenizer` (created by
`load_everywhere` or the same `%%everywhere` cells as the kernel's), which ipyparallel looks up by
name in each engine's namespace (`ipyparallel.Reference`).
"""

from __future__ import annotations

import time
from typing import Any

from ..api import Model
from ..generation.batch import GenerationResult, generate
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer
from .connection import Cluster
from .process import ClusterError


class GenerationWidget:
    """`GenerationWidget(model, tokenizer, cluster=cluster)`; display it, or drive it from code:
    `w.prompt.value = "..."; w.button.click()`, then read `w.output.value` and `w.result`.
    Without `cluster` (or on a single host) it generates in this process alone."""

    def __init__(self, model: Model, tokenizer: Tokenizer, *, cluster: Cluster | None = None,
                 model_name: str = "model", tokenizer_name: str = "tokenizer", max_new_tokens: int = 128,
                 chunk_size: int = 4):
        import ipywidgets as w

        self.model, self.tokenizer, self.cluster = model, tokenizer, cluster
        # Decode steps between two updates of the output box: a short answer still appears as it grows.
        self.chunk_size = chunk_size
        self.names = (model_name, tokenizer_name)
        self.prompt = w.Textarea(value="Why is the sky blue?", description="prompt", layout=w.Layout(width="100%"))
        self.chat = w.Checkbox(value=True, description="chat template")
        self.temperature = w.FloatSlider(value=0.6, min=0.0, max=2.0, step=0.05, description="temperature")
        self.top_p = w.FloatSlider(value=0.95, min=0.05, max=1.0, step=0.05, description="top-p")
        self.max_tokens = w.IntSlider(value=max_new_tokens, min=1, max=1024, description="max tokens")
        # MTP speculative decoding: offered when the model was loaded with its MTP module (mtp=True).
        self.drafts = w.IntSlider(value=0, min=0, max=3 if "mtp" in model.params else 0, description="MTP drafts")
        self.button = w.Button(description="Generate", button_style="primary")
        self.output = w.Textarea(value="", description="output", layout=w.Layout(width="100%", height="160px"))
        self.status = w.Label(value="")
        self.result: GenerationResult | None = None
        self.button.on_click(lambda _: self.generate())
        self.box = w.VBox([self.prompt, w.HBox([self.chat, self.temperature, self.top_p, self.max_tokens, self.drafts]),
                           self.button, self.output, self.status])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)

    def _append(self, row: int, text: str) -> None:
        if row == 0:
            self.output.value += text

    def generate(self) -> GenerationResult:
        """Run one generation with the current controls (in every process of the cluster, if given)."""
        kwargs = dict(max_new_tokens=self.max_tokens.value, chat=self.chat.value, draft_tokens=self.drafts.value,
                      chunk_size=self.chunk_size,
                      sampling=Sampling(temperature=self.temperature.value, top_p=self.top_p.value, seed=0))
        prompts = [self.prompt.value]
        self.output.value, self.status.value = "", "generating..."

        def here() -> tuple[GenerationResult, CompileTimes, float]:
            with CompileTimes() as compiles:
                result = generate(self.model, prompts, tokenizer=self.tokenizer, stream=self._append, **kwargs)
                finished = time.perf_counter()
            return result, compiles, finished

        if self.cluster is None or self.cluster.single:
            result, compiles, finished = here()
        else:
            result, compiles, finished = self._everywhere(here, prompts, kwargs)
        self.result = result
        # The prefill ended when decoding began: counted back from the end, the window leaves out the
        # work before the prefill (tokenizing, the sampling arrays), which may compile too.
        prefill_end = finished - result.decode_seconds
        self.status.value = status_line(result, compiles.within(prefill_end - result.prefill_seconds, prefill_end),
                                        compiles.total)
        return result

    def _everywhere(self, here: Any, prompts: list[str], kwargs: dict[str, Any]) -> Any:
        """``here()`` in this kernel and the same generation on every engine, watched."""
        import ipyparallel as ipp

        from .engines import busy_engines, engine_targets, watch

        cluster = self.cluster
        ids = engine_targets(cluster, None)
        busy = busy_engines(cluster, ids)
        if busy:
            raise ClusterError(f"{', '.join(cluster.describe(e) for e in busy)} still runs an earlier cell: the "
                               f"generation would wait for it; see dsr1.workbench.abort_stale and reset_engines")
        model, tokenizer = (ipp.Reference(name) for name in self.names)
        pending = {e: cluster.client[e].apply_async(_generate_on_engine, model, prompts, tokenizer, kwargs)
                   for e in ids}
        _, value = watch(cluster, pending, here, None, what="the generation")
        return value


def status_line(r: GenerationResult, prefill_compile_seconds: float, compile_seconds: float) -> str:
    """The widget's status: prefill throughput without the compilation it included (a first call
    compiles), decode throughput (and the share of MTP drafts accepted), and the compilation time on its own."""
    prefill = r.prefill_tokens / max(r.prefill_seconds - prefill_compile_seconds, 1e-9)
    compiled = f", compilation {compile_seconds:.1f} s (not counted)" if compile_seconds else ""
    drafts = f", {r.draft_acceptance:.0%} of MTP drafts accepted" if r.draft_acceptance is not None else ""
    return (f"{r.completions[0].finish_reason}: {r.decode_tokens} tokens, prefill {_rate(prefill)} tok/s, "
            f"decode {r.decode_tokens_per_second:,.1f} tok/s{drafts}{compiled}")


def _rate(per_second: float) -> str:
    """Whole tokens per second, or three significant figures below a hundred."""
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.3g}"


class CompileTimes:
    """The JAX compilations (tracing, lowering, XLA compilation) of this process while in the
    ``with`` block, from ``jax.monitoring``'s duration events: ``total`` seconds, and
    :meth:`within` a time window."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []  # (end on time.perf_counter, duration)

    def _record(self, event: str, duration: float, **_: Any) -> None:
        if event in self.EVENTS:
            self.spans.append((time.perf_counter(), duration))

    def __enter__(self) -> CompileTimes:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._record)

    @property
    def total(self) -> float:
        return sum(d for _, d in self.spans)

    def within(self, start: float, end: float) -> float:
        """Seconds of compilation that ended between ``start`` and ``end`` (``time.perf_counter``)."""
        return sum(d for t, d in self.spans if start <= t <= end)


def _generate_on_engine(model: Model, prompts: list[str], tokenizer: Tokenizer, kwargs: dict[str, Any]) -> None:
    """An engine's part of a widget generation: the kernel's call without streaming. Returns
    nothing: the kernel shows its own result, the same one."""
    generate(model, prompts, tokenizer=tokenizer, **kwargs)
