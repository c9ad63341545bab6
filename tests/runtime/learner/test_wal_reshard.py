"""The ingest write-ahead logs replayed after a resume with another routing (issue 22).

Old shards (real Ingestors over ``file://`` spools, each with its log) store chunks as
the actors send them (an actor whose streams span shards sends each shard its part, the
shard in the sequence's high bits); a checkpoint's stored-chunk record is taken half-way,
then more chunks are stored and logged (the learner dies before the next checkpoint).
Each new rank replays as ``LearnerCheckpoints.open_log`` does (every log file, the records
of actors it holds no stream of skipped unread, ``Ingestor.owns_actor``) on top of the
merged record: every chunk the checkpoint lacks is stored exactly once over the new
ranks, each stream's steps on the rank that owns it now, and none it holds again.

Cases: 2 shards -> 1 and -> 3, and 2 -> 2 with another number of actors (the routing
moved streams between shards of the same number: a skip by the shard that wrote a
record, as before, lost them). In-process: the replay has no collective.

Fewer actors after the restart: the records of actors the new life no longer runs go to
the streams of their stand-in (``actor % actors``), not dropped (before, a routing
without them skipped them unread and silently); chunks that continue episodes are then
never joined to another actor's steps (an episode holds one actor's chunks), also for
the stand-in's next chunk after the replay.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.runtime.learner.ingest import Ingestor, StoredIds, merge_stored
from shardreplay.runtime.learner.wal import IngestLog, LogScan, log_files, read_logs
from shardreplay.runtime.settings import TrainSettings
from shardreplay.runtime.stream_layout import SHARD_SEQUENCE_SHIFT
from shardreplay.transport import Chunk, open_transport
from tests.runtime.runtime_helpers import IDENT_SPEC, ident_counts, make_chunk

ENVS, STEPS = 2, 4  # make_chunk: 4 steps per stream


def _settings(learners: int, actors: int) -> TrainSettings:
    return TrainSettings.from_dict(dict(learners=learners, actors=actors, envs_per_actor=ENVS,
                                        transport="file:///unused"))


def _ingestor(tmp: Path, settings: TrainSettings, shard: int, stored: StoredIds | None = None,
              wal: IngestLog | None = None) -> Ingestor:
    spool = f"file://{tmp}/spool-{settings.learners.count}-{shard}"
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=settings.streams.streams_of_shard(shard),
                          stream_capacity=64, window=2)
    transport = open_transport(spool, IDENT_SPEC, fsync=False)
    return Ingestor(transport.reader(), buffer, settings, stored, shard=shard, wal=wal)


def _parts(settings: TrainSettings, actor: int, q: int, continuing: bool = False) -> list[tuple[int, Chunk]]:
    """What ``actor`` sends for its ``q``-th chunk: ``(shard, chunk of its envs there)``;
    ``continuing``: one episode over all its chunks (MID steps but the very first)."""
    shards = settings.streams.shards(actor)
    out = []
    for k in np.unique(shards).tolist():
        envs = np.flatnonzero(shards == k)
        whole = make_chunk(actor, (k << SHARD_SEQUENCE_SHIFT) + q, s=ENVS)
        if continuing:
            whole.steps["step_type"][:] = 1
            whole.steps["step_type"][:, 0] = 1 if q else 0
        out.append((k, dataclasses.replace(whole, stream_ids=envs.astype(np.int64),
                                           steps={n: v[envs] for n, v in whole.steps.items()})))
    return out


def _old_run(tmp: Path, old: TrainSettings, continuing: bool = False
             ) -> tuple[list[dict[str, Any]], dict[tuple[int, int], np.ndarray]]:
    """The old shards store 4 chunks per actor; the checkpoint's record is taken after 2.
    Returns the record and the envs of each chunk stored after it."""
    world = old.learners.count
    logs = [IngestLog(tmp / "run" / "ingest", k, world, fsync=False) for k in range(world)]
    shards = [_ingestor(tmp, old, k, wal=logs[k]) for k in range(world)]
    writers = [open_transport(f"file://{tmp}/spool-{world}-{k}", IDENT_SPEC, fsync=False).writer()
               for k in range(world)]
    later: dict[tuple[int, int], np.ndarray] = {}
    record: list[dict[str, Any]] = []
    for q in range(4):
        due = [0] * world
        for a in range(old.total_actors):
            for k, chunk in _parts(old, a, q, continuing):
                writers[k].send(chunk)
                due[k] += chunk.stream_ids.shape[0] * STEPS
                if q >= 2:
                    later[chunk.identity] = chunk.stream_ids
        for k, ing in enumerate(shards):
            while due[k] > 0:
                due[k] -= ing.drain(8, 10.0, 0)
        if q == 1:  # the checkpoint: its parts' ingest records
            record = [ing.state_dict() for ing in shards]
    for ing in shards:
        ing.close()
    return record, later


@pytest.mark.parametrize(("old", "new"), [((2, 2), (1, 2)), ((2, 2), (3, 2)), ((2, 1), (2, 2))],
                         ids=["2to1", "2to3", "2to2_other_actors"])
def test_logs_replay_once_under_another_routing(tmp_path: Path, old: tuple[int, int],
                                                new: tuple[int, int]) -> None:
    before, after = _settings(*old), _settings(*new)
    record, later = _old_run(tmp_path, before)
    files = log_files(tmp_path / "run" / "ingest")
    assert sorted({p.name.split(".")[0] for p in files}) == [f"shard-{k}" for k in range(old[0])]
    got: Counter[tuple[int, int]] = Counter()
    for rank in range(new[0]):
        ing = _ingestor(tmp_path, after, rank, merge_stored(record))
        counts = ing.replay(read_logs(files, LogScan(), owns_actor=ing.owns_actor), 0)
        assert counts.rejected == 0
        mine = ident_counts(ing.buffer.state_dict()["arrays"]["field.ident"])
        for (a, q), n in mine.items():  # each stream's steps on the rank that owns it now
            assert n == STEPS * int((after.streams.shards(a)[later[(a, q)]] == rank).sum()), (a, q)
        got.update(mine)
    assert got == {ident: envs.shape[0] * STEPS for ident, envs in later.items()}, \
        "every chunk after the checkpoint exactly once"


@pytest.mark.parametrize(("old", "new"), [((1, 3), (1, 1)), ((2, 3), (2, 1)), ((2, 4), (1, 2))],
                         ids=["3to1actors", "3to1actors_split", "2to1shards_4to2actors"])
def test_logs_of_removed_actors_replay_on_their_stand_ins(tmp_path: Path, old: tuple[int, int],
                                                         new: tuple[int, int]) -> None:
    before, after = _settings(*old), _settings(*new)
    record, later = _old_run(tmp_path, before, continuing=True)
    files = log_files(tmp_path / "run" / "ingest")
    removed = set(range(new[1], old[1]))
    got: Counter[tuple[int, int]] = Counter()
    want_rerouted = []  # per rank: its counts, and the chunks of removed actors it holds
    for rank in range(new[0]):
        ing = _ingestor(tmp_path, after, rank, merge_stored(record))
        counts = ing.replay(read_logs(files, LogScan(), owns_actor=ing.owns_actor), 0)
        assert counts.rejected == 0
        # The stand-in's next chunk (a remote actor that ran on) after the replay.
        nxt = make_chunk(0, (rank << SHARD_SEQUENCE_SHIFT) + 4, s=ENVS)
        envs = np.flatnonzero(after.streams.shards(0) == rank)
        if envs.size:
            nxt.steps["step_type"][:] = 1
            assert ing._write(_streams_only(nxt, envs), 0) == envs.size * STEPS
        arrays = ing.buffer.state_dict()["arrays"]
        mine = ident_counts(arrays["field.ident"])
        mine.pop((0, (rank << SHARD_SEQUENCE_SHIFT) + 4), None)
        for (a, q), n in mine.items():  # on the rank that owns the stand-in's streams now
            stand_in = after.streams.stand_in(a)
            assert stand_in is not None and (stand_in == a) == (a not in removed)
            assert n == STEPS * int((after.streams.shards(stand_in)[later[(a, q)]] == rank).sum()), (a, q)
        want_rerouted.append((counts, sum(a in removed for a, _q in mine)))
        got.update(mine)
        episodes: dict[int, set[int]] = {}
        for eid, actor in zip(arrays["episode_id"].tolist(), arrays["field.ident"][:, 0].tolist(),
                              strict=True):
            episodes.setdefault(eid, set()).add(actor)
        assert all(len(actors) == 1 for actors in episodes.values()), "an episode joins two actors' steps"
    assert got == {ident: envs.shape[0] * STEPS for ident, envs in later.items()}, \
        "every chunk after the checkpoint exactly once, those of removed actors too"
    assert all(counts.rerouted == n for counts, n in want_rerouted), "counted in the summary"
    assert sum(n for _c, n in want_rerouted) >= sum(a in removed for a, _q in later) > 0


def _streams_only(chunk: Chunk, envs: np.ndarray) -> Chunk:
    return dataclasses.replace(chunk, stream_ids=envs.astype(np.int64),
                               steps={n: v[envs] for n, v in chunk.steps.items()})
