"""Running the app under uvicorn: in the foreground with a graceful SIGTERM (`serve`), or on a
background thread (`BackgroundServer`, for tests and notebooks).

Graceful shutdown, on SIGTERM or SIGINT (or `BackgroundServer.stop()`): the runner stops
admitting, while the listener stays open: a new request is answered 503 with `Retry-After`, and
`/health` answers 503 "draining", so a load balancer takes the server out of rotation. Requests in
flight get `shutdown_timeout` seconds to finish; those still running are then cancelled and end
with finish reason "abort" (streams still end with `data: [DONE]`). Once none is left, uvicorn
closes the listener and the connections; then the engine's thread is stopped and `serve` returns
(exit status 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from .runner import EngineRunner

__all__ = ["BackgroundServer", "GracefulServer", "free_port", "serve"]

_BACKSTOP = 10.0  # seconds after the cancellations before uvicorn cancels the response tasks itself
_DRAIN_POLL = 0.05  # seconds between checks that the requests in flight are done


class GracefulServer(uvicorn.Server):
    """`uvicorn.Server` whose shutdown drains the app's runner first (see the module docstring)."""

    def __init__(self, app: FastAPI, *, host: str, port: int, shutdown_timeout: float, log_level: str):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                        access_log=log_level == "debug",
                                        timeout_graceful_shutdown=int(shutdown_timeout + _BACKSTOP)))
        self.runner: EngineRunner = app.state.runner
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain with the listener still open, cancel what outlives `shutdown_timeout`, then close."""
        self.runner.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.runner.in_flight and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL)
        self.runner.cancel_all()
        await super().shutdown(sockets)


def serve(app: FastAPI, *, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    """Serve `app` until SIGTERM or SIGINT, then shut down gracefully and return."""
    server = GracefulServer(app, host=host, port=port, shutdown_timeout=shutdown_timeout, log_level=log_level)
    # uvicorn re-raises the signal it handled once it is done; ignoring it then (and restoring the
    # previous handlers afterwards) makes a graceful stop a normal return, exit status 0.
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise RuntimeError(f"the server could not start on {host}:{port} (see the log above)")


class BackgroundServer:
    """Serve `app` from a background thread (uvicorn's own event loop there), e.g. in a test or a
    notebook; `url` is its base address once `start()` returns."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 30.0,
                 log_level: str = "warning"):
        self.app = app
        self.host = host
        self.port = port or free_port(host)
        self.server = GracefulServer(app, host=host, port=self.port, shutdown_timeout=shutdown_timeout,
                                     log_level=log_level)
        self._thread = threading.Thread(target=self.server.run, name="dsr1-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Shut down gracefully (as on SIGTERM) and wait for the thread to end."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str) -> int:
    """A port nobody listens on now (the OS picks it)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
