"""The learner's Ingestor: rows, policy lag, stored chunks by identity, deferred acks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.runtime.learner.ingest import Ingestor, StoredIds, merge_stored
from shardreplay.runtime.learner.wal import LossLog
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport import open_transport
from tests.runtime.runtime_helpers import IDENT_SPEC, ident_counts, make_chunk

SETTINGS = TrainSettings.from_dict(dict(learners=1, actors=2, envs_per_actor=2, transport="file:///unused"))


def _buffer() -> ReplayBuffer:
    return ReplayBuffer(IDENT_SPEC, num_streams=4, stream_capacity=64, window=2)


def _spool(tmp_path: Path, *chunks):
    transport = open_transport(f"file://{tmp_path}/spool", IDENT_SPEC, fsync=False)
    writer = transport.writer()
    for c in chunks:
        writer.send(c)
    return transport


def _ready(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "spool" / "ready").iterdir())


def test_rows_steps_and_policy_lag(tmp_path: Path) -> None:
    transport = _spool(tmp_path, make_chunk(0, 0, version=7), make_chunk(1, 0, version=10))
    buffer = _buffer()
    ingestor = Ingestor(transport.reader(), buffer, SETTINGS)
    assert ingestor.drain(8, 1.0, policy_version=10) == 16
    stats = ingestor.take_stats()
    assert (stats.steps, stats.chunks, stats.lag_count) == (16, 2, 2)
    assert stats.lag_sum == (10 - 7) + (10 - 10)
    idents = buffer.state_dict()["arrays"]["field.ident"]
    rows = np.repeat(np.arange(4), 4)  # stored row after row: actor 0 -> rows 0, 1; actor 1 -> 2, 3
    assert (idents[:, 0] == rows // 2).all()
    assert ingestor.state_dict() == {"stored": {"0": [[0, 0]], "1": [[0, 0]]}}
    assert _ready(tmp_path) == []  # acknowledged: the spool forgot them


def test_stored_chunks_are_dropped_and_acknowledged_others_are_stored(tmp_path: Path) -> None:
    transport = _spool(tmp_path, *(make_chunk(0, q) for q in range(5)), make_chunk(1, 0))
    buffer = _buffer()
    # A restored checkpoint that holds actor 0's chunks 0, 1 and 3, not 2 (a crash before
    # the acks; 2 came late): only the stored ones are duplicates.
    stored = StoredIds()
    stored.add_interval(0, 0, 1)
    stored.add(0, 3)
    ingestor = Ingestor(transport.reader(), buffer, SETTINGS, stored)
    ingestor.drain(8, 1.0, 0)
    assert ingestor.take_stats().duplicates == 3
    assert ingestor.total_duplicates == 3
    assert ident_counts(buffer.state_dict()["arrays"]["field.ident"]) == {(0, 2): 8, (0, 4): 8, (1, 0): 8}
    assert ingestor.state_dict() == {"stored": {"0": [[0, 4]], "1": [[0, 0]]}}
    assert _ready(tmp_path) == []  # dropped ones are acknowledged too: never delivered again


def test_deferred_acknowledgement_waits_for_ack_stored(tmp_path: Path) -> None:
    transport = _spool(tmp_path, make_chunk(0, 0), make_chunk(0, 1))
    ingestor = Ingestor(transport.reader(), _buffer(), SETTINGS)
    assert ingestor.drain(8, 1.0, 0, ack=False) == 16
    assert len(_ready(tmp_path)) == 2  # stored but not acknowledged: a crash re-delivers them
    assert ingestor.ack_stored() == 2
    assert _ready(tmp_path) == []
    assert ingestor.ack_stored() == 0


def test_a_chunk_outside_the_shard_is_rejected_and_leaves_no_mark(tmp_path: Path) -> None:
    transport = _spool(tmp_path, make_chunk(5, 0))  # actor 5's rows are beyond 4 streams
    buffer = _buffer()
    ingestor = Ingestor(transport.reader(), buffer, SETTINGS)
    assert ingestor.drain(8, 1.0, 0) == 0
    assert ingestor.total_rejected == 1 and buffer.num_steps == 0
    assert ingestor.state_dict() == {"stored": {}}


def test_state_round_trip_and_merge_over_shards() -> None:
    ingestor = Ingestor(None, _buffer(), SETTINGS)
    for actor, seq in ((3, 17), (0, 4), (3, 16), (3, 20)):
        ingestor.stored.add(actor, seq)
    state = ingestor.state_dict()
    assert state == {"stored": {"0": [[4, 4]], "3": [[16, 17], [20, 20]]}}  # JSON keys are strings
    merged = merge_stored([state, {"stored": {"3": [[18, 19]], "1": [[9, 9]]}}, None, {}])
    assert merged.state_dict() == {"stored": {"0": [[4, 4]], "1": [[9, 9]], "3": [[16, 20]]}}


def test_chunks_of_a_misconfigured_actor_never_enter_other_actors_rows(tmp_path: Path) -> None:
    """An actor started with the wrong --num-shards or --envs-per-actor is rejected, not
    written into another actor's rows (where it would interleave that actor's episodes)."""
    two = TrainSettings.from_dict(dict(learners=2, actors=4, envs_per_actor=2, transport="file:///unused"))
    wrong_shard = make_chunk(1, 0)  # actor 1 belongs to shard 1; row_of would give actor 0's rows
    too_wide = make_chunk(0, 5, s=3)  # 3 streams, 2 per actor: its third is actor 2's first row
    transport = _spool(tmp_path, wrong_shard, too_wide, make_chunk(0, 0), make_chunk(2, 1))
    (tmp_path / "spool" / "ready" / "notes.txt").write_text("not a chunk")
    buffer = _buffer()
    ingestor = Ingestor(transport.reader(), buffer, two, shard=0, losses=LossLog(tmp_path, 0))
    assert ingestor.drain(8, 1.0, 0) == 16
    assert ingestor.total_rejected == 2
    # Removed from the medium unstored: each one is in lost_chunks.jsonl with its reason.
    lost = [json.loads(line) for line in (tmp_path / "lost_chunks.jsonl").read_text().splitlines()]
    assert [(r["actor_id"], r["first"], r["last"], r["chunks"], r["rank"]) for r in lost] == \
        [(-1, -1, -1, 1, 0), (1, 0, 0, 1, 0), (0, 5, 5, 1, 0)]
    assert "not a chunk file name" not in lost[0]["reason"] and "name" in lost[0]["reason"]
    assert "--num-shards 2" in lost[1]["reason"] and "--envs-per-actor" in lost[2]["reason"]
    assert lost[1]["reason"].startswith("rejected: actor 1 streams")  # an IngestRejectedError's message
    assert [r["steps"] for r in lost] == [-1, 8, 12]
    assert ident_counts(buffer.state_dict()["arrays"]["field.ident"]) == {(0, 0): 8, (2, 1): 8}
    assert ingestor.state_dict() == {"stored": {"0": [[0, 0]], "2": [[1, 1]]}}


def _numpy_returns(running, last_return, rows, reward, step_type) -> list[float]:
    """The reference: the per-time-step numpy version the compiled kernel replaced."""
    out: list[float] = []
    for t in range(step_type.shape[1]):
        running[rows[step_type[:, t] == 0]] = 0.0
        last = step_type[:, t] == 2
        out.extend(float(v) for v in running[rows[last]])
        last_return[rows[last]] = running[rows[last]]
        running[rows[~last]] += reward[~last, t]
    return out


def test_episode_returns_match_the_numpy_reference_over_random_chunks() -> None:
    rng = np.random.default_rng(5)
    ingestor = Ingestor(None, ReplayBuffer(IDENT_SPEC, num_streams=6, stream_capacity=8, window=2), SETTINGS)
    running, last_return, finished = np.zeros(6), np.full(6, np.nan), []
    for _ in range(200):
        s, t = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        rows = rng.permutation(6)[:s]
        types = rng.choice(np.array([0, 1, 1, 1, 2], np.uint8), (s, t))
        reward = rng.standard_normal((s, t)).astype(rng.choice([np.float32, np.float64]))
        finished += _numpy_returns(running, last_return, rows, reward, types)
        ingestor._track_returns(rows, reward, types)
        np.testing.assert_array_equal(ingestor._running, running)
        np.testing.assert_array_equal(ingestor.last_return, last_return)
    assert ingestor.stats.returns == finished and len(finished) > 100
