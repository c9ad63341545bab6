"""The ingest write-ahead log: what a learner acknowledged survives its SIGKILL.

A learner life (a forked process: the real Ingestor over a ``file://`` spool, with a
log) stores chunks, checkpoints, stores more, acknowledges all, and is SIGKILLed; a
torn record (a crash inside an append) is added to its log. The next life restores the
checkpoint and replays the log: every chunk is stored exactly once, the torn record is
ignored and reported, and the segment the checkpoint covers was trimmed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from shardreplay import checkpoint
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.runtime.learner.ingest import Ingestor, merge_stored
from shardreplay.runtime.learner.loop import versioned
from shardreplay.runtime.learner.wal import (
    HEADER_BYTES,
    IngestLog,
    LogRecord,
    LogScan,
    LossLog,
    log_files,
    read_logs,
)
from shardreplay.runtime.policy_file import learner_records
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport import open_transport
from shardreplay.transport.codec import encode
from tests.runtime.e2e_helpers import read_lost, rejected_on_arrival
from tests.runtime.runtime_helpers import (
    IDENT_SPEC,
    children,
    ident_counts,
    ingest_record,
    kill9,
    make_chunk,
    wait_for,
)

SETTINGS = TrainSettings.from_dict(dict(learners=1, actors=2, envs_per_actor=2, transport="file:///unused"))
CTX = mp.get_context("fork")  # starts at once; the child uses no torch operation


def _buffer() -> ReplayBuffer:
    # A training run's shard: the actors' spec plus the policy version the ingest adds
    # (replaying logged chunks against the shard's own spec lost every one of them).
    return ReplayBuffer(versioned(IDENT_SPEC), num_streams=4, stream_capacity=256, window=2)


def _learner_life(spool: str, run_dir: str, progress: str, save_after: int) -> None:
    """Store and acknowledge chunks forever; checkpoint 0 once ``save_after`` are stored."""
    transport = open_transport(spool, IDENT_SPEC, fsync=False)
    buffer, root = _buffer(), Path(run_dir) / "checkpoints"
    ingestor = Ingestor(transport.reader(), buffer, SETTINGS,
                        wal=IngestLog(Path(run_dir) / "ingest", 0, 1, fsync=True))
    saved = False
    while True:
        ingestor.drain(4, 0.05, 0)
        if not saved and buffer.num_steps >= save_after * 8:
            checkpoint.save(buffer, root, 0, files=ingest_record(ingestor))
            ingestor.checkpointed(0, checkpoint.latest_complete(root))
            saved = True
        tmp = Path(progress + ".tmp")
        tmp.write_text(json.dumps({"acked": ingestor.reader.stats.acked, "saved": saved}))
        tmp.replace(progress)


def _progress(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.timeout(120)
def test_a_sigkilled_learner_loses_no_acknowledged_chunk_and_stores_none_twice(tmp_path: Path) -> None:
    spool, run_dir, progress = f"file://{tmp_path}/spool", tmp_path / "run", tmp_path / "life.json"
    writer = open_transport(spool, IDENT_SPEC, fsync=False).writer()
    first = [(a, q) for q in range(5) for a in (0, 1)]  # 10 chunks, then checkpoint 0
    later = [(a, q) for q in range(5, 10) for a in (0, 1)]  # 10 more, only in the log
    for a, q in first:
        writer.send(make_chunk(a, q))
    with children() as kids:
        proc = kids.track(CTX.Process(target=_learner_life, args=(spool, str(run_dir), str(progress), 10),
                                      daemon=True))
        proc.start()
        wait_for(lambda: _progress(progress).get("saved"), 60, "checkpoint 0")
        for a, q in later:
            writer.send(make_chunk(a, q))
        wait_for(lambda: _progress(progress).get("acked") == 20, 60, "20 chunks acknowledged")
        kill9(proc.pid)
        proc.join(10)
    assert not list((tmp_path / "spool").rglob("*.chunk")), "acknowledged: the spool forgot them"
    files = log_files(run_dir / "ingest")
    # The segment checkpoint 0 holds stays until a newer checkpoint is complete: a resume
    # that finds checkpoint 0 damaged would need it. The open one follows.
    assert len(files) == 2 and ".upto-0." in files[0].name and ".upto-" not in files[1].name, files
    # A crash inside an append: the start of a record, never acknowledged.
    with open(files[1], "rb") as f:
        head = f.read(HEADER_BYTES)
    with open(files[1], "ab") as f:
        f.write(head[:40])

    buffer = _buffer()
    report = checkpoint.load(run_dir / "checkpoints", buffer)
    assert report.manifest is not None
    stored = merge_stored(r.ingest for r in learner_records(report.manifest))
    ingestor = Ingestor(open_transport(spool, IDENT_SPEC, fsync=False).reader(), buffer, SETTINGS, stored)
    scan = LogScan()
    counts = ingestor.replay(read_logs(files, scan), 0)
    assert (counts.stored, counts.held, counts.rejected) == (10, 10, 0)
    assert [(p.name, size) for p, _at, size in scan.torn] == [(files[1].name, 40)] and scan.damaged == []
    # A chunk delivered again after the replay (its ack never reached the medium) is dropped.
    writer.send(make_chunk(0, 7))
    ingestor.drain(8, 1.0, 0)
    assert ingestor.total_duplicates == 1
    counts_by_chunk = ident_counts(buffer.state_dict()["arrays"]["field.ident"])
    assert counts_by_chunk == {ident: 8 for ident in first + later}, "every chunk exactly once"


def test_a_logged_chunk_the_replay_cannot_write_is_recorded_as_lost_not_as_rejected_on_arrival(
        tmp_path: Path) -> None:
    """A logged chunk was acknowledged: one the replay refuses is lost (docs/semantics.md), and
    its reason must say so, or an audit counts it with the chunks refused on arrival (the
    e2e fault matrix passed with every logged chunk lost that way)."""
    too_wide = make_chunk(0, 5, s=3)  # 3 streams; the run takes 2 per actor
    data = encode(too_wide, IDENT_SPEC)
    record = LogRecord(shard=0, world=1, actor_id=0, sequence=5, prev=-1, steps=12, data=data)
    reader = open_transport(f"file://{tmp_path}/spool", IDENT_SPEC, fsync=False).reader()
    ingestor = Ingestor(reader, _buffer(), SETTINGS, losses=LossLog(tmp_path, 0))
    try:
        counts = ingestor.replay([record], 0)
    finally:
        ingestor.close()
    assert (counts.stored, counts.rejected) == (0, 1)
    [lost] = read_lost(tmp_path)
    assert (lost.actor_id, lost.first, lost.last) == (0, 5, 5)
    assert lost.reason.startswith("rejected in log replay: ") and "--envs-per-actor" in lost.reason, lost
    assert not rejected_on_arrival(lost.reason)


def test_a_record_damaged_before_the_end_is_reported_and_the_rest_of_its_file_unused(tmp_path: Path) -> None:
    wal = IngestLog(tmp_path, 0, 1, fsync=False)
    data = [memoryview(encode(make_chunk(0, q), IDENT_SPEC)) for q in range(3)]
    wal.append([(d, 0, q, q - 1, 8) for q, d in enumerate(data)])
    wal.close()
    raw = bytearray(wal.path.read_bytes())
    raw[HEADER_BYTES + len(data[0]) + HEADER_BYTES + 100] ^= 0xFF  # inside the second chunk's bytes
    wal.path.write_bytes(bytes(raw))
    scan = LogScan()
    got = [(r.actor_id, r.sequence, r.prev) for r in read_logs([wal.path], scan)]
    assert got == [(0, 0, -1)]
    assert scan.torn == [] and [at for _, at, _ in scan.damaged] == [HEADER_BYTES + len(data[0])]


def test_sealed_segments_go_once_a_checkpoint_after_theirs_is_complete(tmp_path: Path) -> None:
    """The segment checkpoint 3 holds (and the inherited files) stay while 3 is the newest
    complete checkpoint: a resume that finds it damaged falls back to 2 and replays them."""
    old = tmp_path / "shard-1.5-7.wal"  # an earlier life's segment (another shard)
    old.write_bytes(b"x" * 10)
    wal = IngestLog(tmp_path, 0, 2, fsync=False, inherited=[old])
    chunk = memoryview(encode(make_chunk(0, 0), IDENT_SPEC))
    wal.append([(chunk, 0, 0, -1, 8)])
    assert wal.size_bytes == HEADER_BYTES + len(chunk) + 10
    wal.seal(3)
    sealed = tmp_path / wal.path.name.replace(".wal", ".upto-3.wal")
    assert sealed.exists() and wal.path.exists() and wal.trimmable
    assert wal.trim(None) == 0 and wal.trim(2) == 0 and wal.trim(3) == 0 and sealed.exists() and old.exists()
    wal.seal(4)
    assert wal.trim(4) == HEADER_BYTES + len(chunk) + 10
    assert not sealed.exists() and not old.exists() and wal.trimmable
    assert wal.size_bytes == 0 and wal.peak_bytes == HEADER_BYTES + len(chunk) + 10
    assert log_files(tmp_path) == [sealed.with_name(sealed.name.replace("-3.", "-4.")), wal.path]
    wal.close()
    assert os.path.exists(wal.path)


def test_a_log_holding_a_shards_capacity_asks_for_the_checkpoint_that_trims_it(tmp_path: Path) -> None:
    """The bound on the log's size: once the open segment holds the shard's capacity of
    steps, ``log_full`` asks the loop for a checkpoint; after it the open segment is empty,
    and after the next one the whole log: it never holds much more than two capacities."""
    spool, root = f"file://{tmp_path}/spool", tmp_path / "checkpoints"
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=4, stream_capacity=16, window=2)  # 64 steps
    ingestor = Ingestor(open_transport(spool, IDENT_SPEC, fsync=False).reader(), buffer, SETTINGS,
                        wal=IngestLog(tmp_path / "ingest", 0, 1, fsync=False))
    writer = open_transport(spool, IDENT_SPEC, fsync=False).writer()
    try:
        sizes = []
        for q in range(10):  # 8 steps per chunk (2 streams x 4): full after 8 chunks
            writer.send(make_chunk(q % 2, q))
            while ingestor.drain(1, 5.0, 0) == 0:
                pass
            assert ingestor.wal is not None
            sizes.append(ingestor.wal.size_bytes)
            if ingestor.log_full():
                break
        assert q == 7 and ingestor.wal.segment_steps == 64 == buffer.capacity
        assert sizes == sorted(sizes) and sizes[-1] > 0
        checkpoint.save(buffer, root, 1, files=ingest_record(ingestor))
        ingestor.checkpointed(1, checkpoint.latest_complete(root))
        assert not ingestor.log_full() and ingestor.wal.segment_bytes == 0
        assert ingestor.wal.size_bytes == ingestor.wal.peak_bytes == sizes[-1]
        checkpoint.save(buffer, root, 2, files=ingest_record(ingestor))
        ingestor.checkpointed(2, checkpoint.latest_complete(root))
        assert ingestor.wal.size_bytes == 0
    finally:
        writer.close()
        ingestor.close()
