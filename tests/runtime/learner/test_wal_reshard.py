"""The ingest write-ahead logs of 2 shards replayed after a resume on 1 or 3 (issue 22).

Two old shards (real Ingestors over ``file://`` spools, each with its log) store chunks;
a checkpoint's stored-chunk record is taken half-way, then more chunks are stored and
logged (the learner dies before the next checkpoint). Each new rank replays exactly as
``Learner._open_log`` does (every log file, ``skip_shards_of=(rank, world)``) on top of
the merged record: every chunk the checkpoint lacks is stored exactly once over the new
ranks, on the rank that owns each of its streams now, and the ones it holds are not
stored again. In-process (the replay has no collective; each new rank is an Ingestor
with its own shard index).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.runtime.learner.ingest import Ingestor
from shardreplay.runtime.learner.stored_ids import StoredIds, merge_stored
from shardreplay.runtime.learner.wal import IngestLog, LogScan, log_files, read_logs
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport import open_transport
from tests.runtime.runtime_helpers import IDENT_SPEC, ident_counts, make_chunk

ACTORS, ENVS, STEPS = 2, 2, 4  # make_chunk: 2 streams x 4 steps per chunk


def _settings(learners: int) -> TrainSettings:
    return TrainSettings.from_dict(dict(learners=learners, actors=ACTORS, envs_per_actor=ENVS,
                                        transport="file:///unused"))


def _ingestor(tmp: Path, settings: TrainSettings, shard: int, stored: StoredIds | None = None,
              wal: IngestLog | None = None) -> Ingestor:
    spool = f"file://{tmp}/spool-{settings.learners.count}-{shard}"
    buffer = ReplayBuffer(IDENT_SPEC, num_streams=settings.streams.streams_of_shard(shard),
                          stream_capacity=64, window=2)
    transport = open_transport(spool, IDENT_SPEC, fsync=False)
    return Ingestor(transport.reader(), buffer, settings, stored, shard=shard, wal=wal)


def _old_run(tmp: Path) -> tuple[dict[str, Any], list[tuple[int, int]], list[tuple[int, int]]]:
    """Two shards store 4 chunks per actor; the checkpoint's record is taken after 2."""
    old = _settings(2)
    logs = [IngestLog(tmp / "run" / "ingest", k, 2, fsync=False) for k in (0, 1)]
    shards = [_ingestor(tmp, old, k, wal=logs[k]) for k in (0, 1)]
    writers = [open_transport(f"file://{tmp}/spool-2-{k}", IDENT_SPEC, fsync=False).writer() for k in (0, 1)]
    held: list[tuple[int, int]] = []
    later: list[tuple[int, int]] = []
    record: dict[str, Any] = {}
    for q in range(4):
        for a in range(ACTORS):
            writers[old.streams.home_shard(a)].send(make_chunk(a, q))
            (held if q < 2 else later).append((a, q))
        for ing in shards:  # one chunk each (one actor per old shard): returns once it is in
            assert ing.drain(8, 10.0, 0) == ENVS * STEPS
        if q == 1:  # the checkpoint: its parts' ingest records
            record = {"parts": [ing.state_dict() for ing in shards]}
    for ing in shards:
        ing.close()
    return record, held, later


@pytest.mark.parametrize("world", [1, 3])
def test_logs_of_two_shards_replay_once_on_another_number_of_ranks(tmp_path: Path, world: int) -> None:
    record, held, later = _old_run(tmp_path)
    files = log_files(tmp_path / "run" / "ingest")
    assert sorted({p.name.split(".")[0] for p in files}) == ["shard-0", "shard-1"]
    new = _settings(world)
    got: Counter[tuple[int, int]] = Counter()
    for rank in range(world):
        ing = _ingestor(tmp_path, new, rank, merge_stored(record["parts"]))
        counts = ing.replay(read_logs(files, LogScan(), skip_shards_of=(rank, world)), 0)
        assert counts.held == len(held) and counts.rejected == 0
        mine = ident_counts(ing.buffer.state_dict()["arrays"]["field.ident"])
        # Each step is on the rank its stream is routed to now.
        for (a, _q), n in mine.items():
            assert n == STEPS * int((new.streams.shards(a) == rank).sum())
        got.update(mine)
    assert got == {ident: ENVS * STEPS for ident in later}, "every chunk after the checkpoint exactly once"
