"""Sequence windows over 2 real gloo ranks: the exact draw is the single-buffer one over
every rank's sequence starts, with priorities set through ``update_priorities`` (chi-square,
fixed seeds). One launch of two ranks (spawn and imports dominate)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import shardreplay as sr
from shardreplay.distributed import ShardedReplayBuffer
from tests.support import run_ranks
from tests.support.sequences import SPEC, reference_starts, timelines, write

pytestmark = [pytest.mark.distributed]

ALPHA, WINDOW, PERIOD, CAP, STEPS = 0.7, 8, 4, 40, 60


def _priority(ident: int, t: int) -> float:
    """A priority of its own for each start (a stand-in for the learner's)."""
    return 0.1 + ((ident * 7919 + t * 104729) % 97) / 30.0


def _rank(rank: int, world: int) -> dict:
    local = sr.ReplayBuffer(SPEC, num_streams=2 + rank, stream_capacity=CAP, window=WINDOW, period=PERIOD,
                            sampler="prioritized", alpha=ALPHA, seed=rank)
    rng = np.random.default_rng(100 + rank)
    lines = timelines(rng, 2 + rank, STEPS)
    write(local, lines, rng, id_base=10 * rank)
    buf = ShardedReplayBuffer(local, seed=7)
    for _ in range(15):  # every start gets its priority (about 30 starts, 7,680 draws)
        batch = buf.sample(256)
        obs = batch.data["obs"].numpy()[:, 0]
        buf.update_priorities(batch.keys, np.array([_priority(i, t) for i, t in obs], np.float32))
    drawn: dict[tuple[int, int], int] = {}
    for _ in range(20):
        seq = sr.sample_sequences(buf, 1024, burn_in=2, state=("h",))  # the learner's call, sharded
        first = seq.batch.data["obs"].numpy()[:, 0]
        assert np.array_equal(seq.start_state["h"].numpy(), seq.batch.data["h"].numpy()[:, 0])
        assert not seq.learn_mask[:, :2].any()
        for i, t in first.tolist():
            drawn[(i, t)] = drawn.get((i, t), 0) + 1
    starts = reference_starts(lines, CAP, WINDOW, PERIOD, id_base=10 * rank)
    return {"starts": sorted(starts), "drawn": drawn, "len": len(buf)}


@pytest.mark.slow  # two spawned ranks: 20-80 s on a loaded machine
def test_sharded_sequences_draw_the_single_buffer_distribution() -> None:
    results = run_ranks(_rank, 2)
    starts = results[0]["starts"] + results[1]["starts"]
    assert results[0]["len"] == results[1]["len"] == len(starts)
    counts = np.zeros(len(starts))
    index = {tuple(s): k for k, s in enumerate(starts)}
    for r in results:
        for start, n in r["drawn"].items():
            counts[index[start]] += n  # a KeyError: a start off the grid was drawn
    p = np.array([_priority(i, t) for i, t in starts], np.float32).astype(np.float64) ** ALPHA
    assert stats.chisquare(counts, counts.sum() * p / p.sum()).pvalue > 1e-3
