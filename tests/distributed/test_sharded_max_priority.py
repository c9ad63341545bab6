"""New steps get the global max priority on every shard, as in one buffer (issue 14.1).

Real gloo ranks, fixed seeds. Every rank writes its items with no priority, the ranks
draw once and update what they drew with skewed priorities (the top one only on rank 0's
items), and every rank then writes new items with no priority. A single buffer that saw
the same writes and updates gives every new item the largest priority seen; so must the
sharded one, on every rank, with ``prefetch`` 1 (the update's own exchange spreads it) and
4 (the next exchange does). A chi-square test compares the sampled items with the single
buffer's P(i) over the union.
"""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing
from shardreplay.distributed import ShardedReplayBuffer
from tests.distributed.sharded_reference import chi_square_pvalue
from tests.support import run_ranks

pytestmark = pytest.mark.distributed

SPEC = sr.Spec({"obs": sr.Field((), np.float32)})
ALPHA, STREAMS, OLD, NEW, CALLS, BATCH = 0.7, 2, 40, 20, 40, 512
TOP = 50.0


def item(rank: int, stream: int, t: int) -> int:
    return rank * 10_000 + stream * 1_000 + t


def update_value(i: np.ndarray) -> np.ndarray:
    """Skewed: the top priority only for some of rank 0's items, small ones elsewhere."""
    return np.where((i < 10_000) & (i % 5 == 0), TOP, 0.25 + (i % 3)).astype(np.float32)


def _write(buf: sr.ReplayBuffer, rank: int, start: int, stop: int) -> None:
    for t in range(start, stop):
        ids = [item(rank, s, t) for s in range(STREAMS)]
        types = np.full(STREAMS, 0 if t == 0 else 1, np.uint8)
        buf.add({"obs": np.array(ids, np.float32), "step_type": types,
                 "discount": np.ones(STREAMS, np.float32)})


def _ranks(rank: int, world: int, prefetch: int) -> dict:
    local = sr.ReplayBuffer(SPEC, num_streams=STREAMS, stream_capacity=256, window=2, sampler="prioritized",
                            alpha=ALPHA, beta=0.0, seed=100 + rank)
    buf = ShardedReplayBuffer(local, seed=7 + rank, prefetch=prefetch)
    _write(local, rank, 0, OLD)
    batch = buf.sample(64)
    ids = batch.data["obs"][:, 0].numpy().astype(np.int64)
    updated = {int(i): float(update_value(np.array([i]))[0]) for i in ids}  # last one wins: equal values
    buf.update_priorities(batch.keys, update_value(ids))
    for _ in range(prefetch if prefetch > 1 else 0):  # the prefetched batches, then the next exchange
        buf.sample(64)
    buf.discard_prefetched()  # the rest were drawn before the new steps existed
    _write(local, rank, OLD, OLD + NEW)
    new_prios = testing.stored(local, "priority").reshape(STREAMS, -1)[:, OLD:OLD + NEW]
    drawn = [buf.sample(BATCH).data["obs"][:, 0].numpy().astype(np.int64) for _ in range(CALLS)]
    return {"updated": updated, "new_prios": new_prios.copy(), "drawn": np.concatenate(drawn)}


def _reference(world: int, updated: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Support and P(i) of one buffer holding every rank's items with these updates: a valid
    start is every step but each stream's newest (window 2); new items take the maximum."""
    top = max([1.0, *updated.values()])
    support, prio = [], []
    for rank in range(world):
        for s in range(STREAMS):
            for t in range(OLD + NEW - 1):
                i = item(rank, s, t)
                support.append(i)
                prio.append(updated.get(i, 1.0) if t < OLD else top)
    support, prio = np.array(support), np.array(prio)
    order = np.argsort(support)
    p = prio[order] ** ALPHA
    return support[order], p / p.sum()


@pytest.mark.parametrize(("world", "prefetch"), [(2, 1), (2, 4), (4, 1)])
def test_new_steps_get_the_global_max_priority_on_every_rank(world, prefetch):
    results = run_ranks(_ranks, world, prefetch)
    updated: dict[int, float] = {}
    for r in results:
        updated.update(r["updated"])
    top = max(updated.values())
    assert top == TOP, "the draw reached the skewed items (fixed seeds)"
    for rank, r in enumerate(results):
        assert np.all(r["new_prios"] == top), f"rank {rank}: new steps got {np.unique(r['new_prios'])}"
    support, prob = _reference(world, updated)
    drawn = np.concatenate([r["drawn"] for r in results])
    assert chi_square_pvalue(drawn, support, prob) > 1e-3
