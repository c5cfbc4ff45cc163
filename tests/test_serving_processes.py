"""The serving engine across JAX processes: 2 processes x 2 devices (jax.distributed over gloo,
process 0 deciding and sending each step's work over the host channel, the others following) give
the same outputs as 1 process, with prefix hits and pages offloaded to host memory and reloaded on
all; the wire format of a step's work, and the host channel itself."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import dsr1
from dsr1.generation.sampling import Sampling
from dsr1.programs.step import StepRows
from dsr1.serving import Engine
from dsr1.serving.broadcast import decode_work, encode_work, payload_bucket
from dsr1.serving.page_pool import PageOp
from dsr1.serving.rows import lane_rows
from dsr1.serving.work import Admission, StepWork, host_rules, host_sampling

from . import serving_worker
from .harness import TINY, free_port, start_processes, wait_processes


def assert_same_work(got: StepWork, want: StepWork) -> None:
    def leaves(work: StepWork) -> list[np.ndarray]:
        return [x for x in jax.tree.leaves(dataclasses.astuple(work)) if isinstance(x, np.ndarray)]

    assert [op.kind for op in got.page_ops] == [op.kind for op in want.page_ops]
    assert [a.slot for a in got.admissions] == [a.slot for a in want.admissions]
    got_leaves, want_leaves = leaves(got), leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()


def test_step_work_survives_the_wire():
    rows = lane_rows((), 2, 8, 4)
    rows = dataclasses.replace(rows, tokens=np.arange(16, dtype=np.int32).reshape(2, 8), sample=np.array([1, 0], bool))
    settings = Sampling(temperature=0.7, top_p=0.9, seed=2**40 + 3, logit_bias={5: 2.5}, bad_words_ids=[[3, 4]],
                        min_tokens=2, stop_token_ids=[1])
    work = StepWork(
        page_ops=(PageOp("save", np.array([3, 4], np.int32), np.array([0, 1], np.int32)),
                  PageOp("restore", np.array([5], np.int32), np.array([0], np.int32)),
                  PageOp("release", np.zeros(0, np.int32), np.array([0, 1], np.int32))),
        admissions=(Admission(2, host_sampling([settings]), np.array([9, 8, 7], np.int32), host_rules([settings])),),
        calls=(rows, lane_rows((), 4, 1, 4)),
        page_table=np.arange(12, dtype=np.int32).reshape(4, 3))
    data = encode_work(work)
    assert data.dtype == np.uint8 and payload_bucket(data.size) >= data.size
    assert_same_work(decode_work(data), work)
    assert isinstance(decode_work(data).calls[0], StepRows)
    assert_same_work(decode_work(encode_work(StepWork())), StepWork())
    # Against the receiver's last table, only the entries that changed travel.
    grown = work.page_table.copy()
    grown[1, 2] = 40
    step = dataclasses.replace(work, page_table=grown)
    delta = encode_work(step, work.page_table)
    assert delta.size < encode_work(step).size
    assert_same_work(decode_work(delta, work.page_table), step)
    assert_same_work(decode_work(encode_work(step, np.zeros((2, 3), np.int32)), np.zeros((2, 3), np.int32)), step)


def test_host_channel_sends_steps_and_table_deltas_to_every_follower():
    """Process 0 and two followers (threads here) over the sockets: a stranger without the token
    is turned away; every follower receives every step, the page tables rebuilt from their changed
    entries, then the stop; a follower whose leader vanishes says so."""
    import json
    import queue
    import socket
    import threading

    from dsr1.serving.control import HostChannel

    offers: queue.Queue = queue.Queue()
    turned_away = threading.Event()

    def rendezvous(data, copies=2):
        if data is None:
            offer = offers.get(timeout=30)
            turned_away.wait(30)
            return offer
        for _ in range(copies):
            offers.put(data)
        return data

    def stranger():  # connects first, as process 1 with a wrong token: the leader drops it
        offer = json.loads(offers.get(timeout=30))
        with socket.create_connection((offer["hosts"][0], offer["port"])) as s:
            s.sendall(b"\x01\x00\x00\x00" + b"x" * 16)
            assert s.recv(1) == b""
        turned_away.set()

    table = np.arange(12, dtype=np.int32).reshape(4, 3)
    steps = [StepWork(calls=(lane_rows((), 4, 1, 4),), page_table=table), StepWork(),
             StepWork(calls=(lane_rows((), 4, 1, 4),), page_table=np.where(table == 7, 70, table))]
    received: dict = {}

    def follow(pid):
        channel = HostChannel(pid, 3, rendezvous=rendezvous, timeout=30)
        received[pid] = []
        while (work := channel.receive()) is not None:
            received[pid].append(work)
        channel.close()

    threads = [threading.Thread(target=stranger)] + [threading.Thread(target=follow, args=(p,)) for p in (1, 2)]
    for t in threads:
        t.start()
    leader = HostChannel(0, 3, rendezvous=lambda data: rendezvous(data, copies=3), timeout=30)
    for work in steps:
        leader.send(work)
    leader.send(None)
    leader.close()
    for t in threads:
        t.join(30)
    assert turned_away.is_set()
    for pid in (1, 2):
        assert len(received[pid]) == len(steps)
        for got, want in zip(received[pid], steps):
            assert_same_work(got, want)
    assert leader.bytes_sent < sum(encode_work(w).size for w in steps)  # the third table went as one entry

    def orphan():
        try:
            HostChannel(1, 2, rendezvous=rendezvous, timeout=30).receive()
        except ConnectionError as e:
            received["error"] = str(e)

    thread = threading.Thread(target=orphan)
    thread.start()
    HostChannel(0, 2, rendezvous=lambda data: rendezvous(data, copies=1), timeout=30).close()  # no stop
    thread.join(30)
    assert "process 0 closed the serving control channel before its stop" in received["error"]


def test_host_channel_listens_on_one_address_not_every_interface():
    """Process 0 binds the first of DSR1_CONTROL_HOST's addresses it can (one that is not this
    host's is passed over), never 0.0.0.0, and offers the others only that one."""
    import json
    import os
    import threading

    from dsr1.serving import control

    offered: list = []

    def rendezvous(data):
        offered.append(json.loads(data))
        threading.Thread(target=lambda: control.HostChannel(1, 2, rendezvous=lambda _: data, timeout=30)).start()
        return data

    old = os.environ.pop("DSR1_CONTROL_HOST", None)
    expected = control.leader_addresses()[0]  # this host's own, best first
    os.environ["DSR1_CONTROL_HOST"] = f"198.51.100.7,{expected}"  # TEST-NET-2 first: no host's address
    try:
        with control._listen(8) as server:
            assert server.getsockname()[0] == expected != "0.0.0.0"
        leader = control.HostChannel(0, 2, rendezvous=rendezvous, timeout=30)
    finally:
        os.environ.pop("DSR1_CONTROL_HOST") if old is None else os.environ.update(DSR1_CONTROL_HOST=old)
    leader.send(None)
    leader.close()
    assert offered[0]["hosts"] == [expected], offered


