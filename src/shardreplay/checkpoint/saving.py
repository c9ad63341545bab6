"""Saving a shard's part of a checkpoint, with no collective call.

Every rank calls :func:`save` on its own (periodically, on request, or from a crash or
SIGTERM handler); the checkpoint becomes complete when the last part is written.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.shard import Shard, shard_of_buffer
from shardreplay.checkpoint.episodes import PARTIAL_POLICIES, apply_partial_policy, continue_episodes
from shardreplay.checkpoint.format import PartReader, write_part
from shardreplay.checkpoint.manifest import (
    checkpoint_dir,
    dump_checked,
    file_entry,
    is_complete,
    list_checkpoints,
    load_checked,
    load_manifest,
    part_name,
    read_file,
    referenced_checkpoints,
    write_covered,
)
from shardreplay.checkpoint.records import (
    CHAINABLE_STEPS,
    FileEntry,
    Manifest,
    ManifestPart,
    PartMeta,
    RefSource,
    RestoreCounts,
)
from shardreplay.checkpoint.refs import (
    BLOCK,
    Chain,
    Segments,
    block_sources,
    chain_of,
    forget,
    full_segments,
    remember,
)
from shardreplay.checkpoint.refs import plan as plan_increment
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.sharded_buffer import internals_of
from shardreplay.errors import CheckpointError, ConfigError, ShardReplayError
from shardreplay.spec import Spec

log = logging.getLogger("shardreplay.checkpoint.save")  # the name users filter on
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def shard_of(buffer: ReplayBuffer | ShardedReplayBuffer) -> tuple[ReplayBuffer, int, int]:
    """``(local buffer, shard index, number of shards)`` without any collective."""
    if isinstance(buffer, ShardedReplayBuffer):
        return buffer.local, buffer.rank, buffer.world_size
    if isinstance(buffer, ReplayBuffer):
        return buffer, 0, 1
    raise ConfigError(f"expected a ReplayBuffer or ShardedReplayBuffer, got {type(buffer).__name__}")


def save(buffer: ReplayBuffer | ShardedReplayBuffer, path: str | Path, checkpoint_id: int, *,
         partial: str = "seal", keep_last: int | None = 2, files: Mapping[str, bytes] | None = None,
         incremental: bool = False) -> Path:
    """Write this shard's part of checkpoint ``checkpoint_id`` (>= 0, usually the training
    step) under the root ``path`` (shared by all ranks); the checkpoint directory.
    ``buffer``: a ReplayBuffer or this rank's ShardedReplayBuffer; ``partial``: ``"seal"``
    or ``"drop"`` partial episodes; ``keep_last``: complete checkpoints to keep (None:
    all); ``files``: named files (name -> bytes) stored beside the buffer, covered by the
    manifest (``load(..., files=...)`` returns them verified); ``incremental``: write only
    the rows new since this shard's previous part, when that can be. What a part holds,
    pruning and incremental parts: docs/semantics.md, "Checkpoints". An id already
    complete is not written again (a warning); a background save of this shard in flight
    is waited for first.

    Raises:
        ConfigError: a bad argument (nothing is written).
        CheckpointError: the files could not be written (the previous complete
            checkpoints are untouched), or the buffer's restore did not finish (a
            failed or interrupted ``load``: a checkpoint of it would lose data).
    """
    job = prepare(buffer, path, checkpoint_id, partial=partial, keep_last=keep_last, files=files,
                  incremental=incremental)
    return job.directory if job.skip else run(job)


@dataclass
class SaveJob:
    """A save checked by :func:`prepare` and not yet written: its content is read when
    :func:`write` runs (in the caller, or in a background save's forked child, whose
    memory is the buffer as it was at the fork)."""

    directory: Path
    skip: bool  # already complete: nothing to write
    shard: Shard | None = None
    index: int = 0
    num_shards: int = 1
    checkpoint_id: int = 0
    partial: str = "seal"
    sharding: dict[str, Any] | None = None
    start: np.ndarray | None = None  # the first absolute step of each row the part writes itself
    chain: Chain | None = None  # the chain the part continues (refers to earlier files before ``start``)
    files: dict[str, bytes] = field(default_factory=dict)
    keep_last: int | None = 2
    segments: Segments | None = None  # the part's segment table, when it may start or continue a chain
    tick: int = 0  # the shard's updates_applied at the save: blocks marked later changed since


def prepare(buffer: ReplayBuffer | ShardedReplayBuffer, path: str | Path, checkpoint_id: int, *,
            partial: str, keep_last: int | None, files: Mapping[str, bytes] | None,
            incremental: bool) -> SaveJob:
    """Check the arguments and plan this shard's part (which rows it writes, which it
    takes from earlier files); :func:`write` writes it.

    Raises:
        ConfigError, CheckpointError: as :func:`save` (nothing is written).
    """
    local, index, num_shards = shard_of(buffer)
    if not isinstance(checkpoint_id, int | np.integer) or checkpoint_id < 0:
        raise ConfigError(f"checkpoint_id must be a non-negative integer, got {checkpoint_id!r}")
    if partial not in PARTIAL_POLICIES:
        raise ConfigError(f"partial must be one of {PARTIAL_POLICIES}, got {partial!r}")
    extra_files = _check_files(files)
    shard = shard_of_buffer(local)
    shard.wait_saved()  # one save of a shard at a time: the next waits for the previous
    pending = shard.pending_restore
    if pending is not None:
        raise CheckpointError(f"not saved: this shard's buffer does not hold what its run restored (the "
                              f"load of {pending} did not finish on every rank); a "
                              "checkpoint of it would lose that data. Load a checkpoint into it first")
    root = Path(path)
    directory = checkpoint_dir(root, int(checkpoint_id))
    if is_complete(directory, hashes=False):
        # Replacing the parts of a complete checkpoint one by one would leave it broken
        # (sizes and hashes no longer match its manifest) if a rank died half-way.
        log.warning("checkpoint %s under %s is already complete: not saved again (use a new "
                    "checkpoint_id to save the current content)", directory.name, path)
        return SaveJob(directory, True)
    sharding = internals_of(buffer).sharding_state() if isinstance(buffer, ShardedReplayBuffer) else None
    hi = shard.positions
    # A shard with start-only fields (a row per start step, not per step) saves full parts.
    chainable = incremental and partial == "seal" and not shard.start_names
    chain = chain_of(shard, root) if chainable else None
    segments: Segments | None
    if chain is not None:
        segments, start = plan_increment(chain, hi, shard.stream_capacity)
    else:
        segments = full_segments(hi, shard.stream_capacity) if chainable else None
        start = hi - np.minimum(hi, shard.stream_capacity)
    return SaveJob(directory, False, shard, index, num_shards, int(checkpoint_id), partial, sharding, start,
                   chain, extra_files, keep_last, segments, shard.updates_applied)


def note_restore(shard: Shard, counts: RestoreCounts) -> None:
    """``shard``'s content was restored (``counts``): every save of it records that,
    until its content is replaced otherwise."""
    shard.checkpoint_notes["restored"] = (shard.clears, counts)


def restored_from(shard: Shard) -> RestoreCounts | None:
    """The restore ``shard``'s content came from (None: not restored, or replaced since)."""
    clears, counts = shard.checkpoint_notes.get("restored", (None, None))
    return counts if clears == shard.clears else None


