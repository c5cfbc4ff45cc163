"""The host control plane: process 0's step work to the other JAX processes over TCP.

Every process must run the same programs in the same order, but only process 0 plans the steps.
Sending each step's `StepWork` with a device broadcast (`broadcast.StepChannel`) makes the send a
program of its own, queued behind the step before it: no process can receive step n+1 before step n
ran, so the followers' host work (decoding the message, building the call's inputs, dispatching)
never overlaps the device. Over sockets, process 0 sends step n+1 while step n runs and the
followers dispatch it as soon as it arrives; the devices see only the steps' own programs.

Each message is `broadcast.encode_work` (the page table as the entries that changed since the last
step's) behind an 8-byte length (-1: stop). Setup takes one device broadcast, at construction:
process 0 listens on a free port of one address, the first of `leader_addresses` it can bind (never
every interface), and sends that address, the port and a random token to the others, which connect
and present the token. `DSR1_CONTROL_HOST` (comma-separated) names the addresses to bind instead,
the only ones tried (the cluster scripts set it to each host's cluster address), and
`DSR1_CONTROL_PORTS` (`LOW-HIGH`, the cluster's one port range) the ports to take the free one from.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable

import numpy as np

from .broadcast import decode_work, encode_work
from .work import StepWork

__all__ = ["HostChannel", "control_ports", "leader_addresses"]

_LENGTH = struct.Struct("<q")
_HELLO = struct.Struct("<i16s")  # a follower's process id and the token
_RENDEZVOUS_BYTES = 4096


def leader_addresses() -> list[str]:
    """Addresses the other hosts may reach this one at, best first: `$DSR1_CONTROL_HOST`'s, the
    host name's, the one the default route leaves from, then loopback (processes on this host)."""
    found = [h.strip() for h in os.environ.get("DSR1_CONTROL_HOST", "").split(",") if h.strip()]
    try:
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # picks the outgoing interface; sends nothing
            found.append(probe.getsockname()[0])
    except OSError:
        pass
    routable = [a for a in found if not a.startswith("127.")]
    return list(dict.fromkeys([*routable, "127.0.0.1"]))


def control_ports() -> list[int]:
    """The ports the channel may listen on: `$DSR1_CONTROL_PORTS` (`LOW-HIGH`), else [0] (any free one)."""
    text = os.environ.get("DSR1_CONTROL_PORTS", "").strip()
    if not text:
        return [0]
    low, sep, high = text.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) < 65536):
        raise ValueError(f"DSR1_CONTROL_PORTS={text!r} is not a port range LOW-HIGH (1 <= LOW <= HIGH <= 65535)")
    return list(range(int(low), int(high) + 1))


def _listen(backlog: int) -> socket.socket:
    """A server socket on the first address this host can bind, `$DSR1_CONTROL_HOST`'s alone when
    set, else `leader_addresses()`'s, on a free port of `control_ports()`: the address the others
    reach this host at, never every interface."""
    chosen = [h.strip() for h in os.environ.get("DSR1_CONTROL_HOST", "").split(",") if h.strip()]
    errors = {}
    for host in chosen or leader_addresses():
        for port in control_ports():
            try:
                return socket.create_server((host, port), backlog=backlog)
            except OSError as e:
                errors[host] = e
    raise ConnectionError(f"process 0 could not listen for the serving control channel on any of its addresses "
                          f"and ports {os.environ.get('DSR1_CONTROL_PORTS') or '(any)'} "
                          f"({'; '.join(f'{h}: {e}' for h, e in errors.items())}); set DSR1_CONTROL_HOST to one "
                          f"of this host's addresses")


