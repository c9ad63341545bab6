"""ShardedReplayBuffer on real gloo ranks: global sizes, no overwrites, routing, modes."""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.spec.keys import key_shard
from tests.support import run_ranks

pytestmark = pytest.mark.distributed

SPEC = sr.Spec({"obs": sr.Field((3,), np.float32), "rank": sr.Field((), np.int64)})


def _fill(buf: sr.ReplayBuffer, rank: int, steps: int, streams: int) -> None:
    for t in range(steps // streams):
        st = np.full(streams, sr.StepType.MID, np.uint8)
        if t == 0:
            st[:] = sr.StepType.FIRST
        buf.add({"obs": np.full((streams, 3), t, np.float32),
                 "rank": np.full(streams, rank), "step_type": st})


def _sizes_and_sampling(rank: int, world: int) -> dict:
    local = sr.ReplayBuffer(SPEC, num_streams=5, stream_capacity=500, window=2,
                            sampler="prioritized", seed=rank)
    _fill(local, rank, 2500, 5)
    buf = ShardedReplayBuffer(local, timeout_s=30)
    steps_len = buf.global_sizes()
    exact = buf.sample(64)
    owners = key_shard(exact.keys.numpy())
    # Each sampled window's data must come from its owner's shard.
    data_ok = bool((exact.data["rank"][:, 0].numpy() == owners).all())
    applied = buf.update_priorities(exact.keys, np.full(64, 2.0, np.float32))
    local_batch = ShardedReplayBuffer(local, timeout_s=30, mode="local").sample(32)
    # With 1-step windows every stored step is a window: len() is the global step count.
    single = sr.ReplayBuffer(SPEC, num_streams=5, stream_capacity=500, window=1, seed=rank)
    _fill(single, rank, 2500, 5)
    single_len = len(ShardedReplayBuffer(single, timeout_s=30))
    return {"sizes": steps_len, "data_ok": data_ok, "applied": applied, "single_len": single_len,
            "local_owner": key_shard(local_batch.keys.numpy()).tolist(),
            "shape": tuple(exact.data["obs"].shape)}


def test_four_ranks_hold_ten_thousand_steps_without_overwrites() -> None:
    results = run_ranks(_sizes_and_sampling, 4)
    for r in results:
        length, steps, capacity = r["sizes"]
        assert steps == 10_000
        assert capacity == 10_000
        assert length == 4 * 5 * 499  # one incomplete window at the end of each stream
        assert r["single_len"] == 10_000
        assert r["data_ok"]
        assert r["shape"] == (64, 2, 3)
    assert sum(r["applied"] for r in results) == 4 * 64
    for rank, r in enumerate(results):
        assert set(r["local_owner"]) == {rank}