@dataclass
class _Content:
    """A part's arrays and description (all but its size and hashes), as of now."""

    arrays: dict[str, Any]
    empty_like: dict[str, np.ndarray]
    part: ManifestPart
    meta: PartMeta
    spec: Spec


def _content(job: SaveJob) -> _Content:
    """The part's arrays and description as the shard is now (views into storage: valid
    until the next write)."""
    shard, start = job.shard, job.start
    assert shard is not None and start is not None
    state = shard.export(None if job.chain is None else start)  # a chained part: its own steps
    if job.chain is not None and job.segments is not None:  # a chained part (a chain always has segments)
        with PartReader(job.chain.own.path(job.directory.parent), job.chain.own) as previous:
            arrays, episodes, report = continue_episodes(previous, state["arrays"], start, shard)
        arrays.update({**job.segments.as_arrays(), **_priority_blocks(job)})
    else:
        starts = [f"field.{n}" for n in shard.start_names]
        is_start = shard.stored_start_flags() if starts else None
        arrays, episodes, report = apply_partial_policy(state["arrays"], job.partial, starts, is_start)
    empty_like = {f"field.{k}": v for k, v in shard.fields.items()}
    empty_like.update({f"field.{k}": shard.stacked_template(k) for k in shard.stacked_names})
    part = ManifestPart(  # its size, block hashes and time (0, (), 0) are set when written
        job.checkpoint_id, job.index, job.num_shards, f"{part_name(job.index, job.num_shards)}.safetensors",
        0, (), int(arrays["row_length"].sum()), int(episodes.start.shape[0]), job.partial, report,
        restored_from(shard), shard.spec.fingerprint, 0,
        refs=job.segments.sources if job.chain is not None and job.segments is not None else (),
        chained=job.chain is not None,
        chained_steps=tuple(k for k in CHAINABLE_STEPS if k in arrays) if job.chain is not None else ())
    return _Content(_ordered(arrays), empty_like, part, PartMeta.of_state(state["meta"], job.sharding),
                    shard.spec)


