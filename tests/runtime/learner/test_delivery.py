"""Nothing lost: a chunk that comes after a later one of its actor is stored, not taken
for a duplicate; what is lost anyway (a crashed learner, a Redis restart without
persistence, rejections) is counted in ``lost_chunks.jsonl``."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.runtime.learner.ingest import Ingestor, merge_stored
from shardreplay.runtime.learner.wal import (
    CRASHED,
    HEADER_BYTES,
    IngestLog,
    LogScan,
    LossLog,
    log_files,
    read_logs,
)
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport import open_transport
from shardreplay.transport.spool import chunk_file_name
from tests.runtime.fault_children import write_n
from tests.runtime.runtime_helpers import IDENT_SPEC, children, ident_counts, make_chunk

CTX = mp.get_context("fork")
FIXTURES = Path(__file__).parent / "fixtures"  # the writers use no torch: forking is safe and starts at once


def _ingestor(reader: Any, *, capacity: int = 64, **options: Any) -> Ingestor:
    settings = TrainSettings.from_dict(dict(learners=1, actors=2, envs_per_actor=2, transport="file:///unused"))
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=settings.streams.streams_of_shard(0),
                          stream_capacity=capacity, window=2)
    return Ingestor(reader, buffer, settings, **options)


def _stored(ingestor: Ingestor) -> dict[tuple[int, int], int]:
    """Steps stored per chunk identity."""
    return dict(ident_counts(ingestor.buffer.state_dict()["arrays"]["field.ident"]))


def _drain_until(ingestor: Ingestor, chunks: int, timeout_s: float, ack: bool = True) -> None:
    """Drain until ``chunks`` chunks are in the buffer; ``ack=False``: acknowledge after
    each drain's "save" (``ack_stored``)."""
    deadline = time.monotonic() + timeout_s
    while len(_stored(ingestor)) < chunks and time.monotonic() < deadline:
        ingestor.drain(16, 0.1, 0, ack=ack)
        if not ack:
            time.sleep(0.01)  # the save: meanwhile ready/ fills up (listings take several reads)
            ingestor.ack_stored()


def _spool(tmp_path: Path, **options: Any) -> Any:
    return open_transport(f"file://{tmp_path}/spool", IDENT_SPEC, fsync=False, **options)


def _miss_once(monkeypatch: pytest.MonkeyPatch, directory: Path, name: str) -> None:
    """The next listing of ``directory`` lacks ``name``: what a listing read in several
    parts shows of a file renamed in while it runs (POSIX leaves it open)."""
    real = os.scandir
    missed: list[bool] = []

    def scandir(path: Any = ".") -> Any:
        entries = list(real(path))
        if Path(path) == directory and not missed:
            missed.append(True)
            entries = [e for e in entries if e.name != name]
        return iter(entries)

    monkeypatch.setattr(os, "scandir", scandir)


def test_a_spool_listing_that_misses_a_chunk_delivers_it_in_order(tmp_path: Path, monkeypatch) -> None:
    transport = _spool(tmp_path)
    writer = transport.writer()
    for q in range(4):
        writer.send(make_chunk(0, q))
    reader = transport.reader()
    _miss_once(monkeypatch, tmp_path / "spool" / "ready", chunk_file_name(0, 1))
    got = reader.receive(10, timeout_s=1)
    assert [c.sequence for c in got] == [0, 1, 2, 3]


def test_a_spool_listing_that_misses_a_chunk_loses_nothing(tmp_path: Path, monkeypatch) -> None:
    transport = _spool(tmp_path)
    writer = transport.writer()
    for q in range(4):
        writer.send(make_chunk(0, q))
    ingestor = _ingestor(transport.reader())
    _miss_once(monkeypatch, tmp_path / "spool" / "ready", chunk_file_name(0, 1))
    _drain_until(ingestor, 4, timeout_s=5)
    assert _stored(ingestor) == {(0, q): 8 for q in range(4)}
    assert ingestor.total_duplicates == 0
    assert os.listdir(tmp_path / "spool" / "ready") == []


def test_a_chunk_delivered_after_a_later_one_is_stored_in_a_new_episode(tmp_path: Path) -> None:
    transport = _spool(tmp_path)
    writer = transport.writer()
    ingestor = _ingestor(transport.reader())
    late = make_chunk(0, 1)
    late.steps["step_type"][:, 0] = 1  # the middle of an episode that began in chunk 0
    writer.send(make_chunk(0, 2))
    ingestor.drain(8, 1.0, 0)
    writer.send(late)
    ingestor.drain(8, 1.0, 0)
    assert _stored(ingestor) == {(0, 2): 8, (0, 1): 8}
    assert ingestor.total_duplicates == 0
    state = ingestor.buffer.state_dict()["arrays"]
    types = state["step_type"].reshape(-1, 4)  # rows 0, 1: chunk 2's 4 steps, then chunk 1's
    firsts = types[state["field.ident"].reshape(-1, 4, 2)[:, 0, 1] == 1, 0]
    assert (firsts == 0).all()  # made FIRST: no window joins chunk 2's end to chunk 1


