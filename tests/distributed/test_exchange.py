"""Window records: the storage writes sampled windows straight into packed records, and
what the records hold equals the plain gather, field by field (no process group needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import testing
from shardreplay.spec.layout import DATA, window_layout

# Big fields (own arrays), small ones (inside the per-slot record), odd sizes and offsets.
SPEC = sr.Spec({"obs": sr.Field((64,), np.float32), "pix": sr.Field((3, 5), np.uint8),
                "half": sr.Field((20,), np.float16), "action": sr.Field((), np.int64),
                "reward": sr.Field((), np.float32), "flag": sr.Field((), np.bool_)})


def _filled(window: int, storage: str, tmp_path: Path) -> sr.ReplayBuffer:
    buf = sr.ReplayBuffer(SPEC, num_streams=4, stream_capacity=50, window=window, seed=3,
                          storage=storage, directory=tmp_path if storage == "memmap" else None)
    rng = np.random.default_rng(7)
    for t in range(130):  # wraps every ring twice; episodes end at random
        types = np.where(rng.random(4) < 0.15, 2, 1) if t else np.zeros(4, np.int64)
        buf.add({"obs": rng.standard_normal((4, 64), dtype=np.float32),
                 "pix": rng.integers(0, 255, (4, 3, 5), dtype=np.uint8),
                 "half": rng.standard_normal((4, 20)).astype(np.float16),
                 "action": rng.integers(0, 9, 4), "reward": rng.standard_normal(4, dtype=np.float32),
                 "flag": rng.random(4) < 0.5, "step_type": types,
                 "discount": np.where(types == 2, 0.0, 0.99)})
    return buf


@pytest.mark.parametrize("storage", ["memory", "memmap"])
@pytest.mark.parametrize("window", [1, 2, 5])
def test_windows_written_into_records_equal_the_plain_gather(storage: str, window: int,
                                                             tmp_path: Path) -> None:
    buf = _filled(window, storage, tmp_path)
    starts = testing.shard(buf).draw(300, advance_schedule=False).starts
    data, mask, keys = testing.shard(buf).gather(starts)
    layout = window_layout(SPEC, window)
    out = np.zeros((400, layout.record_bytes), np.uint8)
    rows = np.random.default_rng(0).permutation(400)[:300]  # scattered, not in order
    got_mask, got_keys = testing.shard(buf).gather(starts, into=(out, layout.offsets(DATA), rows))
    np.testing.assert_array_equal(got_mask, mask)
    np.testing.assert_array_equal(got_keys, keys)
    views = layout.views(out)
    for name, want in data.items():
        np.testing.assert_array_equal(views[f"data.{name}"][rows], want, err_msg=name)
    untouched = np.setdiff1d(np.arange(400), rows)
    assert not out[untouched].any()  # only the named rows were written


def test_record_views_are_views_not_copies() -> None:
    layout = window_layout(SPEC, 3)
    out = np.zeros((4, layout.record_bytes), np.uint8)
    layout.views(out)["key"][2] = 123456789
    assert layout.views(out)["key"][2] == 123456789
    assert out.any()


def test_windows_into_refuses_rows_or_offsets_outside_the_records(tmp_path: Path) -> None:
    buf = _filled(2, "memory", tmp_path)
    layout = window_layout(SPEC, 2)
    starts = testing.shard(buf).draw(4, advance_schedule=False).starts
    out = np.zeros((4, layout.record_bytes), np.uint8)
    with pytest.raises(ValueError, match="rows"):
        testing.shard(buf).gather(starts, into=(out, layout.offsets(DATA), np.array([0, 1, 2, 4])))
    with pytest.raises(ValueError, match="offsets"):
        testing.shard(buf).gather(starts, into=(out, {"obs": layout.record_bytes - 8}, np.arange(4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        testing.shard(buf).gather(starts, into=(out[:, :-8], layout.offsets(DATA), np.arange(4)))
    assert not out.any()
