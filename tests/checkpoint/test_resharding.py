"""M -> N restore in one process, for every M, N in 1..4.

Each saved shard is a real ReplayBuffer written as part ``k`` of ``M`` (``save`` calls no
collective, so a stand-in rank object is enough); each new shard ``n`` of ``N`` is
restored with the loader's own per-shard entry point, as rank ``n`` would. The exact
per-window probability tables (window content -> ``p^alpha / sum``) over the union of
the saved shards must equal those over the union of the restored shards.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import shardreplay as sr
from shardreplay import checkpoint, testing
from shardreplay.buffer.shard import STEP_ARRAYS
from shardreplay.checkpoint import format as ckfmt
from shardreplay.checkpoint.loading import load_shard
from tests.checkpoint.helpers import (
    T_SCALE,
    as_shard,
    assert_same_distribution,
    fill_random,
    make_buffer,
    step_multiset,
    stored_steps,
    union_distribution,
    window_table,
)

STREAMS, CAPACITY = 3, 40


def _save_shards(root: Path, num_shards: int, cid: int = 1, steps: tuple[int, ...] | None = None
                 ) -> list[sr.ReplayBuffer]:
    shards = []
    for k in range(num_shards):
        local = make_buffer(STREAMS, CAPACITY, seed=k)
        fill_random(local, steps[k] if steps else 30 + 25 * k, shard=k, seed=100 + k)
        checkpoint.save(as_shard(local, k, num_shards), root, cid)
        shards.append(local)
    return shards


def _restore(root: Path, num_shards: int, capacity: int, cid: int = 1) -> list[sr.ReplayBuffer]:
    out = []
    for n in range(num_shards):
        local = make_buffer(STREAMS, capacity, seed=50 + n)
        load_shard(checkpoint.checkpoint_dir(root, cid), local, n, num_shards)
        out.append(local)
    return out


def _check_streams(restored: list[sr.ReplayBuffer]) -> None:
    """env_id field = new row; steps of one saved stream keep their time order."""
    for buf in restored:
        s = stored_steps(buf)
        np.testing.assert_array_equal(s["env"], s["row"])
        for row in range(buf.num_streams):
            in_row = s["row"] == row
            for home in np.unique(s["home"][in_row]):
                ctr = s["ctr"][in_row & (s["home"] == home)]
                assert (np.diff(ctr) > 0).all(), f"row {row}: saved stream {home} out of order"


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_m_to_n_keeps_the_sampling_distribution(tmp_path: Path, m: int, n: int) -> None:
    saved = _save_shards(tmp_path, m)
    before = union_distribution([window_table(b) for b in saved])
    # One saved stream per new row (m <= n) fits any row of the saved capacity; merging
    # more saved streams than rows needs room (the overflow test covers less room).
    restored = _restore(tmp_path, n, CAPACITY if m <= n else CAPACITY * (m + 1))
    assert sum(b.num_steps for b in restored) == sum(b.num_steps for b in saved)
    assert_same_distribution(before, union_distribution([window_table(b) for b in restored]))
    steps_before: dict[int, float] = {}
    for b in saved:
        steps_before.update(step_multiset(b))
    steps_after: dict[int, float] = {}
    for b in restored:
        mine = step_multiset(b)
        assert not set(mine) & set(steps_after), "a step restored on two shards"
        steps_after.update(mine)
    assert steps_after == steps_before  # every step with its priority
    _check_streams(restored)
    if m == n:  # put back as saved: every shard keeps its own streams and max priority
        assert [b.info().max_priority for b in restored] == [b.info().max_priority for b in saved]
        assert [b.num_steps for b in restored] == [b.num_steps for b in saved]
        return
    top = max(b.info().max_priority for b in saved)
    assert all(b.info().max_priority == top for b in restored)
    # Balanced: no new shard holds much more than its share plus one saved stream.
    sizes = [b.num_steps for b in restored]
    assert max(sizes) - min(sizes) <= CAPACITY


@pytest.mark.parametrize(("m", "n"), [(3, 2), (2, 4), (4, 1), (1, 3)])
def test_layout_is_deterministic(tmp_path: Path, m: int, n: int) -> None:
    _save_shards(tmp_path, m)
    capacity = CAPACITY * (m + 1)
    first, second = _restore(tmp_path, n, capacity), _restore(tmp_path, n, capacity)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(testing.positions(a), testing.positions(b))
        for name in STEP_ARRAYS:
            np.testing.assert_array_equal(testing.stored(a, name), testing.stored(b, name))
        for name, arr in testing.shard(a).fields.items():
            np.testing.assert_array_equal(arr, testing.stored(b, name))


def test_same_layout_resume_of_full_shards_is_lossless(tmp_path: Path) -> None:
    """Full rings restored onto the same layout lose nothing (whole episodes must not
    be packed anew into rows that were exactly full)."""
    saved = _save_shards(tmp_path, 3, steps=(90, 100, 130))
    assert all(b.num_steps == STREAMS * CAPACITY for b in saved)
    restored = _restore(tmp_path, 3, CAPACITY)
    assert sum(b.num_steps for b in restored) == 3 * STREAMS * CAPACITY
    assert_same_distribution(union_distribution([window_table(b) for b in saved]),
                             union_distribution([window_table(b) for b in restored]))


def test_each_rank_reads_only_its_episodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_shards(tmp_path, 2)
    reads: list[tuple[str, int, int]] = []
    real = ckfmt.PartReader.rows_into

    def recording(self, name, start, out, **kwargs):
        if name == "field.ctr":
            reads.append((self.path.name, start, out.shape[0]))
        return real(self, name, start, out, **kwargs)

    monkeypatch.setattr(ckfmt.PartReader, "rows_into", recording)
    seen: set[tuple[str, int]] = set()
    for n in range(3):
        buf = make_buffer(STREAMS, CAPACITY)
        load_shard(checkpoint.checkpoint_dir(tmp_path, 1), buf, n, 3)
        mine = {(f, i) for f, s, k in reads for i in range(s, s + k)}
        reads.clear()
        assert len(mine) == buf.num_steps > 0, f"shard {n} read steps it does not hold"
        assert not mine & seen
        seen |= mine


def test_each_rank_reads_only_the_blocks_of_its_episodes(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A ~40 MB part restored onto 4 shards: each touches about a quarter of the blocks
    (its two runs of episodes, the header block and the block of the small ``ctr`` array)."""
    spec = sr.Spec({"obs": sr.Field((4096,), np.float32), "ctr": sr.Field((), np.int64)})
    buf = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=1200, sampler="prioritized")
    for t in range(1200):
        st = np.full(2, 0 if t % 100 == 0 else (2 if t % 100 == 99 else 1), np.uint8)
        buf.add({"obs": np.full((2, 4096), t, np.float32), "ctr": np.arange(2) + 2 * t,
                 "step_type": st})
    directory = checkpoint.save(buf, tmp_path, 1)
    blocks = -(-(directory / "part-00000-of-00001.safetensors").stat().st_size // ckfmt.BLOCK_BYTES)
    assert blocks >= 36
    touched: list[int] = []
    real = ckfmt.PartReader._load_block

    def counting(self, block):
        if block != self._block:
            touched.append(block)
        return real(self, block)

    run = ckfmt.PartReader._read_run

    def counting_run(self, start, dest):
        touched.extend(range(start // ckfmt.BLOCK_BYTES, -(-(start + len(dest)) // ckfmt.BLOCK_BYTES)))
        return run(self, start, dest)

    monkeypatch.setattr(ckfmt.PartReader, "_load_block", counting)
    monkeypatch.setattr(ckfmt.PartReader, "_read_run", counting_run)
    union: set[int] = set()
    for n in range(4):
        local = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=1200, sampler="prioritized")
        load_shard(directory, local, n, 4)
        assert local.num_steps == 600
        assert len(set(touched)) <= blocks // 4 + 5, f"shard {n} read blocks {sorted(set(touched))}"
        union |= set(touched)
        touched.clear()
    assert union == set(range(blocks))


def test_capacity_overflow_drops_the_oldest_episodes(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    saved = _save_shards(tmp_path, 2, steps=(100, 100))
    total = sum(b.num_steps for b in saved)
    restored = make_buffer(STREAMS, CAPACITY)
    with caplog.at_level(logging.WARNING, logger="shardreplay.checkpoint"):
        report = checkpoint.load(tmp_path, restored)
    assert restored.num_steps == report.steps
    assert report.dropped_steps == total - restored.num_steps > 0
    assert f"dropped its {report.dropped_episodes} oldest episodes ({report.dropped_steps} steps)" \
        in caplog.text
    assert restored.num_steps >= 0.9 * restored.capacity  # packed tightly
    kept = set(step_multiset(restored))
    ends_kept, ends_dropped = [], []
    for b in saved:
        s = stored_steps(b)
        cut = np.flatnonzero(np.diff(s["episode_id"]) != 0) + 1
        for ep in np.split(s["ctr"], cut):
            (ends_kept if ep[0] in kept else ends_dropped).append(int(ep[-1]) // T_SCALE)
    assert len(ends_dropped) == report.dropped_episodes
    # Both shards wrote one step per stream per tick: age order is time order.
    # All but the few episodes a full row had no room for are older than every kept one.
    assert sum(e > min(ends_kept) for e in ends_dropped) <= STREAMS
    assert np.percentile(ends_kept, 10) > np.percentile(ends_dropped, 90)
    _check_streams([restored])


def test_overflow_of_one_stream_keeps_exactly_its_newest_episodes(tmp_path: Path) -> None:
    local = make_buffer(1, CAPACITY)
    fill_random(local, 100, seed=7)
    before = stored_steps(local)
    checkpoint.save(local, tmp_path, 1)
    restored = make_buffer(1, 20)
    report = checkpoint.load(tmp_path, restored)
    after = stored_steps(restored)["ctr"]
    # A suffix of whole episodes (the last possibly sealed), at most 20 steps.
    assert 0 < after.shape[0] <= 20
    np.testing.assert_array_equal(after, before["ctr"][-after.shape[0]:])
    ep = before["episode_id"]
    first = before["ctr"].shape[0] - after.shape[0]
    assert first == 0 or ep[first] != ep[first - 1] or len(set(ep[first:])) == 1
    assert report.dropped_steps == first
