"""Restoring a checkpoint of M shards onto N shards (any M, N).

Every rank reads the manifest and the small episode tables of all parts, computes the
same deterministic plan (:mod:`shardreplay.checkpoint.plan`), and reads only the
episodes it receives, straight into its storage. Stream ids (the row, and every field
the spec declares ``env_id``) are rewritten to the new rows; priorities come back with
their steps; episode ids are renumbered uniquely across the new shards; generations
restart at 1. With a sharded buffer the ranks agree, through one collective per try,
on which checkpoint they restored.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint.format import PartReader, advise_hugepages
from shardreplay.checkpoint.manifest import checkpoint_dir, is_complete, list_checkpoints, read_manifest
from shardreplay.checkpoint.plan import EpisodeTable, ShardPlan, plan_shard
from shardreplay.checkpoint.save import mark_restored, mark_restoring, shard_of
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import (
    CheckpointError,
    CheckpointFormatError,
    IncompleteCheckpointError,
)
from shardreplay.spec import Spec, StepType
from shardreplay.storage import STEP_ARRAYS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What a load restored on this rank.

    ``saved_steps`` is the checkpoint's total over all its parts. On this rank,
    ``dropped_*`` counts the episodes (and steps) the new capacity could not hold,
    ``sealed_*`` the episodes kept without their oldest steps (longer than a row: the
    first kept step becomes FIRST) and the steps kept of them; the steps cut off them
    are counted in ``dropped_steps``. Over all ranks, ``steps + dropped_steps`` sums to
    ``saved_steps``.
    """

    checkpoint_id: int
    directory: Path
    saved_shards: int
    steps: int
    episodes: int
    dropped_episodes: int
    dropped_steps: int
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    sealed_episodes: int = 0
    sealed_steps: int = 0
    saved_steps: int = 0

    def counts(self) -> dict[str, int]:
        """This rank's restore as JSON-ready numbers (what ``checkpoint.save(...,
        restored=...)`` records in the next checkpoint)."""
        return {"checkpoint_id": self.checkpoint_id, "saved_shards": self.saved_shards,
                "saved_steps": self.saved_steps, "steps": self.steps, "episodes": self.episodes,
                "dropped_episodes": self.dropped_episodes, "dropped_steps": self.dropped_steps,
                "sealed_episodes": self.sealed_episodes, "sealed_steps": self.sealed_steps}


def load(path: str | Path, buffer: ReplayBuffer | ShardedReplayBuffer, *,
         checkpoint_id: int | None = None, fallback: bool = False) -> LoadReport:
    """Restore a checkpoint under ``path`` into ``buffer`` (this rank's shard).

    Args:
        path: the checkpoint root directory.
        buffer: a ReplayBuffer, or this rank's ShardedReplayBuffer (then every rank of
            the group must call ``load`` together).
        checkpoint_id: which checkpoint (None: the newest complete one).
        fallback: when the chosen checkpoint is missing a part or corrupt, take the
            next older complete one instead of raising.

    Returns:
        A :class:`LoadReport`; ``skipped`` lists the checkpoints passed over and why.

    Raises:
        IncompleteCheckpointError: no (complete) checkpoint, or a part is missing.
        CheckpointFormatError: a corrupt or truncated file, or another spec or version;
            the message names the file and the reason.
        The buffer's previous content is replaced; after an error it is left empty,
        and ``save`` refuses it until a load succeeds.
    """
    local, shard, num_shards = shard_of(buffer)
    if isinstance(buffer, ShardedReplayBuffer):
        buffer.discard_prefetched()  # they name windows of the content being replaced
    root = Path(path)
    candidates = _candidates(root, checkpoint_id, fallback)
    skipped: list[str] = []
    if candidates:  # from here on the content is being replaced
        mark_restoring(local, str(root))
    for cid in candidates:
        error: CheckpointError | None = None
        try:
            report = _load_one(checkpoint_dir(root, cid), local, shard, num_shards)
        except CheckpointError as exc:
            error = exc
            _clear(local)
        failed_ranks = _agree(buffer, error is not None)
        if not failed_ranks:
            mark_restored(local)
            return LoadReport(**{**report.__dict__, "skipped": skipped})
        reason = str(error) if error is not None else f"rank(s) {failed_ranks} could not load it"
        if error is None:
            _clear(local)
        if not fallback:
            raise error or CheckpointFormatError(f"checkpoint {cid}: {reason}")
        log.warning("checkpoint %d skipped: %s", cid, reason)
        skipped.append(f"{cid}: {reason}")
    raise IncompleteCheckpointError(f"no usable checkpoint under {root}"
                                    + (f" (skipped: {'; '.join(skipped)})" if skipped else ""))


