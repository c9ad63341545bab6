"""A learner rank's checkpoints and ingest log, beside its loop (as a checkpointing
runner wraps a learner): the learner decides *when* to save and *what* its state is;
:class:`LearnerCheckpoints` resumes, replays and opens the log, saves and trims."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardreplay import checkpoint
from shardreplay.checkpoint.manifest import checkpoint_dir
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.group import Collectives
from shardreplay.runtime.algos.base import Agent
from shardreplay.runtime.learner.ingest import Ingestor, ReplayCounts
from shardreplay.runtime.learner.resume import Resumed, restore
from shardreplay.runtime.learner.state import StorageGuard
from shardreplay.runtime.learner.wal import IngestLog, LogScan, Retention, log_files, read_logs

log = logging.getLogger("shardreplay.learner")
# fdatasync the ingest log at most this often: every batch cost Redis ingest 20-29 % of its
# rate (docs/semantics.md); once a second costs nothing measurable, as Redis's everysec.
_FSYNC_EVERY_S = 1.0
_TRIM_EVERY_S = 2.0  # how often sealed log segments look for the complete checkpoint that frees them


class LearnerCheckpoints:
    """One rank's ``<run_dir>/checkpoints`` and ``<run_dir>/ingest``; ``comm`` is the
    learners' collectives, ``storage`` keeps a refused write, ``keep_last`` complete
    checkpoints stay.

    Attributes:
        pending: the background save in flight (None: none).
        complete: the newest checkpoint this life saw complete (None: none yet).
        saved_at: when the last save started (monotonic; rank 0's clock times periodic saves).
        last_id: the newest checkpoint id saved or found (ids only grow).
    """

    def __init__(self, run_dir: Path, rank: int, world: int, comm: Collectives, storage: StorageGuard,
                 keep_last: int) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.ingest_dir = Path(run_dir) / "ingest"
        self.rank, self.world, self.comm, self.storage = rank, world, comm, storage
        self.keep_last = keep_last
        self.pending: checkpoint.PendingSave | None = None
        self.complete: int | None = None
        self.saved_at = time.monotonic()
        self.last_id = -1
        self._trimmed_at = time.monotonic()

    def resume(self, buffer: ShardedReplayBuffer, agent: Agent, checkpoint_id: int | None,
               replay: bool = True) -> Resumed:
        """Restore checkpoint ``checkpoint_id`` (None: the newest complete one) into
        ``buffer`` (unless not ``replay``) and ``agent`` (a collective).

        Raises:
            IncompleteCheckpointError, CheckpointError: see :func:`~.resume.restore`.
        """
        r = restore(self.root, buffer, agent, self.rank, self.world, self.comm, checkpoint_id, replay=replay)
        self.last_id = r.last_checkpoint
        return r

    def open_log(self, ingestor: Ingestor, *, durable: bool, resume_newest: bool, restored: str,
                 owns_actor: Callable[[int], bool], policy_version: int,
                 retention: Retention | None = None, replay: bool = True) -> tuple[ReplayCounts, LogScan]:
        """Replay the ingest logs earlier lives left into ``ingestor`` (on top of the
        restored checkpoint ``restored``, or of an empty buffer when none was complete),
        then open this life's log (a collective: every rank lists the old files before
        any rank opens its new one).

        A ``local`` medium (not ``durable``) acknowledges nothing that outlives the
        learner (its actors die with it): its log keeps headers only, for the loss report.
        ``--resume --checkpoint-id N`` (not ``resume_newest``) goes back to an older
        checkpoint on purpose: the logs, newer than the newest one, are not replayed (what
        they hold is reported lost unless the medium delivers it again). With
        ``retention`` (``--keep-rollouts``) the log keeps its segments as the rollouts
        archive (chunk bytes kept on any medium). Without ``replay`` (``--no-replay``)
        the logs are not read: what they hold stays out of this life on purpose.

        Raises:
            OSError: this life's log cannot be created.
        """
        scan = LogScan()
        old = log_files(self.ingest_dir)
        if not resume_newest and old:
            log.warning("rank %d: resuming from an older checkpoint on purpose: the %d ingest log file(s) "
                        "of later chunks are not replayed", self.rank, len(old))
        counts = ingestor.replay(read_logs(old if replay else [], scan,
                                           owns_actor=owns_actor if resume_newest else None),
                                 policy_version, write=resume_newest, checkpoint=restored)
        mine = torch.tensor([counts.stored, counts.steps, counts.held, len(scan.torn), len(scan.damaged),
                             counts.rerouted], dtype=torch.int64)
        total = [int(v) for v in self.comm.all_reduce_sum(mine, "log replay")]
        if self.rank == 0 and (total[0] or total[2] or total[3] or total[4]):
            log.log(logging.WARNING if total[3] or total[4] else logging.INFO,
                    "ingest logs replayed: %d chunks (%d steps) acknowledged after the checkpoint stored "
                    "again (%d of them of actors this life no longer runs, written to the streams of "
                    "actor id %% --actors), %d already held; %d torn and %d damaged record(s) ignored",
                    total[0], total[1], total[5], total[2], total[3], total[4])
        ingestor.wal = IngestLog(self.ingest_dir, self.rank, self.world, keep_chunks=durable, fsync=durable,
                                 fsync_every_s=_FSYNC_EVERY_S, inherited=old if self.rank == 0 else (),
                                 retention=retention)
        return counts, scan

    def save(self, cid: int, buffer: ShardedReplayBuffer, ingestor: Ingestor, *, background: bool,
             **content: Any) -> Path:
        """Save checkpoint ``cid`` of ``buffer`` with ``content`` (``checkpoint.save``'s
        ``files``: the learner's record and state), incremental (only the rows new since this
        run's previous checkpoint are written); with ``background`` the content is fixed
        now and a thread writes it while training goes on. A save still in flight is
        finished first: two never overlap. No collective, so it also works from a
        stopping or failing rank. Then the log seals its segment (chunks stored from now
        on are not in this checkpoint) and frees what the newest complete one holds.

        A write the file system refuses is kept in the :class:`StorageGuard`, not raised.
        """
        self.finish(wait=True)
        self.last_id = max(self.last_id, cid)
        self.saved_at = time.monotonic()
        with self.storage.writing():
            kwargs: dict[str, Any] = {**content, "keep_last": self.keep_last, "incremental": True}
            if background:
                self.pending = checkpoint.save_in_background(buffer, self.root, cid, **kwargs)
                ingestor.checkpointed(cid, self.complete)
            else:
                checkpoint.save(buffer, self.root, cid, **kwargs)
                ingestor.checkpointed(cid, checkpoint.latest_complete(self.root))
        return checkpoint_dir(self.root, cid)

    def finish(self, wait: bool) -> None:
        """Collect the background save in flight once it is written (``wait``: wait for
        it); a write the file system refused is kept as any other refused write."""
        pending = self.pending
        if pending is None or not (wait or pending.done()):
            return
        self.pending = None
        with self.storage.writing():
            pending.wait()
            if checkpoint.is_complete(pending.directory, hashes=False):
                self.complete = pending.checkpoint_id

    def trim(self, wal: IngestLog | None, force: bool = False) -> None:
        """Free sealed log segments once the checkpoint that holds them is complete (the
        other ranks may finish their parts after this one sealed); at most every
        :data:`_TRIM_EVERY_S` unless ``force``."""
        if wal is None or not wal.trimmable or \
                (not force and time.monotonic() - self._trimmed_at < _TRIM_EVERY_S):
            return
        self._trimmed_at = time.monotonic()
        # Complete = manifest written (the last rank writes it once every part is there);
        # not re-hashing a large checkpoint here keeps the loop from stalling on it.
        newest = next((c for c in reversed(checkpoint.list_checkpoints(self.root))
                       if checkpoint.is_complete(checkpoint_dir(self.root, c), hashes=False)), None)
        with self.storage.writing():
            wal.trim(newest)
