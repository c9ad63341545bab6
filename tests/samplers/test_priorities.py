"""Priority updates: stale keys, repeated keys, new-start priorities (docs/semantics.md rules 3-4)."""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay import ConfigError, ReplayBuffer, testing
from tests.support.buffers import assert_same, flat_slots, snapshot
from tests.support.reference import FIRST, MID, SPEC


def _write(buf: ReplayBuffer, types: list[int], priorities: list[float] | None = None) -> None:
    n = len(types)
    buf.extend({"obs": np.zeros((1, n, 2), np.float32), "act": np.zeros((1, n), np.int64),
                "step_type": np.array([types])},
               priorities=None if priorities is None else np.array([priorities]))


def _one_stream(**kwargs) -> ReplayBuffer:
    return ReplayBuffer(SPEC, num_streams=1, stream_capacity=4, window=2, sampler="prioritized",
                        alpha=1.0, seed=0, **kwargs)


def _keys_by_slot(buf: ReplayBuffer) -> dict[int, int]:
    batch = buf.sample(400)
    return dict(zip(flat_slots(buf, batch.keys.numpy()).tolist(), batch.keys.tolist(), strict=False))


def test_stale_keys_are_ignored_and_counted_others_applied() -> None:
    buf = _one_stream()
    _write(buf, [FIRST, MID, MID, MID])  # positions 0..3, starts 0, 1, 2 valid
    keys = _keys_by_slot(buf)
    assert sorted(keys) == [0, 1, 2]
    _write(buf, [MID])  # position 4 overwrites slot 0: key of slot 0 is stale
    old = [keys[0], keys[1], keys[2]]
    applied = buf.update_priorities(old, [9.0, 2.0, 3.0])
    assert applied == 2
    assert buf.info().stale_updates == 1
    pr = testing.stored(buf, "priority")
    assert pr[1] == 2.0 and pr[2] == 3.0
    assert pr[0] == 1.0, "the stale update reached the slot's new occupant"
    # The stale 9.0 did not raise the running maximum either: a new step gets 3.0.
    _write(buf, [MID])
    assert testing.stored(buf, "priority")[1] == 3.0
    # Stale counts accumulate; a fresh key of the reused slot works.
    assert buf.update_priorities([keys[0]], [5.0]) == 0 and buf.info().stale_updates == 2
    fresh = _keys_by_slot(buf)
    assert fresh[3] != keys.get(3) and buf.update_priorities([fresh[3]], [5.0]) == 1


def test_stale_after_many_wraps_and_empty_update() -> None:
    buf = _one_stream()
    _write(buf, [FIRST, MID, MID, MID])
    keys = _keys_by_slot(buf)
    for _ in range(3):
        _write(buf, [MID, MID, MID, MID])  # every slot rewritten three more times
    assert buf.update_priorities(list(keys.values()), [1.0] * len(keys)) == 0
    assert buf.info().stale_updates == len(keys)
    assert buf.update_priorities(np.zeros(0, np.int64), np.zeros(0)) == 0


def test_repeated_key_takes_its_last_priority() -> None:
    buf = _one_stream()
    _write(buf, [FIRST, MID, MID, MID])
    k = _keys_by_slot(buf)[1]
    assert buf.update_priorities([k, k, k], [4.0, 0.5, 2.5]) == 3
    assert testing.stored(buf, "priority")[1] == 2.5


def test_new_starts_get_the_largest_priority_seen_or_the_writers() -> None:
    buf = _one_stream()
    _write(buf, [FIRST, MID])
    assert testing.stored(buf, "priority")[0] == 1.0  # nothing seen yet: 1
    k = _keys_by_slot(buf)[0]
    buf.update_priorities([k], [6.0])
    _write(buf, [MID])
    assert testing.stored(buf, "priority")[2] == 6.0
    _write(buf, [MID], priorities=[0.5])  # Ape-X style: the writer decides
    assert testing.stored(buf, "priority")[3] == 0.5
    _write(buf, [MID], priorities=[8.0])  # and raises the maximum
    _write(buf, [MID])
    assert testing.stored(buf, "priority")[1] == 8.0  # position 5 -> slot 1


@pytest.mark.parametrize("sampler", ["uniform", "fifo"])
def test_priority_updates_on_a_buffer_that_ignores_them_are_refused(sampler: str) -> None:
    buf = ReplayBuffer(SPEC, num_streams=1, stream_capacity=4, window=2, sampler=sampler, seed=0)
    _write(buf, [FIRST, MID, MID])
    batch = buf.sample(2)
    before = snapshot(buf)
    with pytest.raises(ConfigError, match=f"sampler is '{sampler}'.*sampler=\"prioritized\""):
        buf.update_priorities(batch.keys, np.full(len(batch), 3.0))
    assert_same(before, snapshot(buf))
