"""Restoring a checkpoint of M shards onto N shards (any M, N; docs/semantics.md,
"Checkpoints"): a faithful resume reads each part back as saved; otherwise every rank
reads the episode tables of all parts, computes the same plan (:mod:`.plan`) and reads only
the episodes it receives, straight into its storage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.restore import RestoreSession
from shardreplay.buffer.shard import advise_hugepages, ring_runs, shard_of_buffer
from shardreplay.checkpoint.episodes import ranges
from shardreplay.checkpoint.manifest import checkpoint_dir, list_checkpoints, load_manifest, read_covered
from shardreplay.checkpoint.plan import EpisodeTable, NewLayout, ShardPlan, plan_shard
from shardreplay.checkpoint.records import Manifest, PartMeta, RestoreCounts
from shardreplay.checkpoint.refs import AnyPartReader, open_part, saved_seals
from shardreplay.checkpoint.saving import note_restore, shard_of
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointFormatError,
    ConfigError,
    IncompleteCheckpointError,
)
from shardreplay.spec import Spec, StepType

log = logging.getLogger("shardreplay.checkpoint.load")  # the name users filter on
# Steps of a frame-stacked field read per piece: bounds the temporary stacks (84x84x4 uint8: ~28 MiB).
PIECE_STEPS = 1024


@dataclass(frozen=True)
class LoadReport(RestoreCounts):
    """What a load restored on this rank: its :class:`RestoreCounts` (docs/semantics.md,
    "Counts, every time") and the checkpoint ``directory``, the checkpoints ``skipped``
    (``"<id>: <reason>"``, newest first; also logged), whether it was a faithful resume
    (``exact``), the buffer's new ``key_epoch``, the parsed ``manifest`` and the ``files``
    asked for, verified.
    """

    directory: Path = Path()
    skipped: list[str] = field(default_factory=list)
    exact: bool = False
    key_epoch: int = 0
    manifest: Manifest | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)

    def counts(self) -> RestoreCounts:
        """This rank's restore (what every later save of this shard records, until its
        content is replaced otherwise)."""
        return RestoreCounts(**{f.name: getattr(self, f.name) for f in fields(RestoreCounts)})


def load(path: str | Path, buffer: ReplayBuffer | ShardedReplayBuffer, *,
         checkpoint_id: int | None = None, fallback: bool = False,
         files: Iterable[str] = ()) -> LoadReport:
    """Restore a checkpoint under the root ``path`` into ``buffer`` (a ReplayBuffer, or this
    rank's ShardedReplayBuffer: then every rank calls ``load`` together), verifying what
    it reads, once; a :class:`LoadReport`. ``checkpoint_id`` None: the newest complete
    one; ``fallback``: when the chosen one cannot be loaded, take the next older complete
    one instead of raising; ``files``: names of files saved with ``save(..., files=...)``
    to return verified in ``LoadReport.files``. What is passed over and why, and what
    the buffer holds after an error (nothing; ``save`` refuses it until a load
    succeeds): docs/semantics.md, "Checkpoints".

    Raises:
        IncompleteCheckpointError: no (complete) checkpoint, or a part is missing.
        CheckpointFormatError: a corrupt or truncated file, or another spec or version;
            the message names the file and the reason (CheckpointDamagedError: a block
            or file differs from its recorded hash).
    """
    local, shard, num_shards = shard_of(buffer)
    names = tuple(files)
    if isinstance(buffer, ShardedReplayBuffer):
        buffer.discard_prefetched()  # they name windows of the content being replaced
    root = Path(path)
    ids = list_checkpoints(root)
    if checkpoint_id is None:
        if not ids:
            raise IncompleteCheckpointError(f"no checkpoint under {root}")
        candidates = ids[::-1]
    else:
        candidates = [checkpoint_id, *([c for c in reversed(ids) if c < checkpoint_id] if fallback else [])]
    # Keys handed out from the content being replaced must be stale afterwards too.
    inner = shard_of_buffer(local)
    floor_epoch = inner.key_epoch + writes_per_slot(inner.positions, local.stream_capacity)
    skipped: list[str] = []
    errors: list[CheckpointError] = []
    layout = _new_layout(buffer)
    tried = False
    # From here on the content is being replaced: an error leaves the shard empty and
    # pending (save refuses it) until a load succeeds on every rank.
    with inner.restore(str(root), floor_epoch) as session:
        for cid in candidates:
            directory = checkpoint_dir(root, cid)
            manifest, error = _precheck(directory)  # structure (the rule of verify, less hashes)
            complete = error is None
            if manifest is not None:
                try:
                    report = _restore(manifest, session, local, shard, num_shards, buffer, floor_epoch,
                                      layout, names)
                except CheckpointError as exc:
                    error = exc
                    # Damage found while reading counts as incomplete (passed over).
                    complete = not isinstance(exc, CheckpointDamagedError | IncompleteCheckpointError)
                    session.reset()
            failed_ranks, all_complete = _agree(buffer, error is not None, complete)
            tried = tried or all_complete  # the same on every rank: they go on or stop together
            if not failed_ranks:
                _log_passed_over(root, cid, skipped)
                note_restore(inner, report.counts())
                return replace(report, skipped=skipped)
            reason = str(error) if error is not None else f"rank(s) {failed_ranks} could not load it"
            if error is None:
                session.reset()
            error = error or CheckpointFormatError(f"checkpoint {cid}: {reason}")
            skipped.append(f"{cid}: {reason}")
            errors.append(error)
            # Without fallback only the checkpoint asked for, or the newest complete one, is
            # tried; newer incomplete or damaged ones are passed over (and said so).
            if not fallback and (checkpoint_id is not None or tried):
                _log_passed_over(root, None, skipped)
                raise error
        _log_passed_over(root, None, skipped)
        # The newest one's kind of error (incomplete, or damaged), naming every one passed over.
        kind = type(errors[0]) if errors else IncompleteCheckpointError
        raise kind(f"no usable checkpoint under {root}"
                   + (f" (passed over: {'; '.join(skipped)})" if skipped else ""))


def _precheck(directory: Path) -> tuple[Manifest | None, CheckpointError | None]:
    """:func:`load_manifest` of ``directory``, or why it is not a complete checkpoint."""
    try:
        return load_manifest(directory), None
    except CheckpointError as exc:
        return None, exc
    except OSError as exc:
        return None, CheckpointFormatError(f"{directory}: cannot read it ({exc})")


def _log_passed_over(root: Path, loaded: int | None, skipped: list[str]) -> None:
    """One line per load: which checkpoints it passed over and why, and what it restored."""
    what = f"restored checkpoint {loaded}" if loaded is not None else "restored nothing"
    if skipped:
        log.warning("checkpoint load from %s: %s; passed over %d checkpoint(s): %s", root, what,
                    len(skipped), " | ".join(skipped))
    else:
        log.info("checkpoint load from %s: %s; passed over none", root, what)


def _agree(buffer: ReplayBuffer | ShardedReplayBuffer, failed: bool, complete: bool
           ) -> tuple[list[int], bool]:
    """Ranks that failed, and whether every rank found the checkpoint complete (a rank
    that found damage in what it read did not; one collective for a sharded buffer,
    which also tells every rank the shards' key tags)."""
    if not isinstance(buffer, ShardedReplayBuffer):
        return ([0] if failed else []), complete
    mine = np.array([int(failed), int(complete), shard_of_buffer(buffer.local).key_tag], np.int64)
    internals = internals_of(buffer)
    flags = internals.collectives.all_gather(mine, "checkpoint.load(agree)")
    internals.router.learn_key_tags(flags[:, 2])
    return np.flatnonzero(flags[:, 0]).tolist(), bool(flags[:, 1].all())


def _new_layout(buffer: ReplayBuffer | ShardedReplayBuffer) -> NewLayout:
    """The rows and row capacity of every shard (one collective for a sharded buffer:
    ranks may hold different numbers of rows, and every rank must plan with all of them)."""
    local, _shard, num_shards = shard_of(buffer)
    if not isinstance(buffer, ShardedReplayBuffer):
        return NewLayout.even(num_shards, local.num_streams, local.stream_capacity)
    mine = np.array([local.num_streams, local.stream_capacity], np.int64)
    rows = internals_of(buffer).collectives.all_gather(mine, "checkpoint.load(layout)").tolist()
    return NewLayout(tuple(int(n) for n, _c in rows), tuple(int(c) for _n, c in rows))


def load_shard(directory: Path, local: ReplayBuffer, shard: int, num_shards: int,
               buffer: ReplayBuffer | ShardedReplayBuffer | None = None, floor_epoch: int = 0,
               layout: NewLayout | None = None) -> LoadReport:
    """Restore the checkpoint ``directory`` into ``local`` as shard ``shard`` of
    ``num_shards`` in one restore session, without any collective (a rank's part of
    :func:`load`). ``layout`` gives every new shard's rows, None: all shaped like ``local``.

    Raises:
        CheckpointError: as :func:`load` (no fallback to an older checkpoint).
    """
    inner = shard_of_buffer(local)
    with inner.restore(str(directory), floor_epoch) as session:
        report = _restore(load_manifest(directory), session, local, shard, num_shards, buffer, floor_epoch,
                          layout, ())
    note_restore(inner, report.counts())
    return report


def _restore(manifest: Manifest, session: RestoreSession, local: ReplayBuffer, shard: int,
             num_shards: int, buffer: ReplayBuffer | ShardedReplayBuffer | None, floor_epoch: int,
             layout: NewLayout | None, names: tuple[str, ...]) -> LoadReport:
    """:func:`load_shard` of ``manifest`` through ``session`` (``buffer``: the sharded
    buffer around ``local``, if any), reading the files ``names`` too."""
    if layout is None:
        layout = NewLayout.even(num_shards, local.num_streams, local.stream_capacity)
    if layout.num_shards != num_shards or (layout.num_streams[shard], layout.stream_capacity[shard]) != \
            (local.num_streams, local.stream_capacity):
        raise ConfigError(f"restore layout {layout} does not describe shard {shard} of {num_shards} "
                          f"({local.num_streams} rows of {local.stream_capacity})")
    directory = manifest.directory
    if manifest.spec != local.spec:
        raise CheckpointFormatError(f"{manifest.path}: saved with spec {manifest.spec}, "
                                    f"the buffer has {local.spec}")
    files = {name: read_covered(manifest, name) for name in names}
    with ExitStack() as stack:
        readers: list[AnyPartReader] = []
        for p in manifest.parts:
            readers.append(open_part(directory, p))
            stack.callback(readers[-1].close)
        episodes = episode_table(readers)
        metas = [PartMeta.parse(r.metadata.get("buffer_meta", "{}"), r.path) for r in readers]
        positions = [_row_pos(r) for r in readers]
        epoch = _new_key_epoch(metas, positions, floor_epoch)
        exact = _same_layout(readers, metas, positions, layout)
        if exact:
            plan = _identity_plan(episodes, shard, positions[shard], local.stream_capacity)
            _read_as_saved(readers[shard], positions[shard], session, metas[shard].period)
        else:
            plan = plan_shard(episodes, layout, shard)
            _read_placements(readers, plan, episodes, session, local.spec, [m.period for m in metas])
    mine = metas[shard] if shard < len(metas) else None
    sources = metas[shard:shard + 1] if exact else metas  # re-planned: the largest of any part's
    session.finish(positions[shard] if exact else plan.row_lengths,
                   mine.next_episode_id if exact and mine is not None else len(episodes),
                   sampler_state={"max_priority": max([m.max_priority for m in sources] or [1.0]),
                                  "draws": max([m.draws for m in sources] or [0])},
                   rng_state=None if mine is None else mine.rng,
                   stale_updates=0 if mine is None else mine.stale_updates, key_epoch=epoch,
                   key_tag=None if mine is None else mine.key_tag)  # no saved shard k: ours stays
    if isinstance(buffer, ShardedReplayBuffer) and mine is not None and mine.sharding is not None:
        try:
            internals_of(buffer).load_sharding_state(dict(mine.sharding))
        except ConfigError as exc:
            raise CheckpointFormatError(f"{readers[shard].path}: {exc}") from exc
    return _report(manifest, shard, num_shards, plan, episodes, exact, epoch, files)


def _report(manifest: Manifest, shard: int, num_shards: int, plan: ShardPlan, episodes: EpisodeTable,
            exact: bool, epoch: int, files: dict[str, bytes]) -> LoadReport:
    """This rank's :class:`LoadReport`, said in one log line."""
    steps = int(plan.row_lengths.sum())
    cut = plan.skip > 0
    sealed_eps = int(cut.sum())
    sealed_steps = int((episodes.length[plan.ids[cut]] - plan.skip[cut]).sum())
    saved_steps = int(episodes.length.sum())
    how = ("as saved (same shards and layout: rows, positions, priorities, RNGs)" if exact
           else f"re-planned from {len(manifest.parts)} saved shards")
    # One line per shard, losses or not: a restore that dropped nothing says so too.
    log.log(logging.WARNING if plan.dropped_steps else logging.INFO,
            "checkpoint %s: shard %d/%d restored %d steps of %d episodes %s "
            "(%d steps saved in all); dropped its %d oldest episodes (%d steps) beyond the new "
            "capacity, sealed %d episodes (%d steps kept) cut to fit a row", manifest.directory.name, shard,
            num_shards, steps, len(plan), how, saved_steps, plan.dropped_episodes, plan.dropped_steps,
            sealed_eps, sealed_steps)
    return LoadReport(manifest.checkpoint_id, len(manifest.parts), saved_steps, steps, len(plan),
                      plan.dropped_episodes, plan.dropped_steps, sealed_eps, sealed_steps,
                      manifest.directory, exact=exact, key_epoch=epoch, manifest=manifest, files=files)


def _row_pos(reader: AnyPartReader) -> np.ndarray:
    """A part's saved row positions (absolute: steps ever written to each row)."""
    pos = reader.array("row_pos").astype(np.int64)
    if pos.shape != reader.array("row_length").shape or (pos < 0).any():
        raise CheckpointFormatError(f"{reader.path}: malformed row positions")
    return pos


def _new_key_epoch(metas: list[PartMeta], positions: list[np.ndarray], floor: int) -> int:
    """The key epoch after a restore: above every generation (a slot's write count plus
    its shard's epoch) a saved shard or the replaced content (``floor``) put in a key,
    so every key handed out from now on is newer than any handed out before."""
    return max([floor, *(meta.key_epoch + writes_per_slot(pos, meta.stream_capacity)
                         for meta, pos in zip(metas, positions, strict=True))]) + 1


def writes_per_slot(pos: np.ndarray, cap: int) -> int:
    """The largest write count of any slot of rows at positions ``pos`` of ``cap`` slots."""
    return int(-(-int(pos.max()) // cap)) if pos.shape[0] else 0


def _same_layout(readers: list[AnyPartReader], metas: list[PartMeta], positions: list[np.ndarray],
                 layout: NewLayout) -> bool:
    """Whether the restore can put every part back as it was (docs/semantics.md, "Same N:
    a faithful resume"; nothing dropped by ``partial="drop"``)."""
    return len(readers) == layout.num_shards and all(
        meta.num_streams == layout.num_streams[k] and meta.stream_capacity == cap
        and np.array_equal(reader.array("row_length"), np.minimum(pos, cap))
        for k, (reader, meta, pos, cap) in enumerate(zip(readers, metas, positions, layout.stream_capacity,
                                                           strict=True)))


def _identity_plan(episodes: EpisodeTable, shard: int, pos: np.ndarray, cap: int) -> ShardPlan:
    """Part ``shard``'s episodes, each in its saved row."""
    ids = np.flatnonzero(episodes.part == shard).astype(np.int64)
    zeros = np.zeros(ids.shape[0], np.int64)
    return ShardPlan(ids, episodes.row[ids], zeros, zeros, np.minimum(pos, cap), 0, 0)


def _read_as_saved(reader: AnyPartReader, pos: np.ndarray, session: RestoreSession, period: int) -> None:
    """Read a part (saved with sequence ``period``) into the slots its steps had
    (positions as saved, ring order), with its episode ids, generations and priorities,
    and the step types and discounts that sealing changed put back."""
    runs, at = [], 0
    for dst, n in ring_runs(pos, session.stream_capacity):  # up to the ring's end, then from slot 0
        runs += [(0, at, dst, n)] if n else []
        at += n
    targets = _read_runs([reader], runs, runs, session, [period])
    slots = ranges(np.array([r[2] for r in runs], np.int64), np.array([r[3] for r in runs], np.int64))
    index, types, discounts = saved_seals(reader, slots.shape[0])
    targets["step_type"][slots[index]] = types
    targets["discount"][slots[index]] = discounts


def episode_table(readers: list[AnyPartReader]) -> EpisodeTable:
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


def _read_placements(readers: list[AnyPartReader], plan: ShardPlan, episodes: EpisodeTable,
                     session: RestoreSession, spec: Spec, periods: list[int]) -> None:
    """Read this shard's episodes into the storage (from parts saved with sequence
    ``periods``), then check every block read. Placements that continue each other both
    in their part and in the storage are read as one range (few large reads)."""
    cap = session.stream_capacity
    ids = plan.ids
    order = np.lexsort((episodes.start[ids], episodes.part[ids]))  # file order
    ids, row, skip = ids[order], plan.row[order], plan.skip[order]
    part, src = episodes.part[ids], episodes.start[ids] + skip
    dst = row * cap + plan.offset[order]
    length = episodes.length[ids] - skip
    runs = _runs(part, src, dst, length)
    # New rows start at slot 0: the stacks are read in slot order.
    targets = _read_runs(readers, runs, sorted(runs, key=lambda run: run[2]), session, periods)
    slots = ranges(dst, length)
    targets["episode_id"][slots] = np.repeat(ids, length)
    targets["generation"][slots] = 1
    targets["step_type"][dst[skip > 0]] = StepType.FIRST
    rows = np.repeat(row, length)
    for name in spec.env_id_fields:
        arr = targets[f"field.{name}"]
        arr[slots] = rows.reshape(-1, *([1] * (arr.ndim - 1))).astype(arr.dtype)


def _read_runs(readers: list[AnyPartReader], runs: list[tuple[int, int, int, int]],
               stack_runs: list[tuple[int, int, int, int]], session: RestoreSession,
               periods: list[int]) -> dict[str, np.ndarray]:
    """Read ``runs`` of every array into the session's targets and check every block read
    before anything is derived from it, then the frame stacks (in ``stack_runs``' order)
    and start-only fields; the targets."""
    targets = session.targets()
    for arr in targets.values():
        advise_hugepages(arr)
    for name, arr in targets.items():
        for k, first, lo, n in runs:
            readers[k].rows_into(name, first, arr[lo:lo + n], defer=True)
    for reader in readers:
        reader.check_pending()
    _read_stacks(readers, stack_runs, session)
    _read_starts(readers, periods, runs, session)
    return targets


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


def _read_stacks(readers: Sequence[AnyPartReader], runs: Sequence[tuple[int, int, int, int]],
                session: RestoreSession) -> None:
    """Fill the frame rings of the shard ``session`` restores from ``runs`` (as in
    :func:`_runs`, in the storage's (row, time) order). A part holds whole stacks per step;
    they are read in bounded pieces and each frame is stored once again."""
    stores = session.frame_stores()
    if not stores:
        return
    cap = session.stream_capacity
    for name, store in stores.items():
        store.clear()
        prev_slot = -2
        for part, first, lo, n in runs:
            for off in range(0, n, PIECE_STEPS):
                m = min(PIECE_STEPS, n - off)
                values = np.empty((m, *store.field.shape), store.field.dtype)
                readers[part].rows_into(f"field.{name}", first + off, values)
                slot = lo + off
                row = slot // cap
                # The step before continues this one's stack only when it is the previous
                # slot of the same row (the ring's end wraps to slot 0 of the row).
                before = slot - 1 if slot % cap else slot + cap - 1
                store.load_row(row, np.arange(slot, slot + m, dtype=np.int64), values,
                               prev_slot if prev_slot == before else -1)
                prev_slot = slot + m - 1


def start_mask(reader: AnyPartReader, period: int, steps: int) -> np.ndarray:
    """Whether each of the ``steps`` saved steps of a part saved with ``period`` has a
    start row (bool ``[steps]``).

    Raises:
        CheckpointFormatError: the part lacks its episode offsets, or they do not cover
            its steps.
    """
    if period == 1:
        return np.ones(steps, np.bool_)
    offsets = reader.array("episode_step")
    if offsets.shape != (steps,):
        raise CheckpointFormatError(f"{reader.path}: episode_step does not cover the {steps} saved steps")
    return np.asarray(offsets % period == 0)


def _read_starts(readers: Sequence[AnyPartReader], periods: Sequence[int],
                runs: Sequence[tuple[int, int, int, int]], session: RestoreSession) -> None:
    """Read the start rows of the ``at_starts`` fields for ``runs`` of saved steps and
    place those of the new buffer's start steps (a part holds a row per step
    :func:`start_mask` marks, so a run maps to one range of rows). Raises
    CheckpointFormatError for a part saved with a period the new one is no multiple of.
    """
    stores = session.start_fields()
    if not stores:
        return
    new_period = session.period
    masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for part in sorted({run[0] for run in runs}):
        reader, period = readers[part], periods[part]
        if new_period % period:
            raise CheckpointFormatError(
                f"{reader.path}: saved with period={period}, so its start fields "
                f"{sorted(stores)} hold rows only every {period} steps of an episode; restore it into "
                f"a buffer whose period is a multiple of {period} (this one has {new_period})")
        steps = int(reader.array("row_length").sum())
        mask = start_mask(reader, period, steps)
        masks[part] = (mask, np.concatenate([[0], np.cumsum(mask)]))
    for name, f in stores.items():
        slots, values = [], []
        for part, first, lo, n in runs:
            mask, before = masks[part]
            rows = np.empty((int(before[first + n] - before[first]), *f.shape), f.dtype)
            readers[part].rows_into(f"field.{name}", int(before[first]), rows)
            slots.append(lo + np.flatnonzero(mask[first:first + n]))
            values.append(rows)
        session.place_starts(name, np.concatenate(slots) if slots else np.zeros(0, np.int64),
                             np.concatenate(values) if values else np.zeros((0, *f.shape), f.dtype))
