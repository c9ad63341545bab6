"""A learner rank's checkpoints: what it saves beside the buffer, and how a resumed run
takes it back (the buffer, the agent, the counters and the stored-chunk record).
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardreplay import checkpoint
from shardreplay.checkpoint.manifest import read_covered
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.group import Collectives
from shardreplay.errors import CheckpointError, IncompleteCheckpointError
from shardreplay.runtime.algos.base import Agent
from shardreplay.runtime.learner.stored_ids import StoredIds, merge_stored
from shardreplay.runtime.policy_file import LEARNER_STATE, LearnerRecord, learner_records, record_file
from shardreplay.runtime.run_identity import RunIdentity, write_life

log = logging.getLogger("shardreplay.learner")


@dataclass(frozen=True)
class Resumed:
    """What a rank took back from a checkpoint.

    Attributes:
        checkpoint_id: the id of the checkpoint restored (for loss reports).
        counters: the learner's counters (``env_steps``, ``updates``, ...) when it saved.
        best_eval: the best evaluation so far (``-inf``: none yet).
        wall_offset_s: wall time of the earlier lives, so the time axis goes on.
        stored: the chunks the checkpoint holds (so that resent ones are dropped).
        last_checkpoint: the newest checkpoint id in the directory (ids only grow).
        report: the run-wide restore figures (steps restored, dropped and sealed).
    """

    checkpoint_id: int
    counters: dict[str, int]
    best_eval: float
    wall_offset_s: float
    stored: StoredIds
    last_checkpoint: int
    report: dict[str, Any]


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


def learner_files(record: LearnerRecord, rank: int, world: int, agent: Agent | None) -> dict[str, bytes]:
    """What a rank saves beside its part (``checkpoint.save(files=...)`` writes them
    before the part, atomically, covered by the manifest): its :class:`LearnerRecord`,
    and with ``agent`` (rank 0) the agent's state as :data:`LEARNER_STATE`.

    Serialised in memory: ``torch.save`` to a file turns a full disk into a RuntimeError
    without the OS error, and leaves its temporary file behind.
    """
    files = {record_file(rank, world): record.as_bytes()}
    if agent is not None:
        data = io.BytesIO()
        torch.save({"agent": _on_cpu(agent.state_dict())}, data)
        files[LEARNER_STATE] = data.getvalue()
    return files


def restore(ckpt_root: Path, buffer: ShardedReplayBuffer, agent: Agent, rank: int,
            world: int, comm: Collectives, checkpoint_id: int | None = None, *,
            replay: bool = True) -> Resumed:
    """Restore checkpoint ``checkpoint_id`` (None: the newest complete one) under
    ``ckpt_root`` into ``buffer`` and ``agent`` (a collective over ``comm``, the
    learners' collectives: every rank calls it). ``replay`` False (``--no-replay``):
    the agent and the counters only; ``buffer`` stays empty (no collective then).

    Raises:
        IncompleteCheckpointError: no complete checkpoint to restore.
        CheckpointError: the restored and dropped steps do not add up to the saved ones
            (a bug that must not be saved over the checkpoint it came from).
    """
    if not replay:
        return _restore_without_replay(ckpt_root, agent, rank, world, checkpoint_id)
    report = checkpoint.load(ckpt_root, buffer, checkpoint_id=checkpoint_id, fallback=checkpoint_id is None,
                             files=(LEARNER_STATE,))  # verified against the manifest
    assert report.manifest is not None  # load always carries it
    mine = [report.steps, report.dropped_episodes, report.dropped_steps, report.sealed_episodes,
            report.sealed_steps]
    total = comm.all_reduce_sum(torch.tensor(mine, dtype=torch.int64), "resume steps")
    steps, dropped_eps, dropped_steps, sealed_eps, sealed_steps = (int(x) for x in total.tolist())
    if steps + dropped_steps != report.saved_steps:
        raise CheckpointError(f"resume from {report.directory}: {steps} steps restored and "
                              f"{dropped_steps} dropped, but the checkpoint holds "
                              f"{report.saved_steps}; not continuing")
    resumed = _resumed(ckpt_root, report.manifest, report.files[LEARNER_STATE], agent, {
        "checkpoint": report.directory.name, "checkpoint_id": report.checkpoint_id,
        "saved_shards": report.saved_shards, "shards": world, "saved_steps": report.saved_steps,
        "steps": steps, "dropped_episodes": dropped_eps, "dropped_steps": dropped_steps,
        "sealed_episodes": sealed_eps, "sealed_steps": sealed_steps, "skipped": report.skipped})
    if rank == 0:
        log.log(logging.WARNING if dropped_steps else logging.INFO,
                "resumed from %s (%d shard(s) -> %d): %d of its %d steps restored; dropped %d "
                "episodes (%d steps) beyond the new capacity, sealed %d episodes (%d steps) cut to "
                "fit a row; counters %s", report.directory.name, report.saved_shards, world,
                steps, report.saved_steps, dropped_eps, dropped_steps, sealed_eps, sealed_steps,
                resumed.counters)
    return resumed


def _restore_without_replay(ckpt_root: Path, agent: Agent, rank: int, world: int,
                            checkpoint_id: int | None) -> Resumed:
    """``--no-replay``: the agent, counters and stored-chunk record of checkpoint
    ``checkpoint_id`` (None: the newest complete one), its parts not read."""
    cid = checkpoint_id if checkpoint_id is not None else checkpoint.latest_complete(ckpt_root)
    if cid is None:
        raise IncompleteCheckpointError(f"no complete checkpoint under {ckpt_root}")
    manifest = checkpoint.load_manifest(checkpoint.checkpoint_dir(ckpt_root, cid))
    resumed = _resumed(ckpt_root, manifest, read_covered(manifest, LEARNER_STATE), agent, {
        "checkpoint": manifest.directory.name, "checkpoint_id": cid, "replay": False,
        "saved_shards": len(manifest.parts), "shards": world, "steps": 0})
    if rank == 0:
        log.info("resumed from %s without its replay (--no-replay): weights, optimizer and counters "
                 "restored, the replay starts empty; counters %s", manifest.directory.name, resumed.counters)
    return resumed


def _resumed(ckpt_root: Path, manifest: checkpoint.Manifest, agent_state: bytes, agent: Agent,
             report: dict[str, Any]) -> Resumed:
    """Load ``agent_state`` (:data:`LEARNER_STATE`'s bytes) into ``agent``, on the CPU first
    (a run saved on a GPU resumes anywhere; ``load_state_dict`` then copies into the
    agent's device), and take back what the parts' records hold.

    Raises:
        CheckpointError: a record is missing, damaged or malformed.
    """
    agent.load_state_dict(torch.load(io.BytesIO(agent_state), weights_only=True, map_location="cpu")["agent"])
    records = learner_records(manifest)  # every part's (each rank's ingest record)
    first = records[0]
    return Resumed(checkpoint_id=int(report["checkpoint_id"]), counters=dict(first.counters),
                   best_eval=-math.inf if first.best_eval is None else first.best_eval,
                   wall_offset_s=first.wall_s, stored=merge_stored(r.ingest for r in records),
                   # Every rank lists the same directory before anyone saves again, so all agree.
                   last_checkpoint=max(checkpoint.list_checkpoints(ckpt_root), default=-1), report=report)


def commit_resume(run_dir: Path, ident: RunIdentity, config: dict[str, Any], *,
                  newer_than: int | None = None) -> None:
    """Record a resumed life once every rank restored (rank 0): set incomplete checkpoints
    aside (out of the way of the ids this life saves), and with ``newer_than`` (``--resume
    --checkpoint-id N``) every checkpoint newer than N, then write ``run.json`` and
    ``config.json``. Before this point a refused resume has changed nothing on disk.

    Raises:
        CheckpointError: incomplete checkpoints could not be moved aside.
        OSError: a file could not be written.
    """
    root = run_dir / "checkpoints"
    if newer_than is not None:
        later = [c for c in checkpoint.list_checkpoints(root) if c > newer_than]
        newer, into = checkpoint.set_aside(root, later)
        if newer:
            log.warning("%s: continuing from checkpoint %d; the newer checkpoint(s) %s moved to %s", run_dir,
                        newer_than, ", ".join(map(str, newer)), into)
    moved, where = checkpoint.set_aside(root)
    if moved:
        names = ", ".join(checkpoint.checkpoint_dir(root, c).name for c in moved)
        log.warning("%s: resumed from the newest complete checkpoint; %d incomplete checkpoint(s) (%s) "
                    "moved to %s", run_dir, len(moved), names, where)
    write_life(run_dir, ident, config)
    log.info("%s: run %s, learner life %d recorded", run_dir, ident.run_id, ident.life)