def run(job: SaveJob) -> Path:
    """Write a prepared part in this thread (:func:`write`) and let the shard's next
    incremental save continue from it.

    Raises:
        CheckpointError: the files could not be written (the previous complete
            checkpoints are untouched).
    """
    shard = job.shard
    assert shard is not None
    try:
        part = write(job)
    except CheckpointError:
        forget(shard, job.directory.parent)
        raise
    written(job, part)
    return job.directory


def write(job: SaveJob) -> ManifestPart:
    """Read the part's content from the shard as it is now and write it, the manifest
    when this part is the last, then prune (no change to the shard: :func:`written`
    records the part afterwards).

    Raises:
        CheckpointError: the files could not be written (the previous complete
            checkpoints are untouched).
    """
    directory, started = job.directory, time.perf_counter()
    content = _content(job)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        files = {name: write_covered(directory / name, data) for name, data in job.files.items()}
        part, entry = _write_part(job, content, files)
        wrote_manifest = _maybe_write_manifest(directory, content.spec, part, entry)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {directory}: {exc}") from exc
    log.info("checkpoint %s: shard %d/%d saved %d steps, %d episodes in %.2f s (%s%s)%s", directory.name,
             part.shard, part.num_shards, part.steps, part.episodes, time.perf_counter() - started,
             _partial_text(part.partial), _refs_text(part), _restored_text(part.restored))
    if wrote_manifest and job.keep_last is not None:
        _prune(directory.parent, job.checkpoint_id, job.keep_last)
    return part


def written(job: SaveJob, part: ManifestPart) -> None:
    """``part`` of ``job`` is written: an incremental save continues from it."""
    shard, segments, start = job.shard, job.segments, job.start
    if shard is not None and segments is not None and start is not None:
        own = RefSource(job.directory.name, part.file, part.bytes, part.block_xxh64)
        prio = np.full(shard.priority_marks.shape, -1, np.int8) if job.chain is None else \
            block_sources(shard, job.chain, segments, start)  # a superset of the part's: as good
        remember(shard, job.directory.parent, own, segments, job.tick, prio)


def _priority_blocks(job: SaveJob) -> dict[str, np.ndarray]:
    """The priorities of the blocks changed since the chain's previous part (as the shard
    is now: ``prio.block``, ``prio.values``), and where every block is (``prio.source``)."""
    shard, chain, segments, start = job.shard, job.chain, job.segments, job.start
    assert shard is not None and chain is not None and segments is not None and start is not None
    source = block_sources(shard, chain, segments, start)
    blocks, prio = np.flatnonzero(source < 0), shard.arrays()["priority"]
    short = -prio.shape[0] % BLOCK  # slots missing from the last block (a copy: rare)
    whole = np.concatenate((prio, np.zeros(short, np.float32))) if short else prio
    return {"prio.block": blocks, "prio.values": whole.reshape(-1, BLOCK)[blocks].reshape(-1),
            "priority": prio[:0].copy(), "prio.source": source}


def _refs_text(part: ManifestPart) -> str:
    if not part.refs:
        return ""
    return f"; incremental: {part.bytes} bytes, other rows in {len(part.refs)} earlier file(s)"


