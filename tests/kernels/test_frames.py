"""kernels/frames.py against tests/kernels/reference.py: planned writes (continuing and
restarting stacks, inconsistent ones), appended frames with ring wrap-around, rebuilt
stacks (streamed and plain copies), planned loads."""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay.kernels import frames as kern
from tests.kernels import reference as ref

FIRST, MID, LAST = 0, 1, 2


def _episode_chunk(rng, streams, t_len, k, fb, pool):
    """Steps of ``streams`` rows whose stacks are consistent within each episode."""
    types = rng.choice([MID, MID, MID, LAST, FIRST], (streams, t_len)).astype(np.uint8)
    values = np.empty((streams, t_len, k, fb), np.uint8)
    for i in range(streams):
        stack = pool[rng.integers(0, len(pool), k)]
        for t in range(t_len):
            if t and types[i, t] != FIRST and types[i, t - 1] != LAST:
                stack = np.concatenate([stack[1:], pool[rng.integers(0, len(pool), 1)]])
            else:
                stack = pool[rng.integers(0, len(pool), k)]
            values[i, t] = stack
    return values, types


@pytest.mark.parametrize(("k", "fb", "cap"), [(1, 16, 3), (2, 5, 4), (4, 32, 6), (3, 48, 2)])
def test_writes_and_stacks_match_the_reference(k: int, fb: int, cap: int) -> None:
    rng = np.random.default_rng(k * 100 + fb + cap)
    streams, cap_frames = 3, cap * k + k  # the most frames a row can need
    pool = rng.integers(0, 3, (6, fb)).astype(np.uint8)  # few distinct frames: repeats happen
    fast = {"frames": np.zeros((streams, cap_frames, fb), np.uint8),
            "ref": np.zeros(streams * cap, np.int64), "fpos": np.zeros(streams, np.int64)}
    slow = {name: arr.copy() for name, arr in fast.items()}
    pos = np.zeros(streams, np.int64)
    step_type = np.zeros(streams * cap, np.uint8)
    rejected = 0
    for _ in range(80):
        t_len = int(rng.integers(1, cap + 1))
        rows = rng.permutation(streams)[:int(rng.integers(1, streams + 1))].astype(np.int64)
        values, types = _episode_chunk(rng, rows.shape[0], t_len, k, fb, pool)
        if rng.random() < 0.1 and k > 1:  # break one continuing step's stack
            i, t = int(rng.integers(0, rows.shape[0])), int(rng.integers(0, t_len))
            values[i, t, 0] ^= 0xFF
        counts = np.empty((rows.shape[0], t_len), np.int64)
        status, i, t, need = kern.plan_write(values, types, rows, pos, step_type, fast["ref"],
                                              fast["frames"], fast["fpos"], cap, counts)
        want = ref.new_counts(values, types, rows, pos, step_type, slow["ref"], slow["frames"], cap)
        if isinstance(want, tuple):
            assert (status, i, t) == (kern.INCONSISTENT, *want)
            rejected += 1
            continue
        assert status == kern.OK and need <= cap_frames
        np.testing.assert_array_equal(counts, want)
        written = np.array([r * cap + (pos[r] + s) % cap for r in rows for s in range(t_len)], np.int64)
        kern.append_frames(values, rows, written, counts, fast["frames"], fast["ref"], fast["fpos"])
        ref.append_frames(values, rows, written, counts, slow["frames"], slow["ref"], slow["fpos"])
        for name in fast:
            np.testing.assert_array_equal(fast[name], slow[name])
        step_type[written] = types.reshape(-1)
        pos[rows] += t_len
        # Every stored step's stack comes back as written, streamed (aligned) or not.
        stored = np.concatenate([r * cap + np.arange(min(pos[r], cap)) for r in range(streams)])
        idx = rng.choice(stored, (5, 2)).astype(np.int64)
        for offset in (0, 16, 3):
            got = np.zeros((7, offset + 2 * k * fb + 16), np.uint8)
            expected = got.copy()
            dst_rows = rng.permutation(7)[:5]
            kern.gather_stacks_rows(idx, cap, fast["ref"], fast["frames"], k, dst_rows, got, offset)
            ref.gather_stacks_rows(idx, cap, slow["ref"], slow["frames"], k, dst_rows, expected, offset)
            np.testing.assert_array_equal(got, expected)
    assert (fast["fpos"] > cap_frames).any()  # the frame rings wrapped
    assert rejected > 0 or k == 1


def test_plan_load_counts_continuing_stacks() -> None:
    rng = np.random.default_rng(3)
    k, fb = 3, 8
    pool = rng.integers(0, 2, (4, fb)).astype(np.uint8)
    frames = np.zeros((1, 32, fb), np.uint8)
    frames[0, 5:8] = pool[:3]
    ref_pos = np.array([7], np.int64)  # slot 0's stack ends at frame 7
    values, _types = _episode_chunk(rng, 1, 6, k, fb, pool)
    values = values[0]
    values[0] = np.concatenate([pool[1:3], pool[3:4]])  # continues the stored stack
    for prev_slot in (0, -1):
        counts = np.empty(6, np.int64)
        total = kern.plan_load(values, 0, frames, ref_pos, prev_slot, counts)
        want = [1 if j and np.array_equal(values[j, :k - 1], values[j - 1, 1:]) else k for j in range(6)]
        want[0] = 1 if prev_slot == 0 else k
        np.testing.assert_array_equal(counts, want)
        assert total == sum(want)