def _candidates(root: Path, checkpoint_id: int | None, fallback: bool) -> list[int]:
    ids = list_checkpoints(root)
    if checkpoint_id is not None:
        older = [c for c in reversed(ids) if c < checkpoint_id] if fallback else []
        return [checkpoint_id, *older]
    if not ids:
        raise IncompleteCheckpointError(f"no checkpoint under {root}")
    complete = [c for c in reversed(ids) if is_complete(checkpoint_dir(root, c))]
    if not fallback:
        return complete[:1] or [ids[-1]]  # an incomplete newest one raises its reason
    return complete


def _agree(buffer: ReplayBuffer | ShardedReplayBuffer, failed: bool) -> list[int]:
    """Ranks that failed (collective for a sharded buffer)."""
    if not isinstance(buffer, ShardedReplayBuffer):
        return [0] if failed else []
    flags = buffer.collectives.all_gather(torch.tensor([int(failed)]), "checkpoint.load(agree)")
    return [int(r) for r in torch.nonzero(flags.cpu().reshape(-1)).reshape(-1)]


def _clear(local: ReplayBuffer) -> None:
    local.storage.clear()
    local.restore_finished(local.storage.pos, 0, {"max_priority": 1.0, "draws": 0}, None)


def _load_one(directory: Path, local: ReplayBuffer, shard: int, num_shards: int) -> LoadReport:
    manifest = read_manifest(directory)
    saved_spec = Spec.from_dict(manifest["spec"])
    if saved_spec != local.spec:
        raise CheckpointFormatError(f"{directory / 'manifest.json'}: saved with spec {saved_spec}, "
                                    f"the buffer has {local.spec}")
    parts = sorted(manifest["parts"], key=lambda p: int(p["shard"]))
    with ExitStack() as stack:
        readers = [stack.enter_context(PartReader(directory / p["file"], p)) for p in parts]
        episodes = _episode_table(readers)
        plan = plan_shard(episodes, num_shards, shard, local.num_streams, local.stream_capacity)
        local.storage.clear()
        _read_placements(readers, plan, episodes, local)
        metas = [json.loads(r.metadata.get("buffer_meta", "{}")) for r in readers]
    _finish(local, plan, metas, shard, len(episodes))
    steps = int(plan.row_lengths.sum())
    cut = plan.skip > 0
    sealed_eps = int(cut.sum())
    sealed_steps = int((episodes.length[plan.ids[cut]] - plan.skip[cut]).sum())
    saved_steps = int(episodes.length.sum())
    # One line per shard, losses or not: a restore that dropped nothing says so too.
    log.log(logging.WARNING if plan.dropped_steps else logging.INFO,
            "checkpoint %s: shard %d/%d restored %d steps of %d episodes from %d saved shards "
            "(%d steps saved in all); dropped its %d oldest episodes (%d steps) beyond the new "
            "capacity, sealed %d episodes (%d steps kept) cut to fit a row", directory.name, shard,
            num_shards, steps, len(plan), len(parts), saved_steps, plan.dropped_episodes, plan.dropped_steps,
            sealed_eps, sealed_steps)
    return LoadReport(int(manifest["checkpoint_id"]), directory, len(parts), steps, len(plan),
                      plan.dropped_episodes, plan.dropped_steps, dict(manifest.get("extra", {})),
                      sealed_episodes=sealed_eps, sealed_steps=sealed_steps, saved_steps=saved_steps)


