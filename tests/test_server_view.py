"""The live view of a server's metrics (`dsr1.workbench.server_view`): Prometheus text summed by
name, a view point from two scrapes, the history plot, and the polling widget against a stand-in
`/metrics` endpoint."""

from __future__ import annotations

import http.server
import math
import threading
import time

import pytest

from dsr1.workbench.server_view import LiveMetrics, plot_history, point, totals

NAMES = ("dsr1_requests_running", "dsr1_requests_waiting", "dsr1_engine_generated_tokens_total",
         "dsr1_time_to_first_token_seconds_sum", "dsr1_time_to_first_token_seconds_count",
         "dsr1_prefix_hit_tokens_total")


def metrics_text(tokens: float, first_tokens: float) -> str:
    return "\n".join([
        "# TYPE dsr1_requests_running gauge", "dsr1_requests_running 3",
        "# TYPE dsr1_requests_waiting gauge", "dsr1_requests_waiting 1",
        "# TYPE dsr1_engine_generated_tokens counter", f"dsr1_engine_generated_tokens_total {tokens}",
        "# TYPE dsr1_time_to_first_token_seconds histogram",
        f'dsr1_time_to_first_token_seconds_bucket{{endpoint="chat",le="+Inf"}} {first_tokens}',
        f'dsr1_time_to_first_token_seconds_count{{endpoint="chat"}} {first_tokens}',
        f'dsr1_time_to_first_token_seconds_sum{{endpoint="chat"}} {0.25 * first_tokens}',
        'dsr1_time_to_first_token_seconds_count{endpoint="completions"} 1',
        'dsr1_time_to_first_token_seconds_sum{endpoint="completions"} 0.5',
        "# TYPE dsr1_prefix_hit_tokens counter", "dsr1_prefix_hit_tokens_total 64", ""])


def test_totals_sum_over_labels_and_point_takes_rates():
    before, now = totals(metrics_text(100, 2)), totals(metrics_text(160, 6))
    assert before["dsr1_time_to_first_token_seconds_count"] == 3 and before["dsr1_time_to_first_token_seconds_sum"] == 1
    p = point(4.0, now, before, 2.0)
    assert p == {"t": 4.0, "running": 3, "waiting": 1, "tokens/s": 30.0, "ttft": 0.25, "prefix hits": 64}
    assert math.isnan(point(1.0, before, before, 1.0)["ttft"])  # no new first token: no time to show


def test_plot_history_draws_four_panels():
    from matplotlib.figure import Figure

    history = [point(t, totals(metrics_text(10 * t, t)), totals(metrics_text(0, 0)), 1.0) for t in (1.0, 2.0)]
    fig = plot_history(Figure(), history)
    assert len(fig.axes) == 4 and all(ax.lines for ax in fig.axes)


class _Metrics(http.server.BaseHTTPRequestHandler):
    scrapes = 0

    def do_GET(self) -> None:  # noqa: N802 - the handler's name is http.server's
        assert self.path == "/metrics" and self.headers["Authorization"] == "Bearer key"
        type(self).scrapes += 1
        body = metrics_text(10 * self.scrapes, self.scrapes).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def metrics_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_live_view_polls_until_stopped(metrics_url):
    live = LiveMetrics(metrics_url, "key", interval=0.05, redraw=0.1, window=0.1)
    live.start()
    deadline = time.monotonic() + 60
    while len(live.history) < 2 and time.monotonic() < deadline:  # drawing the first plot may take a while
        time.sleep(0.05)
    live.stop()  # takes one more sample
    assert len(live.history) >= 3 and all(p["running"] == 3 for p in live.history)
    assert live.history[-1]["tokens/s"] > 0 and "3 running, 1 waiting" in live.label.value
    assert bytes(live.image.value).startswith(b"\x89PNG")
