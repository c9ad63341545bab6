"""kernels/storage.py against its numpy twin (tests/kernels/reference.py): random writes
(empty, single row, wrap-around, every window length), byte scatters, and the gathers of
kernels/windows.gather_window_parts."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from shardreplay.kernels import storage as kern
from shardreplay.kernels import windows
from shardreplay.kernels.lazy import LazyKernels
from tests.kernels import reference as ref

FIRST, MID, LAST = 0, 1, 2
_BOOKKEEPING = ("step_type", "episode_id", "generation", "priority", "valid", "pos", "counters")


def _arrays(streams: int, cap: int) -> dict[str, np.ndarray]:
    n = streams * cap
    return {"step_type": np.zeros(n, np.uint8), "episode_id": np.zeros(n, np.int64),
            "generation": np.zeros(n, np.uint32), "priority": np.zeros(n, np.float32),
            "valid": np.zeros(n, bool), "pos": np.zeros(streams, np.int64), "counters": np.zeros(1, np.int64)}


def _copy(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state.items()}


def _random_write(rng: np.random.Generator, streams: int, cap: int,
                  step: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows (0: an empty write) and step types of a write; of steps of no length, and
    of types in int64, at some ``step``s."""
    n_rows = int(rng.integers(0, streams + 1))
    rows = rng.permutation(streams)[:n_rows].astype(np.int64)
    t_len = int(rng.integers(0 if step % 7 == 3 else 1, cap + 1))
    kinds = [[FIRST, MID, MID, MID, LAST], [MID], [LAST, FIRST], [MID, LAST]][step % 4]
    types = rng.choice(kinds, (n_rows, t_len)).astype([np.uint8, np.int64][step % 2])
    return rows, types


@pytest.mark.parametrize(("streams", "cap", "window"),
                         [(1, 1, 1), (1, 3, 2), (3, 5, 3), (4, 6, 4), (2, 8, 1), (5, 4, 4), (3, 9, 6),
                          (6, 2, 2), (2, 7, 7)])
def test_write_steps_matches_its_twin_and_the_definition(streams: int, cap: int, window: int) -> None:
    """The compiled write and its vectorised numpy twin change the same
    arrays alike and return the same results; validity is the module docstring's rule."""
    rng = np.random.default_rng(streams * 100 + cap * 10 + window)
    fast, twin = _arrays(streams, cap), _arrays(streams, cap)
    width = streams * (cap + window)
    outs = [(np.full((2, width), -7, np.int64), np.zeros((2, width), bool)) for _ in range(2)]
    for step in range(80):
        rows, types = _random_write(rng, streams, cap, step)
        has_prios = bool(step % 3)
        prios = rng.random(types.shape).astype([np.float32, np.float64][step % 2])
        default = float(rng.random())  # not a float32: both round it the same way
        was_valid = fast["valid"].copy()
        got = [run.write_steps(*(state[k] for k in _BOOKKEEPING), rows, types,
                               prios if has_prios else np.zeros((1, 1), np.float32), has_prios, default,
                               cap, window, *out)
               for run, state, out in ((kern, fast, outs[0]), (ref, twin, outs[1]))]
        assert got[0] == got[1], f"(n_out, delta) of write {step}"
        for name in fast:
            np.testing.assert_array_equal(twin[name], fast[name], err_msg=f"{name} after write {step}")
        n_out = got[0][0]
        written, recomputed = outs[0][0][0, :types.size], outs[0][0][1, :n_out]
        np.testing.assert_array_equal(outs[1][0][0, :types.size], written)
        np.testing.assert_array_equal(outs[1][0][1, :n_out], recomputed)
        np.testing.assert_array_equal(outs[1][1][:, :n_out], outs[0][1][:, :n_out])
        definition = ref.validity(fast["step_type"], fast["episode_id"], fast["pos"], cap, window)
        np.testing.assert_array_equal(fast["valid"], definition, err_msg=f"validity after write {step}")
        np.testing.assert_array_equal(outs[0][1][0, :n_out], definition[recomputed])
        # "became valid" is relative to before the write, except for slots just overwritten.
        became = definition[recomputed] & (np.isin(recomputed, written) | ~was_valid[recomputed])
        np.testing.assert_array_equal(outs[0][1][1, :n_out], became)
        # The full recompute after a load agrees too.
        valid = np.zeros_like(fast["valid"])
        count = kern.recompute_validity(fast["step_type"], fast["episode_id"], valid, fast["pos"], cap,
                                        window)
        np.testing.assert_array_equal(valid, definition)
        assert count == definition.sum()
        # A slot's generation is its write count: what keys carry and the fifo compares.
        writes = ref.writes(fast["pos"], np.arange(streams * cap), cap)
        np.testing.assert_array_equal(fast["generation"], writes)
    assert fast["pos"].max() > 2 * cap  # the rings wrapped
    assert fast["counters"][0] > streams  # episodes happened