def device_rendezvous(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others pass None), by one device broadcast."""
    from jax.experimental import multihost_utils

    buffer = np.zeros(_RENDEZVOUS_BYTES, np.uint8)
    if data is not None:
        if len(data) > _RENDEZVOUS_BYTES:
            raise ValueError(f"control channel rendezvous of {len(data)} bytes exceeds {_RENDEZVOUS_BYTES}")
        buffer[:len(data)] = np.frombuffer(data, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0")


class HostChannel:
    """Process 0 sends each step's `StepWork` (or a stop) to every other process, which receives
    it: `send` on process 0, `receive` on the others, in the same order everywhere.

    `rendezvous(data)` gives process 0's connection details to the others (default: one device
    broadcast, `device_rendezvous`); `timeout` bounds connecting, in seconds."""

    def __init__(self, process_id: int, num_processes: int, *,
                 rendezvous: Callable[[bytes | None], bytes] = device_rendezvous, timeout: float = 300.0):
        self.process_id, self.num_processes = process_id, num_processes
        self.bytes_sent = 0  # payload bytes, per follower
        self._table: np.ndarray | None = None  # the page table as of the last step with calls
        self._peers: dict[int, socket.socket] = {}
        self._leader: socket.socket | None = None
        if process_id == 0:
            with _listen(max(num_processes, 8)) as server:
                token = secrets.token_bytes(16)
                host, port = server.getsockname()[:2]
                rendezvous(json.dumps({"hosts": [host], "port": port, "token": token.hex()}).encode())
                self._peers = _accept(server, token, num_processes, timeout)
        else:
            offer = json.loads(rendezvous(None))
            self._leader = _connect(offer["hosts"], offer["port"], bytes.fromhex(offer["token"]), process_id,
                                    timeout)

    def send(self, work: StepWork | None) -> None:
        """(Process 0) `work` to every other process, or None to end their loop."""
        payload = b"" if work is None else encode_work(work, self._table).tobytes()
        message = _LENGTH.pack(-1 if work is None else len(payload)) + payload
        for pid, peer in self._peers.items():
            try:
                peer.sendall(message)
            except OSError as e:
                raise ConnectionError(f"process {pid} left the serving control channel ({e}): it exited or "
                                      f"failed; every process must be restarted") from e
        self.bytes_sent += len(payload)
        if work is not None and work.calls:
            self._table = work.page_table

    def receive(self) -> StepWork | None:
        """(Other processes) The next step's work, or None when process 0 stopped."""
        (size,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if size < 0:
            return None
        work = decode_work(np.frombuffer(self._read(size), np.uint8), self._table)
        if work.calls:
            self._table = work.page_table
        return work

    def close(self) -> None:
        """Close this process's connections (process 0: after sending the stop)."""
        for peer in [*self._peers.values(), *([self._leader] if self._leader else [])]:
            peer.close()
        self._peers, self._leader = {}, None

    def _read(self, size: int) -> bytes:
        data = _read_exactly(self._leader, size)
        if data is None:
            raise ConnectionError(f"process 0 closed the serving control channel before its stop (process "
                                  f"{self.process_id} waited for a step): it exited or failed")
        return data


def _accept(server: socket.socket, token: bytes, num_processes: int, timeout: float) -> dict[int, socket.socket]:
    """The followers' connections, by process id; a connection without the token is dropped."""
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    while len(peers) < num_processes - 1:
        server.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            missing = sorted(set(range(1, num_processes)) - set(peers))
            port = server.getsockname()[1]
            for peer in peers.values():
                peer.close()
            raise ConnectionError(
                f"processes {missing} did not connect to process 0's serving control channel (port {port}, "
                f"addresses {leader_addresses()}) within {timeout:.0f} s: the hosts must reach each other on "
                f"that port; set DSR1_CONTROL_HOST to an address of process 0's host they can reach") from None
        conn.settimeout(10.0)
        try:
            hello = _read_exactly(conn, _HELLO.size)
        except OSError:
            hello = None
        pid, offered = _HELLO.unpack(hello) if hello is not None else (-1, b"")
        if offered != token or not 0 < pid < num_processes or pid in peers:
            conn.close()
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peers[pid] = conn
    return dict(sorted(peers.items()))


def _connect(hosts: list[str], port: int, token: bytes, process_id: int, timeout: float) -> socket.socket:
    """A connection to process 0, trying each of its addresses in turn until `timeout`."""
    deadline, errors = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        for host in hosts:
            try:
                conn = socket.create_connection((host, port), timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
            except OSError as e:
                errors[host] = e
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HELLO.pack(process_id, token))
            return conn
        time.sleep(0.5)
    tried = "; ".join(f"{h}: {e}" for h, e in errors.items())
    raise ConnectionError(f"process {process_id} could not reach process 0's serving control channel on port {port} "
                          f"within {timeout:.0f} s ({tried}); set DSR1_CONTROL_HOST on process 0's host to an "
                          f"address the others can reach")


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    """`size` bytes from `conn`, or None if it closes first."""
    buffer, got = bytearray(size), 0
    view = memoryview(buffer)
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buffer)
