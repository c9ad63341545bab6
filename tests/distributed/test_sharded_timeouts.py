"""No hangs: a rank that never joins a collective gives the others a CollectiveTimeout.

Three real gloo ranks: rank 0 holds data, rank 1 has an EMPTY shard (it must still
issue the collective), rank 2 never calls ``sample`` (it sleeps past the timeout, then
exits). Ranks 0 and 1 must raise ``CollectiveTimeout`` after about ``timeout_s``, with a
message naming the operation and the rank; the harness joins or kills every process.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import psutil
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import CollectiveTimeout
from tests.support import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 3.0
ABSENT = 2
SPEC = sr.Spec({"obs": sr.Field((2,), np.float32)})


def _one_rank_missing(rank: int, world: int, mode: str) -> dict:
    local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=32, window=2, sampler="prioritized",
                            seed=rank)
    if rank == 0:
        for t in range(10):
            local.add({"obs": np.full((2, 2), t, np.float32),
                       "step_type": np.full(2, sr.StepType.FIRST if t == 0 else sr.StepType.MID, np.uint8)})
    # The first sample waits for the slowest rank's start-up (imports, compiled kernels):
    # seconds on a loaded machine, so it runs with a generous limit; then the short one.
    buf = ShardedReplayBuffer(local, timeout_s=120, mode=mode)
    first = len(buf.sample(4))  # everyone present: works, also on the empty shard
    internals_of(buf).collectives.timeout_s = internals_of(buf).exchange_group.timeout_s = TIMEOUT_S
    if rank == ABSENT:
        time.sleep(TIMEOUT_S + 2.0)  # never joins the second sample, then exits
        return {"first": first, "pid": psutil.Process().pid}
    gc.freeze()  # a faster exit: the interpreter's final collections skip frozen objects
    start = time.monotonic()
    try:
        buf.sample(4)
    except CollectiveTimeout as exc:
        return {"first": first, "error": str(exc), "seconds": time.monotonic() - start,
                "pid": psutil.Process().pid}
    return {"first": first, "error": None, "pid": psutil.Process().pid}


def test_missing_rank_gives_collective_timeout_not_a_hang() -> None:
    # exact mode: its first collective is the one local mode issues too (the stats all_gather).
    results = run_ranks(_one_rank_missing, 3, "exact", timeout_s=120)
    assert all(r["first"] == 4 for r in results)
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] is not None, f"rank {rank} did not time out"
        assert "ShardedReplayBuffer.sample" in r["error"]
        assert f"rank {rank} of 3" in r["error"]
        assert f"{TIMEOUT_S:g} s" in r["error"]
        assert TIMEOUT_S - 0.5 <= r["seconds"] <= TIMEOUT_S + 3.0, r["seconds"]
    # Every rank's process is gone once run_ranks returns (joined, or killed by the harness).
    assert not any(psutil.pid_exists(r["pid"]) and psutil.Process(r["pid"]).status() != "zombie"
                   for r in results)


def _len_on_one_rank(rank: int, world: int) -> dict:
    local = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=32, window=2, seed=rank)
    buf = ShardedReplayBuffer(local, timeout_s=120)
    assert len(buf) == 0  # all ranks present: start-up done
    internals_of(buf).collectives.timeout_s = TIMEOUT_S
    if rank == 1:
        time.sleep(TIMEOUT_S + 2.0)  # never asks
        return {}
    try:
        len(buf)
    except CollectiveTimeout as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_len_on_one_rank_names_the_collective_and_the_remedy() -> None:
    rank0, _ = run_ranks(_len_on_one_rank, 2, timeout_s=120)
    assert rank0["error"] is not None
    assert "len()" in rank0["error"] and "every rank must call" in rank0["error"]
    assert "len(buffer.local)" in rank0["error"]
