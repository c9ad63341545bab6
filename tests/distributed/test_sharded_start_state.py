"""``at_starts`` fields over 2 real gloo ranks: each window's start state comes from its
owner's start rows, bit for bit, in exact mode (records exchanged) and local mode
(docs/semantics.md, "Start-state fields"). One launch of two forked ranks."""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from tests.support import run_ranks
from tests.support.sequences import START_SPEC, state_of, timelines, write

pytestmark = [pytest.mark.distributed]


def _rank(rank: int, world: int) -> list[int]:
    seen = []
    for mode in ("exact", "local"):
        local = sr.ReplayBuffer(START_SPEC, num_streams=2 + rank, stream_capacity=24, window=8, period=4,
                                sampler="prioritized", seed=rank)
        rng = np.random.default_rng(100 + rank)
        write(local, timelines(rng, 2 + rank, 50), rng, id_base=10 * rank)
        buf = ShardedReplayBuffer(local, seed=7, mode=mode)
        for _ in range(3):
            seq = sr.sample_sequences(buf, 128, burn_in=2, state=("h",))
            obs = seq.batch.data["obs"].numpy()[:, 0]
            real = seq.batch.keys.numpy() >= 0  # local mode pads an empty shard's batch
            assert seq.batch.data["h"].shape == (128, 1, 3)
            np.testing.assert_array_equal(seq.start_state["h"].numpy()[real], state_of(obs[real]))
            seen += sorted({int(i) // 10 for i in obs[real, 0]})  # the owners drawn from
    return seen


@pytest.mark.slow  # two forked ranks: 10-40 s on a loaded machine (the fork server starts)
def test_sharded_start_state_is_the_owners_row() -> None:
    results = run_ranks(_rank, 2)
    assert {0, 1} <= set(results[0]) | set(results[1])  # windows of both shards were checked
