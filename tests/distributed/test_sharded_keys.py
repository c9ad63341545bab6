"""A sharded buffer refuses keys that are not its own on the rank that passes them.

Keys travel between ranks (routed to their owner by the shard bits), so the check is
made where they are passed: every rank learns every shard's key tag at each exchange.
On 2 real gloo ranks: ``torch.arange``, keys of another sharded buffer with the same
content, and a uniform sharded buffer's update are refused on every rank, nothing lands
on any shard, and the ranks stay in step; the buffer's own keys, routed across ranks,
are applied, and keys gone stale are counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardreplay as sr
from shardreplay import testing
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import ConfigError, InvalidKeyError
from shardreplay.spec.keys import key_shard
from tests.support import run_ranks

pytestmark = pytest.mark.distributed

SPEC = sr.Spec({"obs": sr.Field((2,), np.float32)})
STREAMS, CAPACITY, BATCH = 3, 40, 16


def _local(rank: int, sampler: str = "prioritized") -> sr.ReplayBuffer:
    local = sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=2,
                            sampler=sampler, seed=rank)
    for t in range(30):
        local.add({"obs": np.full((STREAMS, 2), 100 * rank + t, np.float32),
                   "step_type": np.full(STREAMS, 0 if t == 0 else 1)})
    return local


def _error_of(buf: ShardedReplayBuffer, keys: object) -> str | None:
    try:
        buf.update_priorities(keys, np.full(BATCH, 7.0, np.float32))
    except (InvalidKeyError, ConfigError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _cases(rank: int, world: int) -> dict:
    buf = ShardedReplayBuffer(_local(rank), timeout_s=60)
    twin = ShardedReplayBuffer(_local(rank), timeout_s=60)  # the same content, other key tags
    twin_keys = twin.sample(BATCH).keys
    own = buf.sample(BATCH).keys
    before = testing.stored(buf.local, "priority").copy()
    out = {"arange": _error_of(buf, torch.arange(BATCH)), "twin": _error_of(buf, twin_keys)}
    out["unchanged"] = bool((testing.stored(buf.local, "priority") == before).all())
    out["owners"] = sorted(set(key_shard(own.numpy()).tolist()))
    out["applied"] = buf.update_priorities(own, np.full(BATCH, 5.0, np.float32))
    out["landed"] = int((testing.stored(buf.local, "priority") == 5.0).sum())
    # Overwrite every slot of this shard: the same keys are stale at their owners.
    for _ in range(CAPACITY):
        buf.local.add({"obs": np.zeros((STREAMS, 2), np.float32), "step_type": np.ones(STREAMS, np.int64)})
    stale = buf.local.info().stale_updates
    out["stale_applied"] = buf.update_priorities(own, np.full(BATCH, 9.0, np.float32))
    out["stale_counted"] = buf.local.info().stale_updates - stale
    uniform = ShardedReplayBuffer(_local(rank, "uniform"), timeout_s=60)
    uniform_local = ShardedReplayBuffer(uniform.local, timeout_s=60, mode="local")
    out["uniform"] = _error_of(uniform, uniform.sample(BATCH).keys)
    out["in_step"] = len(buf.sample(BATCH)) + len(uniform_local.sample(BATCH))
    return out


def test_foreign_keys_are_refused_on_every_rank_and_own_keys_routed() -> None:
    results = run_ranks(_cases, 2)
    for rank, r in enumerate(results):
        assert r["arange"] and r["arange"].startswith("InvalidKeyError: keys must come from this "
                                                      "sharded buffer's sample()"), (rank, r["arange"])
        assert r["twin"] and r["twin"].startswith("InvalidKeyError"), (rank, r["twin"])
        assert r["unchanged"], f"rank {rank}: a refused key changed a priority"
        assert r["owners"] == [0, 1]  # each rank's batch holds keys of both shards
        assert r["uniform"] and r["uniform"].startswith("ConfigError: update_priorities needs a "
                                                        "prioritized buffer"), (rank, r["uniform"])
        assert r["in_step"] == 2 * BATCH
    assert sum(r["applied"] for r in results) == 2 * BATCH
    assert 0 < sum(r["landed"] for r in results) <= 2 * BATCH  # repeated draws share a slot
    assert sum(r["stale_applied"] for r in results) == 0
    assert sum(r["stale_counted"] for r in results) == 2 * BATCH
