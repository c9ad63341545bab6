"""kernels/first_writes.py against the compiled kernels it stands in for: the same arrays,
in place, and the same results, over random writes (empty, partial, wrap-around, every
window length) of many shapes; the value checks over valid and invalid inputs."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from shardreplay.kernels import first_writes as fw
from shardreplay.kernels import storage as kern
from shardreplay.kernels import validate
from shardreplay.kernels.lazy import LazyKernels

FIRST, MID, LAST = 0, 1, 2
_BOOKKEEPING = ("step_type", "episode_id", "generation", "priority", "valid", "pos", "counters")


def _arrays(streams: int, cap: int) -> dict[str, np.ndarray]:
    n = streams * cap
    return {"step_type": np.zeros(n, np.uint8), "episode_id": np.zeros(n, np.int64),
            "generation": np.zeros(n, np.uint32), "priority": np.zeros(n, np.float32),
            "valid": np.zeros(n, bool), "pos": np.zeros(streams, np.int64), "counters": np.zeros(1, np.int64)}


@pytest.mark.parametrize(("streams", "cap", "window"),
                         [(1, 1, 1), (1, 3, 2), (3, 5, 3), (4, 6, 4), (2, 8, 1), (5, 4, 4), (3, 9, 6),
                          (6, 2, 2), (2, 7, 7)])
def test_write_steps_matches_the_compiled_kernel(streams: int, cap: int, window: int) -> None:
    rng = np.random.default_rng(streams * 100 + cap * 10 + window)
    fast, twin = _arrays(streams, cap), _arrays(streams, cap)
    width = streams * (cap + window)
    outs = [(np.full((2, width), -7, np.int64), np.zeros((2, width), bool)) for _ in range(2)]
    seen_valid = False
    for step in range(80):
        n_rows = int(rng.integers(0, streams + 1))  # 0: an empty write
        rows = rng.permutation(streams)[:n_rows].astype(np.int64)
        t_len = int(rng.integers(0 if step % 7 == 3 else 1, cap + 1))
        kinds = [[FIRST, MID, MID, MID, LAST], [MID], [LAST, FIRST], [MID, LAST]][step % 4]
        types = rng.choice(kinds, (n_rows, t_len)).astype([np.uint8, np.int64][step % 2])
        has_prios = bool(step % 3)
        prios = rng.random(types.shape).astype([np.float32, np.float64][step % 2])
        default = float(rng.random())  # not a float32: both round it the same way
        got = [run.write_steps(*(state[k] for k in _BOOKKEEPING), rows, types,
                               prios if has_prios else np.zeros((1, 1), np.float32), has_prios, default,
                               cap, window, *out)
               for run, state, out in ((kern, fast, outs[0]), (fw, twin, outs[1]))]
        assert got[0] == got[1], f"(n_out, delta) of write {step}"
        for name in fast:
            np.testing.assert_array_equal(twin[name], fast[name], err_msg=f"{name} after write {step}")
        n_out = got[0][0]
        np.testing.assert_array_equal(outs[1][0][0, :types.size], outs[0][0][0, :types.size])
        np.testing.assert_array_equal(outs[1][0][1, :n_out], outs[0][0][1, :n_out])
        np.testing.assert_array_equal(outs[1][1][:, :n_out], outs[0][1][:, :n_out])
        seen_valid |= bool(fast["valid"].any())
    assert fast["pos"].max() > 2 * cap  # the rings wrapped
    assert seen_valid and fast["counters"][0] > streams  # windows and episodes happened


def test_scatter_rows_and_alignment_match_the_compiled_kernels() -> None:
    rng = np.random.default_rng(3)
    dtype = np.dtype([("a", np.uint8), ("b", np.int16), ("d", np.float32), ("f", np.float64, (3,))])
    for n_slots in (0, 1, 5, 40):
        start = np.frombuffer(rng.bytes(40 * dtype.itemsize), dtype)
        records = [start.copy(), start.copy()]
        views = [[r.view(np.uint8).reshape(40, -1)[:, off:off + dt.itemsize]
                  for dt, off in (dtype.fields[n][:2] for n in dtype.names)] for r in records]
        slots = rng.permutation(40)[:n_slots].astype(np.int64)  # distinct, as a write's are
        values = (rng.integers(0, 255, n_slots).astype(np.uint8),
                  rng.integers(-99, 99, n_slots).astype(np.int16),
                  rng.random(n_slots).astype(np.float32), rng.random((n_slots, 3)))
        kern.scatter_fields(tuple(zip(views[0], values, strict=True)), slots)
        fw.scatter_fields(tuple(zip(views[1], values, strict=True)), slots)
        np.testing.assert_array_equal(records[1], records[0])
    marks = np.zeros(6, np.uint8)
    cases = [np.array([], np.int64), np.array([5]), np.array([6]), np.array([-1]), np.array([1, 2, 1])]
    for rows in cases + [rng.integers(-1, 8, rng.integers(1, 6)) for _ in range(60)]:
        rows = rows.astype(np.int64)
        assert fw.rows_distinct_in_range(rows, 6, marks) == kern.rows_distinct_in_range(rows, 6, marks)
        assert not marks.any()
    for pos in ([1], [3, 3, 3], [3, 3, 4], [0, 1], [2, 2, 2, 2, 1]):
        arr = np.array(pos, np.int64)
        assert fw.all_equal(arr) == kern.all_equal(arr)


def test_value_checks_match_the_compiled_kernels() -> None:
    rng = np.random.default_rng(4)
    for dtype, bits, mask in ((np.float32, np.uint32, np.uint32(validate.F32_EXPONENT)),
                              (np.float64, np.uint64, np.uint64(validate.F64_EXPONENT))):
        for bad in (None, np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, np.finfo(dtype).max):
            values = rng.standard_normal(int(rng.integers(1, 30))).astype(dtype)
            if bad is not None:
                values[rng.integers(0, values.shape[0])] = bad
            words = values.view(bits)
            assert fw.is_finite(words, mask) == (validate.max_masked(words, mask) != mask)
    for _ in range(200):
        types = rng.integers(-1, 4, int(rng.integers(0, 6))).astype(rng.choice([np.int64, np.uint8, np.int8]))
        discount = rng.choice([0.0, 1.0, 0.5, -0.1, 1.1, np.nan], int(rng.integers(0, 6))).astype(np.float32)
        assert fw.steps_ok(types, discount) == validate.steps_ok(types, discount)


def test_twins_serve_only_before_numba_loads_and_lazy_modules_resolve() -> None:
    assert "numba" in sys.modules  # this module imported the compiled kernels
    left = fw._writes_left
    assert not fw.numpy_first(spend=True) and fw._writes_left == left  # compiled from now on
    proxy = LazyKernels("shardreplay.kernels.storage")
    assert proxy.loaded and proxy.write_steps is kern.write_steps
    assert "write_steps" in vars(proxy)  # kept: later reads are plain attribute lookups
    with pytest.raises(AttributeError):
        proxy.__wrapped__  # noqa: B018 - dunder probes (copy, inspect) never import
    with pytest.raises(AttributeError):
        proxy.no_such_kernel  # noqa: B018
