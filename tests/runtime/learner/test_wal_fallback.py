"""A resume that falls back past a damaged checkpoint loses no acknowledged chunk silently.

One learner life on a real gloo rank (``LearnerCheckpoints`` and ``Ingestor`` as
``train`` drives them, over a ``file://`` spool) stores and acknowledges chunks around
three checkpoints: two written in the background, the last one at the stop. Then bytes
of the newest checkpoints' data files are flipped, and a second life resumes with the
learner's ``fallback``: it restores an older complete checkpoint. Every acknowledged
chunk must then be in the buffer (restored or replayed from the ingest log) exactly once,
or recorded in ``lost_chunks.jsonl`` with a reason (docs/semantics.md, "Losses are
counted, never silent"). Before the fix the log segments of the chunks between the
restored and the damaged checkpoint were already deleted: those chunks were nowhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardreplay import checkpoint
from shardreplay.distributed.group import Collectives
from shardreplay.runtime.learner.checkpoints import LearnerCheckpoints, commit_resume
from shardreplay.runtime.learner.ingest import Ingestor
from shardreplay.runtime.learner.loop import make_shard_buffer, versioned
from shardreplay.runtime.learner.state import Lineage, Progress, StorageGuard
from shardreplay.runtime.learner.wal import PASSED_OVER, LossLog
from shardreplay.runtime.policy_file import LearnerRecord
from shardreplay.runtime.run_identity import RunIdentity
from shardreplay.runtime.settings import TrainSettings
from shardreplay.transport import open_transport
from tests.runtime.e2e_helpers import read_lost
from tests.runtime.runtime_helpers import IDENT_SPEC, ident_counts, make_chunk
from tests.support import run_ranks

pytestmark = pytest.mark.distributed
PER_CHECKPOINT = 5  # sequences of each of the 2 actors acknowledged before each checkpoint


def _life(run_dir: Path, spool: str) -> tuple[Any, LearnerCheckpoints, Ingestor, TrainSettings]:
    settings = TrainSettings.from_dict(dict(learners=1, actors=2, envs_per_actor=2, transport=spool,
                                            replay_capacity=1024))
    buffer = make_shard_buffer(settings, versioned(IDENT_SPEC), 0)
    ckpts = LearnerCheckpoints(run_dir, 0, 1, Collectives(), StorageGuard(0), keep_last=2)
    reader = open_transport(spool, IDENT_SPEC, fsync=False).reader()
    return buffer, ckpts, Ingestor(reader, buffer, settings, shard=0, losses=LossLog(run_dir, 0)), settings


def _first_life(run_dir: Path, spool: str) -> list[tuple[int, int]]:
    """Checkpoints 1 and 2 in the background, 3 at the stop, chunks acknowledged before each."""
    buffer, ckpts, ingestor, settings = _life(run_dir, spool)
    ckpts.open_log(ingestor, durable=True, resume_newest=True, restored="none", policy_version=0)
    writer = open_transport(spool, IDENT_SPEC, fsync=False).writer()
    agent = torch.nn.Linear(2, 2)
    acked: list[tuple[int, int]] = []
    for cid in (1, 2, 3):
        sent = [(a, q) for q in range(PER_CHECKPOINT * (cid - 1), PER_CHECKPOINT * cid) for a in (0, 1)]
        for a, q in sent:
            writer.send(make_chunk(a, q))
        while ingestor.reader.stats.acked < len(acked) + len(sent):
            ingestor.drain(16, 0.05, 0)
        acked += sent
        record = LearnerRecord({"updates": cid}, None, 0.0, settings.to_dict(), ingestor.state_dict())
        ckpts.save(cid, buffer, ingestor, record, agent, background=cid < 3)
        ckpts.finish(wait=True)
        ckpts.trim(ingestor.wal, force=True)  # as the loop does between saves and at its end
    ingestor.close()
    return acked


def _damage(run_dir: Path, cid: int) -> None:
    """Flip one byte in the middle of checkpoint ``cid``'s largest file (its data)."""
    directory = checkpoint.checkpoint_dir(run_dir / "checkpoints", cid)
    victim = max((p for p in directory.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))


def _second_life(run_dir: Path, spool: str) -> tuple[int, dict[tuple[int, int], int], list[tuple[int, int]]]:
    """Resume as ``train --auto-resume`` does; the checkpoint restored, each chunk's copies
    in the buffer, and the chunks of the stored-chunk record."""
    buffer, ckpts, ingestor, _settings = _life(run_dir, spool)
    lineage = Lineage(RunIdentity("", 1))
    restored = ckpts.resume(buffer, torch.nn.Linear(2, 2), Progress(), lineage, None)
    commit_resume(run_dir, lineage.identity, {}, restored=restored)
    ingestor.stored = lineage.stored
    ckpts.open_log(ingestor, durable=True, resume_newest=True, restored=str(restored), policy_version=0)
    copies = ident_counts(buffer.local.state_dict()["arrays"]["field.ident"])
    stored = [(a, q) for a, lo, hi in ingestor.stored.intervals() for q in range(lo, hi + 1)]
    ingestor.close()
    return restored, {k: n // 8 for k, n in copies.items()}, stored


def _fall_back(rank: int, world: int, run_dir: Path, damaged: tuple[int, ...]) -> dict[str, Any]:
    spool = f"file://{run_dir.parent}/spool"
    acked = _first_life(run_dir, spool)
    for cid in damaged:
        _damage(run_dir, cid)
    restored, copies, stored = _second_life(run_dir, spool)
    return {"acked": acked, "restored": restored, "copies": copies, "stored": stored}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damaged", [(3,), (3, 2)], ids=["newest", "two_newest"])
def test_a_fallback_past_a_damaged_checkpoint_loses_no_acknowledged_chunk_silently(
        tmp_path: Path, damaged: tuple[int, ...]) -> None:
    [got] = run_ranks(_fall_back, 1, tmp_path / "run", damaged)
    assert got["restored"] == min(damaged) - 1
    lost = read_lost(tmp_path / "run")
    assert all(r.reason for r in lost), lost
    recorded = {(r.actor_id, q) for r in lost for q in range(r.first, r.last + 1)}
    copies, stored = got["copies"], set(got["stored"])
    missing = [c for c in got["acked"] if c not in stored and c not in recorded]
    assert missing == [], f"{len(missing)} acknowledged chunks neither stored again nor recorded lost: " \
        f"{missing}"
    assert all(copies.get(c, 0) == 1 for c in stored), "each stored chunk once in the buffer"
    assert not stored & recorded, "a chunk stored again is not lost"
    if damaged == (3,):  # one damaged checkpoint, a backup behind it: nothing may be lost
        assert lost == [] and stored == set(got["acked"])
    else:  # the log reaches back to checkpoint 2 only: what 1 lacks and 2 held is recorded
        assert recorded == {(a, q) for a in (0, 1) for q in range(5, 10)}, lost
        assert {(r.reason, r.steps) for r in lost} == {(PASSED_OVER, -1)}
