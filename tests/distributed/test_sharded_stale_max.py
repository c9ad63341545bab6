"""A priority sent with a stale key does not raise the global max (issue 19.8).

Two real gloo ranks, strict (prefetch=1) and lazy (prefetch=2) in one spawn. Rank 0 holds
keys of rank 1's windows from a sample; rank 1 then overwrites every slot, so the keys
are stale. Rank 0 routes priority 100 with them: rank 1 counts them stale, and every
rank's max priority must stay 1.0 (new steps enter at 1.0), as in one ReplayBuffer given
the same writes and update. A priority routed with a current key still raises the max on
every rank (strict: when update_priorities returns; lazy: at the next exchange).
Costs one 2-rank spawn (~10 s on 2 cores).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.spec.keys import key_shard
from tests.support import run_ranks

# One spawn: ~10 s on an idle box, ~30 s on a loaded 2-core one.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SPEC = sr.Spec({"obs": sr.Field((), np.float32)})
STREAMS, CAPACITY, STALE, CURRENT, BATCH = 2, 8, 100.0, 7.0, 256


def _local(seed: int) -> sr.ReplayBuffer:
    return sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=CAPACITY, window=2,
                           sampler="prioritized", alpha=0.6, seed=seed)


def _write(buf: Any, start: int, steps: int) -> None:
    for t in range(start, start + steps):
        types = np.full(STREAMS, 0 if t == 0 else 1, np.uint8)
        buf.add({"obs": np.full(STREAMS, t, np.float32), "step_type": types,
                 "discount": np.ones(STREAMS, np.float32)})


def _scenario(rank: int, prefetch: int) -> dict[str, Any]:
    buf = ShardedReplayBuffer(_local(10 + rank), seed=rank, prefetch=prefetch, timeout_s=30)
    _write(buf, 0, CAPACITY)
    keys = buf.sample(BATCH).keys.numpy()
    buf.discard_prefetched()  # so that the next sample() is an exchange (prefetch 2)
    theirs = keys[key_shard(keys) == 1] if rank == 0 else keys[:0]
    _write(buf, CAPACITY, CAPACITY)  # every slot overwritten: rank 0's keys of rank 1 are stale
    buf.update_priorities(theirs, np.full(theirs.shape, STALE, np.float32))
    buf.sample(BATCH)  # lazy: the queued update travels with this exchange
    buf.discard_prefetched()
    out: dict[str, Any] = {"sent": int(theirs.size), "info": buf.info()}
    _write(buf, 2 * CAPACITY, 2)
    out["new"] = testing.stored(buf.local, "priority").reshape(STREAMS, CAPACITY)[:, :2].copy()
    # A current key of rank 1 does raise the max everywhere.
    keys = buf.sample(BATCH).keys.numpy()
    buf.discard_prefetched()
    mine = keys[key_shard(keys) == 1][:1] if rank == 0 else keys[:0]
    buf.update_priorities(mine, np.full(mine.shape, CURRENT, np.float32))
    out["current_at_once"] = buf.info().max_priority
    buf.sample(BATCH)
    out["current"] = buf.info().max_priority
    buf.close()
    return out


def _ranks(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {prefetch: _scenario(rank, prefetch) for prefetch in (1, 2)}


def _single_buffer_max() -> float:
    """What one ReplayBuffer does with the same writes and stale update."""
    buf = _local(0)
    _write(buf, 0, CAPACITY)
    keys = buf.sample(64).keys.numpy()
    _write(buf, CAPACITY, CAPACITY)
    buf.update_priorities(keys, np.full(keys.shape, STALE, np.float32))
    assert buf.info().stale_updates == keys.size
    return buf.info().max_priority


def test_a_stale_routed_priority_leaves_every_ranks_max_alone():
    single = _single_buffer_max()
    assert single == 1.0
    results = run_ranks(_ranks, 2, timeout_s=120)
    for prefetch in (1, 2):
        sent = results[0][prefetch]["sent"]
        assert sent > 0, "rank 0 drew keys of rank 1 (fixed seeds)"
        assert results[1][prefetch]["info"].stale_updates == sent
        for rank in (0, 1):
            r = results[rank][prefetch]
            assert r["info"].max_priority == single, f"prefetch {prefetch}, rank {rank}: {r['info']}"
            assert np.all(r["new"] == single), f"prefetch {prefetch}, rank {rank}: new steps got {r['new']}"
            assert r["current"] == CURRENT, f"prefetch {prefetch}, rank {rank}"
            if prefetch == 1:  # strict: spread before update_priorities returns
                assert r["current_at_once"] == CURRENT, f"rank {rank}"
