"""The serving control plane's host cost per step: process 0 sends R1-sized step work to N-1 processes.

Process 0 encodes each step's `StepWork` (a decode call over every slot, the page table as the entries
that changed, now and then an admitted prompt and its prefill call) and sends it over the host
channel (`dsr1.serving.control.HostChannel`) to N-1 follower processes on this machine, which decode
it; no JAX device is involved. A step goes out every `--interval-ms` (the device's step time).
Reported per step: process 0's send time (encode and send to every follower), the latency from
process 0 starting to send a step to a follower holding it decoded (median and 99th percentile over
followers and steps), and the bytes sent against those with the full page table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

import numpy as np

from ..options import positive_int, positive_ints
from ..serving.broadcast import encode_work
from ..serving.control import HostChannel
from ..serving.rows import lane_rows
from ..serving.work import Admission, StepWork, host_rules, host_sampling
from .report import markdown_table

CONTROL_COLUMNS = ("processes", "send_us", "latency_us", "latency_p99_us", "bytes_per_step",
                   "full_table_bytes_per_step")


def synthetic_steps(slots: int, table_width: int, page_size: int, steps: int, prompt_len: int,
                    admit_every: int, seed: int = 0) -> list[StepWork]:
    """`steps` steps of an engine whose `slots` rows decode one token per step (each row takes a new
    page every `page_size` steps, at staggered times) and which admits a `prompt_len`-token prompt
    with its prefill call every `admit_every` steps."""
    from ..generation.sampling import Sampling

    rng = np.random.default_rng(seed)
    table = rng.integers(1, 1 << 20, (slots, table_width), dtype=np.int32)
    lengths = rng.integers(1, table_width * page_size // 2, slots)
    settings = [Sampling(temperature=0.6, top_p=0.95, seed=1)]
    out = []
    for step in range(steps):
        lengths += 1
        grew = np.flatnonzero(lengths % page_size == 0)
        table[grew, np.minimum(lengths[grew] // page_size, table_width - 1)] = rng.integers(1, 1 << 20, grew.size)
        calls, admissions = [lane_rows((), slots, 1, slots)], ()
        if step % admit_every == 0:
            slot = step % slots
            admissions = (Admission(slot, host_sampling(settings), rng.integers(0, 1 << 17, prompt_len, dtype=np.int32),
                                    host_rules(settings)),)
            calls.insert(0, lane_rows((), 2, 512, slots))
        out.append(StepWork(admissions=admissions, calls=tuple(calls), page_table=table.copy()))
    return out


def _follow(process_id: int, processes: int, offers: Any, results: Any) -> None:
    channel = HostChannel(process_id, processes, rendezvous=lambda _: offers.get(timeout=60), timeout=60)
    arrivals = []
    while channel.receive() is not None:
        arrivals.append(time.monotonic())
    channel.close()
    results.put((process_id, arrivals))


def bench_control(processes: int, steps: list[StepWork], interval: float) -> dict[str, float]:
    """One point: process 0 here, `processes - 1` followers as child processes; a step sent every
    `interval` seconds (the device's step time), so the latency is one step's, not a queue's."""
    ctx = multiprocessing.get_context("spawn")
    offers, results = ctx.Queue(), ctx.Queue()
    children = [ctx.Process(target=_follow, args=(p, processes, offers, results)) for p in range(1, processes)]
    for child in children:
        child.start()

    def rendezvous(data: bytes | None) -> bytes:
        for _ in range(processes - 1):
            offers.put(data)
        return data

    channel = HostChannel(0, processes, rendezvous=rendezvous, timeout=60)
    sent, sending = [], 0.0
    for work in steps:
        start = time.monotonic()
        channel.send(work)
        sent.append(start)
        sending += time.monotonic() - start
        time.sleep(max(interval - (time.monotonic() - start), 0))
    channel.send(None)
    channel.close()
    arrivals = [results.get(timeout=120)[1] for _ in children]
    for child in children:
        child.join(60)
    # A follower's step arrives (read and decoded) this long after process 0 began sending it.
    latency = np.array([np.array(a) - np.array(sent) for a in arrivals]) if arrivals else np.zeros((1, 1))
    full = sum(encode_work(w).size for w in steps) / len(steps)
    return {"processes": processes, "send_us": 1e6 * sending / len(steps),
            "latency_us": 1e6 * float(np.median(latency)), "latency_p99_us": 1e6 * float(np.quantile(latency, 0.99)),
            "bytes_per_step": channel.bytes_sent / len(steps), "full_table_bytes_per_step": full}


def add_control_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=positive_ints, default=[2, 4, 16],
                   help="comma-separated process counts, process 0 included (default: 2,4,16)")
    p.add_argument("--slots", type=positive_int, default=66, help="batch slots (default: 66)")
    p.add_argument("--max-seq-len", type=positive_int, default=163840,
                   help="tokens per slot, the page table's width x --page-size (default: 163840)")
    p.add_argument("--page-size", type=positive_int, default=16, help="(default: 16)")
    p.add_argument("--prompt-len", type=positive_int, default=4096, help="tokens of each admitted prompt "
                   "(default: 4096)")
    p.add_argument("--admit-every", type=positive_int, default=8, help="steps between admissions (default: 8)")
    p.add_argument("--steps", type=positive_int, default=200, help="steps timed per point (default: 200)")
    p.add_argument("--interval-ms", type=float, default=5.0, help="time between steps, the device's step time "
                   "(default: 5)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def run_control(args: argparse.Namespace) -> dict:
    width = -(-args.max_seq_len // args.page_size)
    steps = synthetic_steps(args.slots, width, args.page_size, args.steps, args.prompt_len, args.admit_every)
    rows = [bench_control(n, steps, args.interval_ms / 1e3) for n in args.processes]
    print(f"control plane: {args.slots} slots x {width} pages, an admission of {args.prompt_len} tokens every "
          f"{args.admit_every} steps, a step every {args.interval_ms:g} ms, {args.steps} steps")
    print(markdown_table(CONTROL_COLUMNS, [[f"{row[c]:,.0f}" for c in CONTROL_COLUMNS] for row in rows]))
    return {"rows": rows, "slots": args.slots, "table_width": width, "steps": args.steps}