def _episode_table(readers: list[PartReader]) -> EpisodeTable:
    """The episode tables of all parts, checked against their rows, as one table."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("part", "start", "length", "row", "age")}
    for k, reader in enumerate(readers):
        start, length = reader.array("episode.start"), reader.array("episode.length")
        row, row_length = reader.array("episode.row"), reader.array("row_length")
        ends = np.cumsum(row_length)
        if not (start.shape == length.shape == row.shape) or (length <= 0).any() or \
                ((row < 0) | (row >= ends.shape[0])).any():
            raise CheckpointFormatError(f"{reader.path}: malformed episode table")
        row_end = ends[row]
        if ((start < row_end - row_length[row]) | (start + length > row_end)).any():
            raise CheckpointFormatError(f"{reader.path}: episode table does not match its rows")
        for name, values in (("part", np.full(start.shape[0], k)), ("start", start), ("length", length),
                             ("row", row), ("age", row_end - (start + length))):  # age: steps stored after it
            cols[name].append(values.astype(np.int64))
    return EpisodeTable(**{k: np.concatenate(v) if v else np.empty(0, np.int64) for k, v in cols.items()})


def _read_placements(readers: list[PartReader], plan: ShardPlan, episodes: EpisodeTable,
                     local: ReplayBuffer) -> None:
    """Read this shard's episodes into the storage, then check every block read.

    Placements that continue each other both in their part file and in the flat
    storage (a saved stream restored whole, or runs of it) are read as one range: few
    large reads, like ``np.load``, and no partial block at each episode boundary.
    """
    storage = local.storage
    ids = plan.ids
    order = np.lexsort((episodes.start[ids], episodes.part[ids]))  # file order
    ids, row, skip = ids[order], plan.row[order], plan.skip[order]
    part, src = episodes.part[ids], episodes.start[ids] + skip
    dst = row * storage.stream_capacity + plan.offset[order]
    length = episodes.length[ids] - skip
    targets = {f"field.{k}": v for k, v in storage.fields.items()}
    targets.update({k: getattr(storage, k) for k in STEP_ARRAYS})
    for arr in targets.values():
        advise_hugepages(arr)
    runs = _runs(part, src, dst, length)
    for name, arr in targets.items():
        for k, first, lo, n in runs:
            readers[k].rows_into(name, first, arr[lo:lo + n], defer=True)
    for reader in readers:  # every block read is verified before anything is derived from it
        reader.check_pending()
    slots = _ranges(dst, length)
    storage.episode_id[slots] = np.repeat(ids, length)
    storage.generation[slots] = 1
    storage.step_type[dst[skip > 0]] = StepType.FIRST
    rows = np.repeat(row, length)
    for name in local.spec.env_id_fields:
        arr = storage.fields[name]
        arr[slots] = rows.reshape(-1, *([1] * (arr.ndim - 1))).astype(arr.dtype)


def _runs(part: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray
          ) -> list[tuple[int, int, int, int]]:
    """Merge placements contiguous in their part and in the storage: (part, first saved
    step, first flat slot, steps) per run."""
    if part.shape[0] == 0:
        return []
    brk = np.ones(part.shape[0], bool)
    brk[1:] = (part[1:] != part[:-1]) | (src[1:] != src[:-1] + length[:-1]) | \
        (dst[1:] != dst[:-1] + length[:-1])
    first = np.flatnonzero(brk)
    return list(zip(part[first].tolist(), src[first].tolist(), dst[first].tolist(),
                    np.add.reduceat(length, first).tolist(), strict=True))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[s0, s0+1, .., s0+l0-1, s1, ..]``: the slots of runs."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _finish(local: ReplayBuffer, plan: ShardPlan, metas: list[dict[str, Any]], shard: int,
            num_episodes: int) -> None:
    states = [m.get("sampler_state", {}) for m in metas]
    sampler_state = {"max_priority": max([s.get("max_priority", 1.0) for s in states] or [1.0]),
                     "draws": max([s.get("draws", 0) for s in states] or [0])}
    rng = metas[shard].get("rng") if shard < len(metas) else None
    stale = metas[shard].get("stale_updates", 0) if shard < len(metas) else 0
    local.restore_finished(plan.row_lengths, num_episodes, sampler_state, rng, stale)
