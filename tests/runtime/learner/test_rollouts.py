"""The rollouts archive (``train --keep-rollouts``): the ingest log's segments kept.

In process, on a real :class:`IngestLog` with a :class:`Retention`: a segment the complete
checkpoint holds moves into ``rollouts/`` (packed with LZ4, checksummed), the cap drops
whole oldest segments and counts them, :func:`iter_rollouts` gives every kept chunk back
bit for bit with its shard and insert time, :func:`archive_summary` reports steps, bytes
and time span, and a damaged byte in a kept segment is found by its checksum. The real
train runs are in tests/runtime/launch/test_train_rollouts.py.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from shardreplay.errors import CorruptChunkError
from shardreplay.runtime.learner.wal import (
    ROLLOUTS_DIR,
    SPEC_FILE,
    IngestLog,
    LogScan,
    Retention,
    archive_summary,
    iter_rollouts,
    log_files,
    read_logs,
)
from shardreplay.transport.codec import encode, is_packed, pack
from tests.runtime.runtime_helpers import IDENT_SPEC, make_chunk


def _archive(run_dir: Path, max_bytes: int = 0) -> Retention:
    (run_dir / ROLLOUTS_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / ROLLOUTS_DIR / SPEC_FILE).write_text(json.dumps(IDENT_SPEC.to_dict()))
    return Retention(run_dir / ROLLOUTS_DIR, max_bytes,
                     pack=functools.partial(pack, spec=IDENT_SPEC, codec="lz4"))


def _life(run_dir: Path, retention: Retention, segments: int, per_segment: int = 3, actor: int = 0,
          first_id: int = 0) -> IngestLog:
    """A shard's log storing ``segments`` checkpoints' worth of chunks, each checkpoint complete."""
    wal = IngestLog(run_dir / "ingest", 0, 1, fsync=False, retention=retention)
    seq = 0
    for k in range(segments):
        batch = []
        for _ in range(per_segment):
            batch.append((memoryview(encode(make_chunk(actor, seq), IDENT_SPEC)), actor, seq, seq - 1, 8))
            seq += 1
        wal.append(batch)
        wal.seal(first_id + k)
        wal.trim(first_id + k)
    return wal


def test_kept_segments_move_to_the_archive_and_read_back_bit_for_bit(tmp_path: Path) -> None:
    before = time.time_ns()
    wal = _life(tmp_path, _archive(tmp_path), segments=2)
    wal.close()
    # The newest segment stays in the log until a second checkpoint is complete (a fallback's).
    assert [p.name.split(".upto-")[1] for p in log_files(tmp_path / ROLLOUTS_DIR)] == ["0.wal"]
    kept = [p for p in log_files(tmp_path / ROLLOUTS_DIR) + log_files(tmp_path / "ingest")
            if p.stat().st_size]
    assert [p.name.split(".upto-")[1] for p in kept] == ["0.wal", "1.wal"]
    got = list(iter_rollouts(tmp_path))
    assert [(k.chunk.actor_id, k.chunk.sequence) for k in got] == [(0, s) for s in range(6)]
    for k in got:
        want = make_chunk(0, k.chunk.sequence)
        assert k.shard == 0 and before <= k.insert_ns <= time.time_ns()
        assert k.chunk.policy_version == want.policy_version
        assert np.array_equal(k.chunk.stream_ids, want.stream_ids)
        for name, arr in want.steps.items():
            assert np.array_equal(k.chunk.steps[name], arr), name
    records = list(read_logs(kept, LogScan()))
    assert len(records) == 6 and all(r.data is not None and is_packed(r.data) for r in records)  # LZ4
    summary = archive_summary(tmp_path)
    assert summary is not None
    assert (summary["segments"], summary["chunks"], summary["steps"]) == (2, 6, 48)
    assert summary["bytes"] == sum(p.stat().st_size for p in kept)
    assert before / 1e9 <= summary["first_insert"] <= summary["last_insert"] <= time.time_ns() / 1e9
    assert summary["damaged"] == [] and summary["torn"] == []


def test_without_retention_trimmed_segments_are_deleted_and_chunks_kept_as_received(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path / "ingest", 0, 1, fsync=False)
    data = encode(make_chunk(0, 0), IDENT_SPEC)
    wal.append([(memoryview(data), 0, 0, -1, 8)])
    assert not is_packed(wal.path.read_bytes()[80:])  # the ingest log alone does not compress
    wal.seal(0)
    wal.trim(0)
    assert not (tmp_path / ROLLOUTS_DIR).exists() and archive_summary(tmp_path) is None
    wal.close()


def test_the_cap_drops_whole_oldest_segments_and_counts_them(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    one = _life(tmp_path / "probe", _archive(tmp_path / "probe"), segments=1)
    one.close()
    size = log_files(tmp_path / "probe" / "ingest")[0].stat().st_size  # one segment (not archived yet)
    wal = _life(tmp_path, _archive(tmp_path, max_bytes=size * 5 // 2), segments=5)  # room for two
    wal.close()
    kept = log_files(tmp_path / ROLLOUTS_DIR)
    assert [p.name.split(".upto-")[1] for p in kept] == ["2.wal", "3.wal"]  # the newest two (4: in the log)
    assert wal.dropped_segments == 2
    assert "dropped its 1 oldest segment(s)" in caplog.text
    assert [k.chunk.sequence for k in iter_rollouts(tmp_path)] == list(range(6, 15))


def test_a_second_life_appends_and_the_archive_keeps_both(tmp_path: Path) -> None:
    first = _life(tmp_path, _archive(tmp_path), segments=1)
    first.close()
    time.sleep(0.01)
    second = _life(tmp_path, _archive(tmp_path), segments=1, actor=1, first_id=5)
    second.close()
    got = [(k.chunk.actor_id, k.chunk.sequence) for k in iter_rollouts(tmp_path)]
    assert got == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]  # oldest life first


def test_a_damaged_kept_segment_is_found_by_its_checksum(tmp_path: Path) -> None:
    wal = _life(tmp_path, _archive(tmp_path), segments=2)
    wal.close()
    victim = log_files(tmp_path / ROLLOUTS_DIR)[0]
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 0x01  # inside the first chunk's packed bytes
    victim.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match="damaged record at byte 0"):
        list(iter_rollouts(tmp_path))
    scan = LogScan()
    assert [k.chunk.sequence for k in iter_rollouts(tmp_path, scan=scan)] == [3, 4, 5]
    assert [(p, at) for p, at, _ in scan.damaged] == [(victim, 0)]
    summary = archive_summary(tmp_path)
    assert summary is not None and summary["damaged"] == [f"{victim}@0"] and summary["chunks"] == 3
