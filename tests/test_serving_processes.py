"""The serving engine across JAX processes: 2 processes x 2 devices (jax.distributed over gloo,
process 0 deciding, process 1 following) give the same outputs as 1 process, with prefix hits and
pages offloaded to host memory and reloaded on both; and the wire format of a step's work."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import dsr1
from dsr1.generation.sampling import Sampling
from dsr1.serving import Engine
from dsr1.serving.broadcast import decode_work, encode_work, payload_bucket
from dsr1.serving.page_pool import PageOp
from dsr1.serving.scheduler import lane_rows
from dsr1.serving.step import StepRows
from dsr1.serving.work import Admission, StepWork, host_rules, host_sampling

from . import serving_worker
from .harness import free_port, start_processes, wait_processes


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


@pytest.mark.slow
def test_two_processes_two_devices_each_serve_like_one(tmp_path):
    out, port = tmp_path / "two.json", free_port()
    common = ["--out", str(out), "--expert=2", "--tensor=2", "--num-processes=2", f"--port={port}"]
    procs = start_processes("tests.serving_worker", common)
    try:
        # The reference, in this process (1 device) while the two processes run.
        model = dsr1.init_random(dsr1.Config.preset("tiny"), seed=0, dtype="float32")
        engine = Engine(model, **serving_worker.SHAPES)
        engine.warm_up()
        one = serving_worker.serve(engine)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    wait_processes(procs)
    leader, follower = (json.loads((tmp_path / f"two.json.{i}").read_text()) for i in range(2))
    print(f"\n[serving] 1 process: {one}\n[serving] 2 processes, process 0: {leader}; process 1: {follower}")
    assert (leader["processes"], leader["devices"]) == (2, 4)
    assert leader["tokens"] == one["tokens"], "2 processes x 2 devices serve the same tokens as 1 process"
    assert one["cached"][-2:] == [12, 12] and one["offloaded"] > 0 and one["reloaded"] > 0
    for key in ("cached", "prefix_hit_tokens", "offloaded", "reloaded", "host_pages"):
        assert leader[key] == one[key], key
    assert follower["host_copies"] == leader["host_copies"] == leader["host_pages"] > 0, \
        "the follower keeps its own host copies of exactly the pages process 0's cache offloaded"
