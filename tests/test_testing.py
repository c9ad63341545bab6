"""shardreplay.testing: what it reads matches what was written, and it hands out copies."""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing

SPEC = sr.Spec({"obs": sr.Field((2,), np.float32)})


def _buffer(sampler: str = "prioritized") -> sr.ReplayBuffer:
    buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=4, window=2, sampler=sampler, seed=0)
    for t in range(5):  # row 0 wraps: positions 5 and 5
        buf.add({"obs": np.full((2, 2), t, np.float32), "step_type": np.full(2, 1, np.uint8)},
                priorities=np.array([1.0 + t, 2.0], np.float32))
    return buf


def test_reads_match_writes_and_are_copies() -> None:
    buf = _buffer()
    assert testing.positions(buf).tolist() == [5, 5]
    obs = testing.stored(buf, "obs")
    assert obs.shape == (8, 2) and obs[0].tolist() == [4.0, 4.0]  # step 4 overwrote slot 0
    assert testing.stored(buf, "priority")[0] == 5.0
    assert testing.valid(buf).sum() == len(buf) == buf.info().samplable
    steps = testing.stored_steps(buf)
    assert steps["row_length"].tolist() == [4, 4] and steps["field.obs"][:4, 0].tolist() == [1, 2, 3, 4]
    obs[:] = -1
    testing.valid(buf)[:] = False
    assert testing.stored(buf, "obs")[0, 0] == 4.0 and testing.valid(buf).any()
    counters = testing.sampler_counters(buf)
    assert counters["max_priority"] == 5.0 and counters["draws"] == 0 and counters["samplable"] == len(buf)
    buf.sample(4)
    assert testing.sampler_counters(buf)["draws"] == 1
    sums, mins = testing.tree_sums(buf)
    assert sums.size and mins.size and testing.tree_sums(_buffer("uniform")) is None
    starts = np.flatnonzero(testing.valid(buf))
    assert (testing.leaf_masses(buf, starts) > 0).all() and testing.leaf_masses(buf, np.array([0]))[0] == 0


def test_rejects_other_objects_and_unknown_arrays() -> None:
    with pytest.raises(TypeError, match="ReplayBuffer"):
        testing.valid(object())
    with pytest.raises(KeyError, match="no stored array"):
        testing.stored(_buffer(), "nope")