@pytest.mark.slow
def test_two_writers_of_2000_chunks_through_a_spool_are_stored_exactly_once(tmp_path: Path) -> None:
    transport = _spool(tmp_path, queued_chunks_per_actor=1_000_000)
    ingestor = _ingestor(transport.reader(), capacity=4096)
    with children() as kids:
        procs = [kids.track(CTX.Process(target=write_n, args=(transport, a, 2000), daemon=True))
                 for a in (0, 1)]
        for p in procs:
            p.start()
        _drain_until(ingestor, 4000, timeout_s=60, ack=False)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    assert _stored(ingestor) == {(a, q): 2 for a in (0, 1) for q in range(2000)}
    assert ingestor.total_duplicates == 0
    assert ingestor.state_dict() == {"stored": {"0": [[0, 1999]], "1": [[0, 1999]]}}
    assert os.listdir(tmp_path / "spool" / "ready") == []


@pytest.mark.redis
def test_a_consumer_that_takes_over_a_dead_ones_entries_loses_none(redis_factory) -> None:
    server = redis_factory()
    writer = open_transport(server.url, IDENT_SPEC).writer()
    for q in range(40):
        writer.send(make_chunk(0, q))
    writer.close()
    dead = open_transport(server.url, IDENT_SPEC, consumer="a").reader()
    assert len(dead.receive(10, timeout_s=2)) == 10
    dead.close()  # killed before it acknowledged anything
    # The heir reads the 30 new entries first, then claims the dead one's 10 older ones.
    heir = _ingestor(open_transport(server.url, IDENT_SPEC, consumer="b", claim_idle_s=1).reader(),
                    capacity=256)
    _drain_until(heir, 40, timeout_s=20)
    assert _stored(heir) == {(0, q): 8 for q in range(40)}
    assert heir.total_duplicates == 0
    heir.close()
    assert redis.Redis.from_url(server.url).xpending("shardreplay:chunks", "learners")["pending"] == 0


@pytest.mark.redis
def test_a_redis_restart_without_persistence_counts_the_entries_lost(redis_factory, tmp_path: Path,
                                                                     caplog) -> None:
    server = redis_factory()  # --appendonly no
    transport = open_transport(server.url, IDENT_SPEC, trim_interval_s=0.05, reconnect_timeout_s=30)
    writer = transport.writer()
    for q in range(20):
        writer.send(make_chunk(0, q))
    writer.close()
    ingestor = _ingestor(transport.reader(), losses=LossLog(tmp_path, 0))
    time.sleep(0.1)  # the reader looks at what waits on its next receive
    while len(_stored(ingestor)) < 5:
        ingestor.drain(5 - len(_stored(ingestor)), 1.0, 0)
    server.restart()
    with caplog.at_level(logging.ERROR, logger="shardreplay.transport"):
        deadline = time.monotonic() + 20
        while ingestor.reader.stats.lost == 0 and time.monotonic() < deadline:
            ingestor.drain(16, 0.1, 0)
        ingestor.drain(16, 0.1, 0)  # the loss reaches lost_chunks.jsonl with the next receive
    assert ingestor.reader.stats.lost == 15
    assert "15 chunks lost" in caplog.text and "appendonly" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "lost_chunks.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["chunks"] == 15 and records[0]["actor_id"] == -1
    assert "restarted without its data" in records[0]["reason"]
    ingestor.close()


def _read_back(ingestor: Ingestor, directory: Path, checkpoint: str) -> LogScan:
    """What a new life does first: read the earlier lives' logs into ``ingestor``."""
    scan = LogScan()
    ingestor.replay(read_logs(log_files(directory), scan), 0, checkpoint=checkpoint)
    return scan