def test_rows_distinct_in_range() -> None:
    rng = np.random.default_rng(5)
    marks = np.zeros(6, np.uint8)
    cases = [np.array([], np.int64), np.array([0]), np.array([5]), np.array([6]), np.array([-1]),
             np.array([1, 2, 1]), np.array([3, 0, 5, 1])]
    cases += [rng.integers(-1, 8, rng.integers(1, 6)) for _ in range(50)]
    for rows in cases:
        want = rows.size > 0 and rows.min() >= 0 and rows.max() < 6 and len(set(rows.tolist())) == rows.size
        assert kern.rows_distinct_in_range(rows.astype(np.int64), 6, marks) == want
        assert not marks.any()


def test_lazy_kernel_modules_resolve() -> None:
    proxy = LazyKernels("shardreplay.kernels.storage")
    assert "shardreplay.kernels.storage" in sys.modules and proxy.write_steps is kern.write_steps
    assert "write_steps" in vars(proxy)  # kept: later reads are plain attribute lookups
    with pytest.raises(AttributeError):
        proxy.__wrapped__  # noqa: B018 - dunder probes (copy, inspect) never import
    with pytest.raises(AttributeError):
        proxy.no_such_kernel  # noqa: B018


def _record_views(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Random records with fields of 1, 2, 3, 4, 8 and 40 bytes, and [n, k] byte views of each."""
    dtype = np.dtype([("a", np.uint8), ("b", np.int16), ("c", "V3"), ("d", np.float32), ("e", np.int64),
                      ("f", np.float32, (10,))])
    records = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).copy()
    raw = records.view(np.uint8).reshape(n, -1)
    views = [raw[:, dtype.fields[name][1]:dtype.fields[name][1] + dtype.fields[name][0].itemsize]
             for name in dtype.names]
    return records, views


@pytest.mark.parametrize("n_slots", [0, 1, 17])
def test_scatter_fields_and_bytes_match_indexing(n_slots: int) -> None:
    rng = np.random.default_rng(n_slots)
    _records, fast = _record_views(rng, 40)
    _copy_records, slow = _record_views(np.random.default_rng(n_slots), 40)
    slots = rng.integers(0, 40, n_slots)  # repeats too: the last one wins
    values = (rng.integers(0, 255, n_slots).astype(np.uint8), rng.integers(-99, 99, n_slots).astype(np.int16),
              np.frombuffer(rng.bytes(3 * n_slots), np.uint8).reshape(n_slots, 3),
              rng.random(n_slots).astype(np.float32), rng.integers(-5, 5, n_slots),
              rng.random((n_slots, 10)).astype(np.float32))
    kern.scatter_fields(tuple(zip(fast, values, strict=True)), slots)
    ref.scatter_fields(zip(slow, values, strict=True), slots)
    for f, s in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(f, s)


@pytest.mark.parametrize(("batch", "window"), [(0, 2), (1, 1), (9, 3)])
def test_gather_window_parts_matches_indexing(batch: int, window: int) -> None:
    rng = np.random.default_rng(batch + window)
    _records, views = _record_views(rng, 30)
    plain = np.ascontiguousarray(rng.random((30, 6)).astype(np.float32)).view(np.uint8)  # a whole array
    sources = (*views, plain)
    widths = [v.shape[1] * window for v in sources]
    out_offset = np.concatenate([[5], 5 + np.cumsum(widths)[:-1]]).astype(np.int64)
    idx = rng.integers(0, 30, (batch, window))
    dst_rows = rng.permutation(12)[:batch]
    fast = np.zeros((12, int(out_offset[-1]) + widths[-1] + 3), np.uint8)
    slow = fast.copy()
    windows.gather_window_parts(sources, out_offset, idx, dst_rows, fast)
    ref.gather_window_parts(sources, out_offset, idx, dst_rows, slow)
    np.testing.assert_array_equal(fast, slow)
