"""A generation widget for the notebook workbench: prompt, chat toggle, sampling controls, a
Generate button and streaming output.

On a cluster the model is split across processes, so every process must run the same generation
(same programs, same stop decisions) or the collectives wait forever. Given the engines' view,
the widget therefore submits the identical call to every engine (non-blocking), runs it in the
kernel with streaming, then waits for the engines. The engines use their own `model` and
`tokenizer` (created by the same `%%px --local` cells as the kernel's), which ipyparallel looks up
by name in each engine's namespace (`ipyparallel.Reference`).
"""

from __future__ import annotations

from typing import Any

from ..api import Model
from ..generation.batch import GenerationResult, generate
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer


class GenerationWidget:
    """`GenerationWidget(model, tokenizer, engines=view)`; display it, or drive it from code:
    `w.prompt.value = "..."; w.button.click()`, then read `w.output.value` and `w.result`."""

    def __init__(self, model: Model, tokenizer: Tokenizer, *, engines: Any = None, model_name: str = "model",
                 tokenizer_name: str = "tokenizer", max_new_tokens: int = 128):
        import ipywidgets as w

        self.model, self.tokenizer, self.engines = model, tokenizer, engines
        self.names = (model_name, tokenizer_name)
        self.prompt = w.Textarea(value="Why is the sky blue?", description="prompt", layout=w.Layout(width="100%"))
        self.chat = w.Checkbox(value=True, description="chat template")
        self.temperature = w.FloatSlider(value=0.6, min=0.0, max=2.0, step=0.05, description="temperature")
        self.top_p = w.FloatSlider(value=0.95, min=0.05, max=1.0, step=0.05, description="top-p")
        self.max_tokens = w.IntSlider(value=max_new_tokens, min=1, max=1024, description="max tokens")
        self.button = w.Button(description="Generate", button_style="primary")
        self.output = w.Textarea(value="", description="output", layout=w.Layout(width="100%", height="160px"))
        self.status = w.Label(value="")
        self.result: GenerationResult | None = None
        self.button.on_click(lambda _: self.generate())
        self.box = w.VBox([self.prompt, w.HBox([self.chat, self.temperature, self.top_p, self.max_tokens]),
                           self.button, self.output, self.status])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)

    def _append(self, row: int, text: str) -> None:
        if row == 0:
            self.output.value += text

    def generate(self) -> GenerationResult:
        """Run one generation with the current controls (every process when engines are given)."""
        kwargs = dict(max_new_tokens=self.max_tokens.value, chat=self.chat.value,
                      sampling=Sampling(temperature=self.temperature.value, top_p=self.top_p.value, seed=0))
        prompts = [self.prompt.value]
        pending = None
        if self.engines is not None:
            import ipyparallel as ipp

            model, tokenizer = (ipp.Reference(name) for name in self.names)
            pending = self.engines.apply_async(_generate_on_engine, model, prompts, tokenizer, kwargs)
        self.output.value, self.status.value = "", "generating..."
        try:
            self.result = generate(self.model, prompts, tokenizer=self.tokenizer, stream=self._append, **kwargs)
        finally:
            if pending is not None:
                pending.get()  # surfaces an engine's error (e.g. a dead engine) in the notebook
        r = self.result
        self.status.value = (f"{r.completions[0].finish_reason}: {r.decode_tokens} tokens, prefill "
                             f"{r.prefill_tokens_per_second:,.0f} tok/s, "
                             f"decode {r.decode_tokens_per_second:,.1f} tok/s")
        return r


def _generate_on_engine(model: Model, prompts: list[str], tokenizer: Tokenizer, kwargs: dict[str, Any]) -> None:
    """An engine's part of a widget generation: the kernel's call without streaming. Returns
    nothing: the kernel shows its own result, the same one."""
    generate(model, prompts, tokenizer=tokenizer, **kwargs)