def test_chunks_acknowledged_after_the_checkpoint_of_a_crashed_learner_are_reported(tmp_path: Path) -> None:
    """Life 1 logs headers only (a medium whose chunks die with the learner), stores 0..4,
    checkpoints, stores 5..9 (9 not acknowledged yet) and dies. Life 2 restores the
    checkpoint: 9 comes again and is stored, 5..8 are reported lost."""
    run, transport = tmp_path / "run", _spool(tmp_path)
    ingest = run / "ingest"
    writer = transport.writer()
    life1 = _ingestor(transport.reader(), wal=IngestLog(ingest, 0, 1, keep_chunks=False, fsync=False))
    for q in range(5):
        writer.send(make_chunk(0, q))
    _drain_until(life1, 5, timeout_s=5)
    saved = life1.state_dict()  # checkpoint 3, complete
    life1.checkpointed(3, latest_complete=3)
    for q in range(5, 9):
        writer.send(make_chunk(0, q))
    _drain_until(life1, 9, timeout_s=5)
    writer.send(make_chunk(0, 9))
    while (0, 9) not in life1.stored:
        life1.drain(8, 1.0, 0, ack=False)  # stored and logged; its acknowledgement never goes out
    assert life1.wal is not None and life1.wal.segment_bytes == 5 * HEADER_BYTES  # headers, no chunk bytes
    life1.wal.close()  # SIGKILL: the kernel closes its files, the log's writes are in
    life1.reader.close()  # ... and its spool lock; chunk 9 was never acknowledged

    stored = merge_stored([saved])
    losses = LossLog(run, 0)
    old = log_files(ingest)
    life2 = _ingestor(transport.reader(), losses=losses, stored=stored)
    _read_back(life2, ingest, "3")
    assert life2.suspects.chunks == {(0, q): 8 for q in range(5, 10)}
    life2.wal = IngestLog(ingest, 0, 1, keep_chunks=False, fsync=False, inherited=old)
    _drain_until(life2, 1, timeout_s=5)
    assert _stored(life2) == {(0, 9): 8}
    assert life2.report_lost() == (4, 32)
    records = [json.loads(line) for line in (run / "lost_chunks.jsonl").read_text().splitlines()]
    assert records == [{"actor_id": 0, "first": 5, "last": 8, "chunks": 4, "steps": 32, "reason": CRASHED,
                        "rank": 0}]
    life2.checkpointed(4, latest_complete=4)  # the old files stay: a fallback from 4 to 3 replays them
    assert len(list(ingest.iterdir())) == 4
    life2.checkpointed(5, latest_complete=5)  # a second complete checkpoint of this life: they go
    assert {p.name for p in ingest.iterdir()} == {life2.wal.path.name, f"{life2.wal.path.stem}.upto-5.wal"}
    life2.close()
    # The next life finds only life 2's record of chunk 9, which its checkpoint would hold.
    stored.add(0, 9)
    life3 = _ingestor(transport.reader(), stored=stored)
    _read_back(life3, ingest, "4")
    assert life3.suspects.chunks == {}
    life3.close()


def test_the_journal_of_a_run_written_before_the_one_log_is_read_on_resume(tmp_path: Path) -> None:
    """A run directory from before the journal was folded into the ingest log holds
    ``shard-<k>.<life>[.upto-<id>].journal`` files of 24-byte records (actor id, sequence,
    steps). The fixture's were written by main at f00eda4's ``IngestJournal`` (shard 0:
    chunks 0..4, ``rotate(3)``, chunks 5..9; shard 1 of that two-shard life: chunk 0).
    A resume reads them as header-only records: what the checkpoint lacks and the medium
    does not deliver again is reported lost, what it delivers again is not, a torn last
    record is ignored, and the files go with the second complete checkpoint of the new life."""
    run, transport = tmp_path / "run", _spool(tmp_path)
    ingest = run / "ingest"
    shutil.copytree(FIXTURES / "journal-f00eda4", ingest)
    (live,) = (p for p in ingest.glob("shard-0.*.journal") if ".upto-" not in p.name)
    with open(live, "ab") as f:  # the process died inside its next write
        f.write(struct.pack("<qqq", 0, 10, 8)[:11])
    stored = merge_stored([{"stored": {"0": [[0, 4]]}}])
    old = log_files(ingest)
    assert len(old) == 3
    life2 = _ingestor(transport.reader(), losses=LossLog(run, 0), stored=stored,
                      wal=IngestLog(ingest, 0, 1, keep_chunks=False, fsync=False, inherited=old))
    scan = _read_back(life2, ingest, "3")
    assert scan.records == 11 and not scan.damaged
    assert life2.suspects.chunks == {**{(0, q): 8 for q in range(5, 10)}, (1, 0): 8}
    transport.writer().send(make_chunk(0, 9))  # delivered again: stored, not lost
    _drain_until(life2, 1, timeout_s=5)
    assert life2.report_lost() == (5, 40)
    records = [json.loads(line) for line in (run / "lost_chunks.jsonl").read_text().splitlines()]
    assert [(r["actor_id"], r["first"], r["last"], r["reason"]) for r in records] == \
        [(0, 5, 8, CRASHED), (1, 0, 0, CRASHED)]
    life2.checkpointed(4, latest_complete=4)
    life2.checkpointed(5, latest_complete=5)
    assert life2.wal is not None
    assert {p.name for p in ingest.iterdir()} == {life2.wal.path.name, f"{life2.wal.path.stem}.upto-5.wal"}
    life2.close()
