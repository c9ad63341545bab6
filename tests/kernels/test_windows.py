"""kernels/windows.py (the one-call gather of ``StreamStorage.windows``) against its
reference: the windows' slots, mask and keys (tests/kernels/reference.py), a ``take`` of
whole records and a copy of each record part; and ``StreamStorage.windows`` (and its walk
alone, ``window_indices``) against that path for every kind of field.

Cost: ~1 s once numba's cache is warm (the first run compiles the kernel: ~5-10 s).
"""

from __future__ import annotations

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing
from shardreplay.kernels import windows as wk
from tests.kernels import reference as ref

LAST = 2
# Record parts of 1, 2, 3, 4, 8, 16, 20 and 32 bytes (every branch of the small copies),
# and the two columns the kernel reads.
RECORD = np.dtype([("a", np.uint8), ("b", np.int16), ("c", "V3"), ("d", np.float32), ("e", np.int64),
                   ("f", np.float32, (4,)), ("g", "V20"), ("h", np.float64, (4,)), ("step_type", np.uint8),
                   ("generation", np.uint32)])
PARTS = ("a", "b", "c", "d", "e", "f", "g", "h")


def _params(cap: int, window: int, n: int, epoch: int, tag: int) -> tuple[np.ndarray, int, list[int]]:
    """params of every part in RECORD, blocks packed one after another (any layout goes)."""
    words, blocks, total = [], [], 0
    for name in PARTS:
        size = RECORD.fields[name][0].itemsize
        words += [RECORD.fields[name][1], size, total]
        blocks.append(total)
        total += n * window * size + 3  # odd gaps: blocks need no alignment
    mask_at, keys_at = total, total + n * window + 5
    params = np.array([cap, window, epoch, tag, mask_at, keys_at, len(PARTS), *words], np.int64)
    return params, keys_at + 8 * n, blocks


@pytest.mark.parametrize(("streams", "cap", "window"), [(1, 1, 1), (1, 5, 2), (3, 7, 3), (2, 9, 4)])
def test_gather_windows_equals_indices_take_and_copies(streams: int, cap: int, window: int) -> None:
    rng = np.random.default_rng(streams * 100 + cap * 10 + window)
    n_slots = streams * cap
    records = np.frombuffer(rng.bytes(n_slots * RECORD.itemsize), RECORD).copy()
    records["step_type"] = rng.choice([0, 1, 1, LAST], n_slots)
    rows = records.view(np.uint8).reshape(n_slots, -1)
    for picked in (rng.integers(0, n_slots, 64), np.arange(n_slots), np.zeros(0, np.int64)):
        starts = picked.astype(np.int64)
        epoch, tag = int(rng.integers(0, 5000)), int(rng.integers(1, 16383))
        args = (starts, records["step_type"], records["generation"], cap, window, epoch, tag)
        idx, mask, keys = ref.window_indices(*args)
        n = starts.shape[0]
        params, total, blocks = _params(cap, window, n, epoch, tag)
        dst = np.full(total, 0xAB, np.uint8)
        got_idx = np.full(n * window, -1, np.int64)
        wk.gather_windows(starts, records["step_type"], records["generation"], rows, params, dst, got_idx)
        np.testing.assert_array_equal(got_idx.reshape(n, window), idx)
        mask_at, keys_at = int(params[wk.MASK_AT]), int(params[wk.KEYS_AT])
        got_mask = dst[mask_at:mask_at + n * window].view(np.bool_).reshape(n, window)
        np.testing.assert_array_equal(got_mask, mask)
        np.testing.assert_array_equal(dst[keys_at:keys_at + 8 * n].view(np.int64), keys)
        taken = records.take(idx, axis=0)
        for name, at in zip(PARTS, blocks, strict=True):
            size = RECORD.fields[name][0].itemsize
            want_bytes = np.ascontiguousarray(taken[name]).view(np.uint8).reshape(-1)
            np.testing.assert_array_equal(dst[at:at + n * window * size], want_bytes, err_msg=name)
            assert (dst[at + n * window * size:at + n * window * size + 3] == 0xAB).all()  # nothing past it


def test_the_row_of_a_slot_is_exact_for_any_ring() -> None:
    """The kernel finds a start's row with a float estimate, corrected: exact for slots of
    any size (a record ring is far smaller than 2**52)."""
    rng = np.random.default_rng(0)
    for cap in (1, 3, 7, 1000, 999_983, 3_000_000, 2**31 - 1):
        rows = np.concatenate([rng.integers(0, 2**40 // cap, 200), [0, 1, 2**40 // cap]])
        inside = rng.integers(0, cap, rows.size)
        slots = np.concatenate([rows * cap, rows * cap + cap - 1, rows * cap + inside])
        got = np.array([wk._row_base.py_func(int(s), cap, 1.0 / cap) for s in slots])
        np.testing.assert_array_equal(got, slots - slots % cap)


SPEC = sr.Spec({"obs": {"small": sr.Field((3,), np.float32), "wide": sr.Field((17,), np.float32)},
                "frames": sr.Field((2, 3, 2), np.uint8, frame_stack=True), "half": sr.Field((2,), np.float16),
                "none": sr.Field((0,), np.float32), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32)})


@pytest.mark.parametrize("window", [2, 3])
def test_storage_windows_equal_the_take_and_copy_path(window: int) -> None:
    """Record fields, a field of its own array, frame stacks, float16 and zero-byte
    fields: the arrays (their order, dtypes, shapes and bytes) of the path before."""
    buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=9, window=window, seed=1)
    rng = np.random.default_rng(window)
    frames = np.zeros((2, 2, 3, 2), np.uint8)
    for t in range(23):
        frames = np.concatenate([frames[:, 1:], rng.integers(0, 9, (2, 1, 3, 2), dtype=np.uint8)], axis=1)
        buf.add({"obs": {"small": rng.standard_normal((2, 3)).astype(np.float32),
                         "wide": rng.standard_normal((2, 17)).astype(np.float32)},
                 "frames": frames, "half": rng.standard_normal((2, 2)).astype(np.float16),
                 "none": np.zeros((2, 0), np.float32), "action": rng.integers(0, 5, 2),
                 "reward": rng.random(2).astype(np.float32),
                 "step_type": np.array([0 if t % 6 == 0 else (LAST if t % 6 == 5 else 1)] * 2, np.uint8)})
    storage = testing.shard(buf)._storage
    for starts in (np.flatnonzero(storage.valid), np.flatnonzero(storage.valid)[:0]):
        data, mask, keys = storage.windows(starts)
        idx, want_mask, want_keys = ref.window_indices(starts, storage.step_type, storage.generation,
                                                       storage.stream_capacity, window, storage.key_epoch,
                                                       storage.key_tag)
        for got, want in zip(storage.window_indices(starts), (idx, want_mask, want_keys), strict=True):
            np.testing.assert_array_equal(got, want)  # the walk alone (no record part)
        rec = storage.records.take(idx, axis=0)
        want = {name: arr.take(idx, axis=0) for name, arr in storage.fields.items()}
        want["frames"] = storage.stacked["frames"].gather(idx)
        want.update({name: rec[name].copy() for name in ("step_type", "discount", "episode_id")})
        assert list(data) == list(want)
        for name, arr in want.items():
            assert data[name].dtype == arr.dtype and data[name].shape == arr.shape, name
            assert data[name].flags.c_contiguous, name
            np.testing.assert_array_equal(data[name], arr, err_msg=name)
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_array_equal(keys, want_keys)
