"""A live view of a dsr1 server (`python -m dsr1 serve`, `dsr1.server`) from its `GET /metrics`:
requests running and waiting, generated tokens per second, time to first token and prefix-cache
hits over time, as a notebook widget that a background thread keeps up to date
(`notebooks/serve.ipynb`), or as a figure of a history.

    live = LiveMetrics(url, api_key)
    display(live)
    live.start()
    ...                          # requests run; the widget follows them
    live.stop()                  # a last sample; `live.history` has every point
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections import deque
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["SERIES", "LiveMetrics", "plot_history", "point", "scrape", "totals"]

SERIES = {"running": "requests running", "waiting": "requests waiting", "tokens/s": "generated tokens / s",
          "ttft": "time to first token (s)", "prefix hits": "prompt tokens from the prefix cache"}


def totals(text: str) -> dict[str, float]:
    """Prometheus text's samples by name, summed over their labels (e.g. the finished requests of
    every endpoint and finish reason)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def scrape(url: str, api_key: str) -> dict[str, float]:
    """The server's `GET /metrics` as `totals`."""
    response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    response.raise_for_status()
    return totals(response.text)


def point(t: float, now: dict[str, float], before: dict[str, float], seconds: float) -> dict[str, float]:
    """One sample of the view from two scrapes `seconds` apart (`now` at time `t`)."""

    def delta(name: str) -> float:
        return now[name] - before[name]

    first_tokens = delta("dsr1_time_to_first_token_seconds_count")
    return {"t": t, "running": now["dsr1_requests_running"], "waiting": now["dsr1_requests_waiting"],
            "tokens/s": delta("dsr1_engine_generated_tokens_total") / seconds,
            "ttft": delta("dsr1_time_to_first_token_seconds_sum") / first_tokens if first_tokens else math.nan,
            "prefix hits": now["dsr1_prefix_hit_tokens_total"]}


def plot_history(fig: Any, history: list[dict[str, float]]) -> Any:
    """The view's history on `fig` (a matplotlib `Figure`): four panels against time."""
    t = [p["t"] for p in history]
    panels = (("running", "waiting"), ("tokens/s",), ("ttft",), ("prefix hits",))
    for ax, names in zip(fig.subplots(1, len(panels)), panels):
        for name in names:
            ax.plot(t, [p[name] for p in history], marker="." if name == "ttft" else None, label=SERIES[name])
        ax.set(xlabel="s", title=" / ".join(SERIES[n] for n in names) if len(names) == 1 else "requests")
        if len(names) > 1:
            ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


class LiveMetrics:
    """Polls the server's metrics every `interval` seconds on a daemon thread and shows the latest
    values in a widget updated from that thread, with a plot of their history redrawn every `redraw`
    seconds (drawing costs the CPU the processes serve with). Rates and the time to first token are
    taken over the last `window` seconds (a step can take longer than `interval`). `stop()` takes a
    last sample."""

    def __init__(self, url: str, api_key: str, interval: float = 0.5, redraw: float = 2.0, window: float = 2.0):
        import ipywidgets as w  # the notebook extra's: `import dsr1.workbench.server_view` works without it

        self.url, self.api_key, self.interval, self.redraw = url, api_key, interval, redraw
        self.history: list[dict[str, float]] = []
        self.error: BaseException | None = None
        self.label, self.image = w.HTML(), w.Image(format="png")
        self._start = self._drawn_at = time.monotonic()
        self._recent = deque([(self._start, scrape(url, api_key))], maxlen=round(window / interval) + 1)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="live-metrics", daemon=True)

    def _ipython_display_(self) -> None:
        import ipywidgets as w
        from IPython.display import display

        display(w.VBox([self.label, self.image]))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        if self.error is not None:
            raise self.error
        self.sample()
        self.draw()

    def _poll(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.sample()
                if time.monotonic() - self._drawn_at >= self.redraw:
                    self.draw()
            except Exception as e:  # stop() raises it in the notebook
                self.error = e
                return

    def sample(self) -> None:
        """Scrape the server, add a point to the history and show it."""
        at, now = time.monotonic(), scrape(self.url, self.api_key)
        then, before = self._recent[0]
        p = point(at - self._start, now, before, at - then)
        self.history.append(p)
        self._recent.append((at, now))
        ttft = "" if math.isnan(p["ttft"]) else f", time to first token {p['ttft']:.2f} s"
        self.label.value = (f"<b>{p['t']:5.1f} s</b>: {p['running']:.0f} running, {p['waiting']:.0f} waiting, "
                            f"{p['tokens/s']:.1f} tokens/s{ttft}, {p['prefix hits']:.0f} prefix-hit tokens")

    def draw(self) -> None:
        """Redraw the history plot."""
        from matplotlib.figure import Figure

        png = io.BytesIO()
        plot_history(Figure(figsize=(12, 2.6), dpi=72), self.history).savefig(png, format="png")
        self.image.value = png.getvalue()
        self._drawn_at = time.monotonic()
