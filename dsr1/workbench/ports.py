"""The cluster's one port range: every port a host listens on for the other hosts (the ipyparallel
controller, JAX's coordinator, the smoke check's coordinator, the serving control channel, the
server of serve.ipynb) is one of ``$MCJAX_PORTS`` (``LOW-HIGH``, default 8476-8575, what
cluster/README.md tells the firewall to let through between the hosts), on the host's cluster
address, never every interface.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from .process import ClusterError

__all__ = ["DEFAULT_PORTS", "free_port", "open_probe", "port_range", "reaches"]

DEFAULT_PORTS = (8476, 8575)


def port_range(text: str | None = None) -> tuple[int, int]:
    """The range ``LOW-HIGH`` of ``text``, else of ``$MCJAX_PORTS``, else `DEFAULT_PORTS`."""
    text = os.environ.get("MCJAX_PORTS", "") if text is None else text
    if not text.strip():
        return DEFAULT_PORTS
    low, sep, high = text.strip().partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) < 65536):
        raise ClusterError(f"MCJAX_PORTS={text!r} is not a port range LOW-HIGH (1 <= LOW <= HIGH <= 65535)")
    return int(low), int(high)


def free_port(address: str, *, highest: bool = False, ports: tuple[int, int] | None = None) -> int:
    """The lowest (``highest``: the highest) port of the range free on ``address`` now. On the
    local provider (every host is this machine's loopback: no firewall between them) any free
    port, as several local clusters at once would race for the range's first."""
    if os.environ.get("MCJAX_PROVIDER") == "local" and ports is None:
        with socket.socket() as s:
            s.bind((address, 0))
            return s.getsockname()[1]
    low, high = ports or port_range()
    for port in (range(high, low - 1, -1) if highest else range(low, high + 1)):
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    raise ClusterError(f"no port of the cluster's range {low}-{high} (MCJAX_PORTS) is free on {address}")


def reaches(address: str, port: int, timeout: float = 5.0) -> str | None:
    """None when a TCP connection to ``address:port`` opens, else why not."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except OSError as e:
        return f"{address}:{port}: {e}"
    return None


def open_probe(address: str, *, highest: bool = False, seconds: float = 60.0) -> int:
    """Listen on the lowest (``highest``: the highest) free port of the range on ``address`` for
    ``seconds``, in a thread that accepts and closes every connection (what another host's
    `reaches` opens); the port."""
    low, high = port_range()
    for port in (range(high, low - 1, -1) if highest else range(low, high + 1)):
        try:
            server = socket.create_server((address, port))
        except OSError:
            continue
        threading.Thread(target=_accept_for, args=(server, seconds), daemon=True, name="mcjax-port-probe").start()
        return port
    raise ClusterError(f"no port of the cluster's range {low}-{high} (MCJAX_PORTS) is free on {address}")


def _accept_for(server: socket.socket, seconds: float) -> None:
    server.settimeout(0.5)
    end = time.monotonic() + seconds
    with server:
        while time.monotonic() < end:
            try:
                server.accept()[0].close()
            except OSError:
                pass  # no connection within the half second: look at the clock again