@pytest.mark.slow
@pytest.mark.parametrize("processes,devices,control", [
    (2, 2, "host"), pytest.param(4, 1, "host", marks=pytest.mark.extended),
    pytest.param(2, 2, "device", marks=pytest.mark.extended)])
def test_processes_serve_like_one(tmp_path, processes, devices, control):
    """2 processes x 2 devices (4 x 1, and 2 x 2 with device broadcasts: extended) serve the same
    tokens as one process; with the host channel the steps' work never goes through a device
    collective."""
    out, port = tmp_path / "out.json", free_port()
    common = ["--out", str(out), "--expert=2", "--tensor=2", f"--num-processes={processes}", f"--port={port}",
              f"--control={control}"]
    procs = start_processes("tests.serving_worker", common, count=processes, devices=devices)
    try:
        # The reference, in this process (1 device) while the others run.
        model = dsr1.init_random(TINY, seed=0, dtype="float32")
        engine = Engine(model, **serving_worker.SHAPES)
        engine.warm_up()
        one = serving_worker.serve(engine)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    wait_processes(procs)
    leader, *followers = (json.loads((tmp_path / f"out.json.{i}").read_text()) for i in range(processes))
    print(f"\n[serving] 1 process: {one}\n[serving] {processes} processes ({control}), process 0: {leader}; "
          f"the others: {followers}")
    assert (leader["processes"], leader["devices"]) == (processes, 4)
    assert leader["tokens"] == one["tokens"], f"{processes} processes x {devices} devices serve as 1 process does"
    assert one["cached"][-2:] == [12, 12] and one["offloaded"] > 0 and one["reloaded"] > 0
    for key in ("cached", "prefix_hit_tokens", "offloaded", "reloaded", "host_pages"):
        assert leader[key] == one[key], key
    for follower in followers:
        assert follower["host_copies"] == leader["host_copies"] == leader["host_pages"] > 0, \
            "each follower keeps its own host copies of exactly the pages process 0's cache offloaded"
    if control == "host":
        assert [p["broadcasts"] for p in (leader, *followers)] == [0] * processes, "no device broadcast"
    else:
        assert leader["broadcasts"] > 0
