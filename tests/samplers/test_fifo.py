"""FIFO sampling: each window once, in the order it became valid; overwritten ones skipped."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardreplay import EmptyBufferError, ReplayBuffer, testing
from tests.support.programs import Program, apply_write, make_buffer, programs
from tests.support.reference import FIRST, MID, SPEC, RefBuffer, check_batch


@pytest.mark.slow  # fresh interpreters or many examples: 20-100 s at load ~9 on 2 cores
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs(max_writes=12), sizes=st.lists(st.integers(0, 6), min_size=12, max_size=12))
def test_fifo_matches_reference_queue(prog: Program, sizes: list[int]) -> None:
    buf = make_buffer(prog, sampler="fifo", seed=0)
    ref = RefBuffer(prog.num_streams, prog.capacity, prog.window, tag=buf.info().key_tag)
    episodes: dict[int, int] = {}
    for op, size in zip(prog.writes, sizes, strict=False):
        apply_write(buf, ref, op)
        waiting = len(ref.fifo_waiting())
        assert len(buf) == waiting
        if size == 0:  # let windows pile up (and some get overwritten before they drain)
            continue
        if waiting == 0:
            with pytest.raises(EmptyBufferError):
                buf.sample(size)
            continue
        batch = buf.sample(size)
        expected = ref.fifo_pop(size)
        assert batch.keys.tolist() == [ref.key(r, q) for r, q in expected]
        assert check_batch(ref, batch, episodes) == expected
        np.testing.assert_allclose(batch.probabilities.numpy(), 1.0 / waiting)
        assert (batch.weights.numpy() == 1.0).all()
        assert len(buf) == waiting - len(expected)


def test_fifo_hand_written() -> None:
    buf = ReplayBuffer(SPEC, num_streams=2, stream_capacity=3, window=2, sampler="fifo")

    def write(rows: list[int], types: list[int]) -> None:
        n = len(rows)
        buf.add({"obs": np.zeros((n, 2)), "act": np.array(rows) * 100 + testing.positions(buf)[rows],
                 "step_type": np.array(types)}, stream_ids=rows)

    write([0, 1], [FIRST, FIRST])
    write([1, 0], [MID, MID])  # both windows at position 0 complete: row 1 first (write order)
    assert len(buf) == 2
    write([0], [MID])  # row 0 start 1 completes
    assert [int(a) for a in buf.sample(5).data["act"][:, 0]] == [100, 0, 1]
    assert len(buf) == 0
    with pytest.raises(EmptyBufferError):
        buf.sample(1)
    # Two windows wait on row 0; then the ring overwrites the older one before it drains.
    write([0], [MID])  # pos 3 -> start 2 valid
    write([0], [MID])  # pos 4 -> start 3 valid
    assert len(buf) == 2
    write([0], [MID])  # pos 5 overwrites slot of pos 2: start 2 gone, start 4 valid
    batch = buf.sample(5)
    assert [int(a) for a in batch.data["act"][:, 0]] == [3, 4]
    assert batch.probabilities.tolist() == [0.5, 0.5]
