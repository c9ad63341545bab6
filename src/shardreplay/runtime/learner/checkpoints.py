"""A learner rank's checkpoints and ingest log, beside its loop: the learner decides *when*
to save and *what* its state is; :class:`LearnerCheckpoints` resumes, replays and opens
the log, saves and trims."""

from __future__ import annotations

import io
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from shardreplay import checkpoint
from shardreplay.checkpoint.manifest import checkpoint_dir, read_covered
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.group import Collectives
from shardreplay.errors import CheckpointError, IncompleteCheckpointError
from shardreplay.runtime.algos.base import Agent
from shardreplay.runtime.learner.ingest import Ingestor, ReplayCounts, StoredIds, merge_stored
from shardreplay.runtime.learner.state import Lineage, Progress, StorageGuard
from shardreplay.runtime.learner.wal import PASSED_OVER, IngestLog, LogScan, Retention, log_files, read_logs
from shardreplay.runtime.policy_file import LEARNER_STATE, LearnerRecord, learner_records, record_file
from shardreplay.runtime.run_identity import RunIdentity, write_life

log = logging.getLogger("shardreplay.learner")


def _on_cpu(state: Any) -> Any:
    """``state`` (nested dicts and lists of tensors) with every tensor on the CPU: a run
    trained on a GPU leaves a checkpoint any machine reads (a no-op for CPU runs)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_cpu(v) for v in state)
    return state


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
        self._passed_over: StoredIds | None = None  # what the newest checkpoint a resume passed over stored

    def resume(self, buffer: ShardedReplayBuffer, agent: Agent, progress: Progress, lineage: Lineage,
               checkpoint_id: int | None, replay: bool = True) -> int:
        """Restore checkpoint ``checkpoint_id`` (None: the newest complete one) into
        ``buffer`` and ``agent``, its counters, best evaluation and wall time into
        ``progress``, its stored-chunk record and the run-wide restore figures into
        ``lineage`` (a collective over the learners' collectives: every rank calls it);
        returns its id. ``replay`` False (``--no-replay``): ``buffer`` stays empty (no
        collective then).

        Raises:
            IncompleteCheckpointError: no complete checkpoint to restore.
            CheckpointError: the restored and dropped steps do not add up to the saved ones
                (a bug that must not be saved over the checkpoint it came from), or a
                record is missing, damaged or malformed.
        """
        if not replay:
            return self._resume_without_replay(agent, progress, lineage, checkpoint_id)
        report = checkpoint.load(self.root, buffer, checkpoint_id=checkpoint_id,
                                 fallback=checkpoint_id is None, files=(LEARNER_STATE,))  # verified
        assert report.manifest is not None  # load always carries it
        if report.skipped:  # read before any rank moves them aside
            self._passed_over = self._stored_after(report.checkpoint_id)
        mine = [report.steps, report.dropped_episodes, report.dropped_steps, report.sealed_episodes,
                report.sealed_steps]
        total = self.comm.all_reduce_sum(torch.tensor(mine, dtype=torch.int64), "resume steps")
        steps, dropped_eps, dropped_steps, sealed_eps, sealed_steps = (int(x) for x in total.tolist())
        if steps + dropped_steps != report.saved_steps:
            raise CheckpointError(f"resume from {report.directory}: {steps} steps restored and "
                                  f"{dropped_steps} dropped, but the checkpoint holds "
                                  f"{report.saved_steps}; not continuing")
        self._resumed(report.manifest, report.files[LEARNER_STATE], agent, progress, lineage, {
            "checkpoint": report.directory.name, "checkpoint_id": report.checkpoint_id,
            "saved_shards": report.saved_shards, "shards": self.world, "saved_steps": report.saved_steps,
            "steps": steps, "dropped_episodes": dropped_eps, "dropped_steps": dropped_steps,
            "sealed_episodes": sealed_eps, "sealed_steps": sealed_steps, "skipped": report.skipped})
        if self.rank == 0:
            log.log(logging.WARNING if dropped_steps else logging.INFO,
                    "resumed from %s (%d shard(s) -> %d): %d of its %d steps restored; dropped %d "
                    "episodes (%d steps) beyond the new capacity, sealed %d episodes (%d steps) cut to "
                    "fit a row; counters %s", report.directory.name, report.saved_shards, self.world,
                    steps, report.saved_steps, dropped_eps, dropped_steps, sealed_eps, sealed_steps,
                    progress.counters)
        return report.checkpoint_id

    def _stored_after(self, restored: int) -> StoredIds | None:
        """The stored-chunk record of the newest checkpoint newer than ``restored`` whose
        records read (one the load passed over as damaged); None: none."""
        for cid in reversed([c for c in checkpoint.list_checkpoints(self.root) if c > restored]):
            try:
                manifest = checkpoint.load_manifest(checkpoint_dir(self.root, cid))
                return merge_stored(r.ingest for r in learner_records(manifest))
            except (CheckpointError, OSError):
                continue
        return None

    @staticmethod
    def _record_passed_over(ingestor: Ingestor, passed_over: StoredIds) -> None:
        """Record as lost the chunks of this shard's actors that the checkpoint passed over
        held and that neither the one restored nor the log replay holds now (the log was
        trimmed past them: a fallback by more than one checkpoint); steps unknown."""
        known = ingestor.stored, ingestor.suspects.chunks  # restored or replayed; logged, not replayed
        gone = {(a, q): -1 for a, lo, hi in passed_over.intervals() if ingestor.owns_actor(a)
                for q in range(lo, hi + 1) if not any((a, q) in k for k in known)}
        if gone and ingestor.losses is not None:
            ingestor.losses.record_runs(gone, PASSED_OVER)
            log.warning("rank %d: %d chunks stored before a damaged checkpoint the resume passed over are in "
                        "no checkpoint restored and no ingest log (listed in %s)", ingestor.shard, len(gone),
                        ingestor.losses.path)

    def _resume_without_replay(self, agent: Agent, progress: Progress, lineage: Lineage,
                               checkpoint_id: int | None) -> int:
        """``--no-replay``: the agent, counters and stored-chunk record of checkpoint
        ``checkpoint_id`` (None: the newest complete one), its parts not read."""
        cid = checkpoint_id if checkpoint_id is not None else checkpoint.latest_complete(self.root)
        if cid is None:
            raise IncompleteCheckpointError(f"no complete checkpoint under {self.root}")
        manifest = checkpoint.load_manifest(checkpoint_dir(self.root, cid))
        self._resumed(manifest, read_covered(manifest, LEARNER_STATE), agent, progress, lineage, {
            "checkpoint": manifest.directory.name, "checkpoint_id": cid, "replay": False,
            "saved_shards": len(manifest.parts), "shards": self.world, "steps": 0})
        if self.rank == 0:
            log.info("resumed from %s without its replay (--no-replay): weights, optimizer and counters "
                     "restored, the replay starts empty; counters %s", manifest.directory.name,
                     progress.counters)
        return cid

    def _resumed(self, manifest: checkpoint.Manifest, agent_state: bytes, agent: Agent, progress: Progress,
                 lineage: Lineage, report: dict[str, Any]) -> None:
        """Load ``agent_state`` (:data:`LEARNER_STATE`'s bytes) into ``agent``, on the CPU
        first (a run saved on a GPU resumes anywhere), and take back what the parts'
        records hold.

        Raises:
            CheckpointError: a record is missing, damaged or malformed.
        """
        state = torch.load(io.BytesIO(agent_state), weights_only=True, map_location="cpu")
        agent.load_state_dict(state["agent"])
        records = learner_records(manifest)  # every part's (each rank's ingest record)
        first = records[0]
        # Every rank lists the same directory before anyone saves again, so all agree.
        self.last_id = max(checkpoint.list_checkpoints(self.root), default=-1)
        progress.counters.update(first.counters)
        progress.best_eval = -math.inf if first.best_eval is None else first.best_eval
        progress.wall_offset_s = first.wall_s
        lineage.stored = merge_stored(r.ingest for r in records)
        lineage.resumed = report

    def open_log(self, ingestor: Ingestor, *, durable: bool, resume_newest: bool, restored: str,
                 policy_version: int, retention: Retention | None = None,
                 replay: bool = True) -> ReplayCounts:
        """Replay the ingest logs earlier lives left into ``ingestor`` (on top of the
        restored checkpoint ``restored``), then open this life's log (a collective: every
        rank lists the old files before any rank opens its new one). Not ``durable`` (the
        ``local`` ring, whose actors die with the learner): headers only, for the loss
        report. Not ``resume_newest`` (``--checkpoint-id N``): the logs are not replayed
        (what they hold is lost unless delivered again); nor without ``replay``
        (``--no-replay``). ``retention`` (``--keep-rollouts``): the segments are archived.

        Raises:
            OSError: this life's log cannot be created.
        """
        scan = LogScan()
        old = log_files(self.ingest_dir)
        if not resume_newest and old:
            log.warning("rank %d: resuming from an older checkpoint on purpose: the %d ingest log file(s) "
                        "of later chunks are not replayed", self.rank, len(old))
        counts = ingestor.replay(read_logs(old if replay else [], scan,
                                           owns_actor=ingestor.owns_actor if resume_newest else None),
                                 policy_version, write=resume_newest, checkpoint=restored)
        counts.torn, counts.damaged = len(scan.torn), len(scan.damaged)
        if replay and resume_newest and self._passed_over is not None:
            self._record_passed_over(ingestor, self._passed_over)
        t = counts.summed(self.comm)
        if self.rank == 0 and (t.stored or t.held or t.rejected or t.torn or t.damaged):
            log.log(logging.WARNING if t.rejected or t.torn or t.damaged else logging.INFO,
                    "ingest logs replayed: %d chunks (%d steps) acknowledged after the checkpoint stored "
                    "again (%d of them of actors this life no longer runs, written to the streams of "
                    "actor id %% --actors), %d already held, %d rejected (recorded lost); %d torn and "
                    "%d damaged record(s) ignored", t.stored, t.steps, t.rerouted, t.held, t.rejected,
                    t.torn, t.damaged)
        ingestor.wal = IngestLog(self.ingest_dir, self.rank, self.world, keep_chunks=durable, fsync=durable,
                                 fsync_every_s=_FSYNC_EVERY_S, inherited=old if self.rank == 0 else (),
                                 retention=retention)
        return counts

    def save(self, cid: int, buffer: ShardedReplayBuffer, ingestor: Ingestor, record: LearnerRecord,
             agent: Agent | None, *, background: bool) -> Path:
        """Save checkpoint ``cid`` of ``buffer``, incremental, with this rank's ``record``
        and, with ``agent`` (rank 0), its state as :data:`LEARNER_STATE` (covered by the
        manifest); ``background``: fixed now, written by a forked writer while training
        goes on. A save in flight is finished first. No collective (a stopping or failing
        rank saves too). Then the log seals its segment and frees what the newest complete
        checkpoint holds. A write the file system refuses is kept in the
        :class:`StorageGuard`, not raised.
        """
        self.finish(wait=True)
        self.last_id = max(self.last_id, cid)
        self.saved_at = time.monotonic()
        # Serialised in memory: torch.save to a file turns a full disk into a RuntimeError
        # without the OS error, and leaves its temporary file behind.
        files = {record_file(self.rank, self.world): record.as_bytes()}
        if agent is not None:
            data = io.BytesIO()
            torch.save({"agent": _on_cpu(agent.state_dict())}, data)
            files[LEARNER_STATE] = data.getvalue()
        with self.storage.writing():
            kwargs: dict[str, Any] = {"files": files, "keep_last": self.keep_last, "incremental": True}
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
        with self.storage.writing():
            wal.trim(checkpoint.latest_complete(self.root, hashes=False))


def commit_resume(run_dir: Path, ident: RunIdentity, config: dict[str, Any], *, restored: int | None,
                  chosen: bool = False) -> None:
    """Record a resumed life once every rank restored (rank 0): set every checkpoint newer
    than ``restored`` aside (passed over as incomplete or damaged, or, ``chosen``, by
    ``--checkpoint-id N``; all when None was restored), then write ``run.json`` and
    ``config.json``. Before this a refused resume has changed nothing on disk.

    Raises:
        CheckpointError: the checkpoints could not be moved aside.
        OSError: a file could not be written.
    """
    root = run_dir / "checkpoints"
    later = [c for c in checkpoint.list_checkpoints(root) if restored is None or c > restored]
    moved, where = checkpoint.set_aside(root, later)
    if moved:
        names = ", ".join(checkpoint.checkpoint_dir(root, c).name for c in moved)
        why = "chosen on purpose" if chosen else "the newest complete one"
        log.warning("%s: continuing from checkpoint %s (%s); the newer checkpoint(s) %s moved to %s", run_dir,
                    restored, why, names, where)
    write_life(run_dir, ident, config)
    log.info("%s: run %s, learner life %d recorded", run_dir, ident.run_id, ident.life)