def _check_files(files: Mapping[str, bytes] | None) -> dict[str, bytes]:
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise ConfigError(f"files must map file names to bytes, got {type(files).__name__}")
    out = {}
    for name, data in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name == "manifest.json" or \
                name.startswith("part-"):
            raise ConfigError(f"files: {name!r} is not a plain file name of its own (letters, digits, "
                              "'.', '_', '-'; not manifest.json or part-*)")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ConfigError(f"files: {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out


def _write_part(job: SaveJob, content: _Content,
                files: dict[str, FileEntry]) -> tuple[ManifestPart, FileEntry]:
    """Write the part file, then its description; the part as described, and the
    description's size and hash (for the manifest's ``files``)."""
    size, hashes = write_part(job.directory / content.part.file, content.arrays,
                              {"buffer_meta": content.meta.as_text()}, empty_like=content.empty_like)
    # An integer: a float's last digit can change without changing its value.
    part = replace(content.part, bytes=size, block_xxh64=hashes,
                   created_unix_ms=int(time.time() * 1000), files=dict(sorted(files.items())))
    stem = part_name(job.index, job.num_shards)
    return part, dump_checked(job.directory / f"{stem}.json", part.description(content.spec))


def _ordered(arrays: dict[str, Any]) -> dict[str, Any]:
    """Small bookkeeping arrays first, so readers of the tables touch few blocks."""
    return dict(sorted(arrays.items(), key=lambda item: item[0].startswith("field.")))  # stable


def _maybe_write_manifest(directory: Path, spec: Spec, mine: ManifestPart, entry: FileEntry) -> bool:
    """Write the manifest when every other part's description is there (this rank
    finished last), listing each as its description says; False when one is missing,
    unreadable, or of another checkpoint id or spec (that rank writes it, or nobody)."""
    parts: list[ManifestPart] = []
    covered: dict[str, FileEntry] = {}
    for shard in range(mine.num_shards):
        path = directory / f"{part_name(shard, mine.num_shards)}.json"
        if shard == mine.shard:
            parts.append(mine)
            covered[path.name] = entry
            continue
        try:
            raw = read_file(path)
            other = ManifestPart.parse(load_checked(path, raw), path)
        except ShardReplayError:
            return False  # that shard has not finished (or failed): it writes the manifest
        if (other.checkpoint_id, other.spec_fingerprint, other.shard) != \
                (mine.checkpoint_id, mine.spec_fingerprint, shard):
            log.warning("checkpoint %s: part %d was saved with another id or spec; no manifest",
                        directory.name, shard)
            return False
        parts.append(other)
        covered[path.name] = file_entry(raw)
    manifest = Manifest.of_parts(directory, spec, parts, covered)
    dump_checked(manifest.path, manifest.as_json())
    log.info("checkpoint %s complete: %d shards, %d steps (%s)%s", directory.name, manifest.num_shards,
             manifest.steps, _partial_text(manifest.partial), _restored_text(manifest.restored))
    return True


def _restored_text(restored: RestoreCounts | None) -> str:
    if restored is None:
        return ""
    return (f"; restored from checkpoint {restored.checkpoint_id} ({restored.saved_steps} steps "
            f"saved, {restored.steps} restored): dropped {restored.dropped_episodes} episodes "
            f"({restored.dropped_steps} steps), sealed {restored.sealed_episodes} episodes "
            f"({restored.sealed_steps} steps)")


def _prune(root: Path, newest: int, keep_last: int) -> None:
    # Newest first, only until keep_last complete ones (not the whole chain); no hashes: a load skips damage.
    complete = (c for c in reversed(list_checkpoints(root))
                if c <= newest and is_complete(checkpoint_dir(root, c), hashes=False))
    keep = set(islice(complete, max(keep_last, 1)))
    needed = _referenced(root, keep)
    for cid in list_checkpoints(root):
        if cid < newest and cid not in keep and checkpoint_dir(root, cid).name not in needed:
            shutil.rmtree(checkpoint_dir(root, cid), ignore_errors=True)


def _referenced(root: Path, keep: set[int]) -> set[str]:
    """The checkpoints whose files the kept ones read rows from (never pruned). A kept
    checkpoint that cannot be read protects every older one: better kept than broken."""
    out: set[str] = set()
    for cid in keep:
        try:
            out |= referenced_checkpoints(load_manifest(checkpoint_dir(root, cid)))
        except (ShardReplayError, OSError):
            return {checkpoint_dir(root, c).name for c in list_checkpoints(root)}
    return out


def _partial_text(report: Mapping[str, int]) -> str:
    return (f"partial episodes: {report['partial_episodes']} ({report['partial_steps']} steps), "
            f"sealed {report['sealed_episodes']} ({report['sealed_steps']} steps), "
            f"dropped {report['dropped_episodes']} ({report['dropped_steps']} steps)")
