"""Saving a shard's part of a checkpoint, with no collective call.

Every rank calls :func:`save` on its own (periodically, on request, or from a crash or
SIGTERM handler); the checkpoint becomes complete when the last part is written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay._io import atomic_write_bytes
from shardreplay.buffer.fence import WriteFence
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.shard import Shard, shard_of_buffer
from shardreplay.checkpoint.episodes import PARTIAL_POLICIES, apply_partial_policy
from shardreplay.checkpoint.format import write_part
from shardreplay.checkpoint.incremental import Segments, chain_of, forget, full_segments, remember
from shardreplay.checkpoint.incremental import plan as plan_increment
from shardreplay.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    INCREMENTAL_VERSION,
    checkpoint_dir,
    dump_checked,
    file_entry,
    is_complete,
    list_checkpoints,
    load_manifest,
    parse_checked,
    part_name,
    read_file,
    referenced_checkpoints,
)
from shardreplay.checkpoint.records import FileEntry, RestoreCounts
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.internals import internals_of
from shardreplay.errors import CheckpointError, ConfigError, ShardReplayError

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
         partial: str = "seal", extra: dict[str, Any] | None = None,
         keep_last: int | None = 2, restored: Mapping[str, int] | None = None,
         files: Mapping[str, bytes] | None = None, incremental: bool = False) -> Path:
    """Write this shard's part of checkpoint ``checkpoint_id`` under ``path``.

    Only stored steps are written (not the allocated capacity), with their priorities,
    step types, discounts, episode ids and generations, the stream bookkeeping, the
    sampler state, the RNG state and counters. Partial episodes are sealed or dropped
    (``partial``); the counts are logged and recorded in the manifest. The last shard
    to finish writes the manifest, which completes the checkpoint, and then removes
    complete checkpoints older than the newest ``keep_last`` (None keeps all), except
    those whose files a kept checkpoint refers to.

    Args:
        buffer: a ReplayBuffer (one shard) or this rank's ShardedReplayBuffer.
        path: the checkpoint root directory (shared by all ranks).
        checkpoint_id: a non-negative integer, usually the training step.
        partial: ``"seal"`` (default) or ``"drop"``.
        extra: JSON-ready data stored with the checkpoint (e.g. the training step).
        keep_last: complete checkpoints to keep.
        restored: what this shard's content was restored from, when it was
            (``LoadReport.counts()``): recorded in its part and summed in the manifest,
            so a checkpoint says what its run lost on the way from the one it came from.
        files: other files to store in the checkpoint (name -> bytes; plain names, e.g.
            the runtime's ``learner_state.pt``), written before this rank's part and
            covered by the manifest (size and XXH64): ``load(..., files=...)`` returns
            them verified.
        incremental: write only the user-field rows stored since this shard's previous
            part under ``path`` (when that checkpoint is complete and this process saved
            it), referring to the earlier part files for the rest (format version 3;
            see :mod:`shardreplay.checkpoint.incremental`); else a full part as without it.

    Returns:
        The checkpoint directory.

    Raises:
        ConfigError: a bad argument (nothing is written).
        CheckpointError: the files could not be written (the previous complete
            checkpoints are untouched).

    A checkpoint id that is already complete is not written again (a warning is
    logged): replacing its parts one by one could break the only good checkpoint.
    A buffer whose restore did not finish (a failed or interrupted :func:`load`; it is
    empty or holds only this rank's share of a restore the ranks did not agree on) is
    refused with a CheckpointError, so no checkpoint completes without the data the
    run should hold. A background save of this shard still writing
    (:func:`~shardreplay.checkpoint.background.save_in_background`) is waited for first.
    """
    job = prepare(buffer, path, checkpoint_id, partial=partial, extra=extra, keep_last=keep_last,
                  restored=restored, files=files, incremental=incremental, background=False)
    return job.directory if job.skip else run(job)


@dataclass
class SaveJob:
    """A save whose content is fixed (taken at :func:`prepare`) and not yet written."""

    directory: Path
    skip: bool  # already complete: nothing to write
    shard: Shard | None = None
    index: int = 0
    num_shards: int = 1
    checkpoint_id: int = 0
    arrays: dict[str, Any] = field(default_factory=dict)
    empty_like: dict[str, np.ndarray] = field(default_factory=dict)
    desc: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    keep_last: int | None = 2
    counts: RestoreCounts | None = None
    segments: Segments | None = None  # the part's segment table, when it may start or continue a chain
    fence: WriteFence | None = None


def prepare(buffer: ReplayBuffer | ShardedReplayBuffer, path: str | Path, checkpoint_id: int, *,
            partial: str, extra: dict[str, Any] | None, keep_last: int | None,
            restored: Mapping[str, int] | None, files: Mapping[str, bytes] | None,
            incremental: bool, background: bool) -> SaveJob:
    """Check the arguments and fix the content of this shard's part now (in the calling
    thread); :func:`run` writes it. With ``background`` the user fields are read later
    through a write fence (:mod:`shardreplay.buffer.fence`), which :func:`run` releases.

    Raises:
        ConfigError, CheckpointError: as :func:`save` (nothing is written, no fence held).
    """
    local, index, num_shards = shard_of(buffer)
    if not isinstance(checkpoint_id, int | np.integer) or checkpoint_id < 0:
        raise ConfigError(f"checkpoint_id must be a non-negative integer, got {checkpoint_id!r}")
    if partial not in PARTIAL_POLICIES:
        raise ConfigError(f"partial must be one of {PARTIAL_POLICIES}, got {partial!r}")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"extra must be a dict of JSON-ready values, got {type(extra).__name__}")
    extra = dict(extra or {})
    _check_json(extra)
    counts = None if restored is None else RestoreCounts.from_counts(restored)
    extra_files = _check_files(files)
    shard = shard_of_buffer(local)
    shard.wait_fence()  # one save of a shard at a time: the next waits for the previous
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
    job = SaveJob(directory, False, shard, index, num_shards, int(checkpoint_id), files=extra_files,
                  keep_last=keep_last, counts=counts)
    _fix_content(job, root, partial, extra, sharding, incremental, background)
    return job


def _fix_content(job: SaveJob, root: Path, partial: str, extra: dict[str, Any],
                 sharding: dict[str, Any] | None, incremental: bool, background: bool) -> None:
    """The part's arrays and description (all but its size and hashes), as of now."""
    shard = job.shard
    assert shard is not None
    state = shard.export()
    hi = state["arrays"]["row_pos"]
    # Start rows (not one row per step): full parts.
    chained = partial == "seal" and not shard.start_names
    chain = chain_of(shard, root) if incremental and chained else None
    if chain is not None:
        job.segments, start = plan_increment(chain, hi, shard.stream_capacity)
    else:
        job.segments = full_segments(hi, shard.stream_capacity) if incremental and chained else None
        start = hi - np.minimum(hi, shard.stream_capacity)
    names = list(shard.fields)
    if background:  # frame-stacked fields too: their frame rings are fenced (buffer/frame_fence.py)
        names += list(shard.stacked_names)
        job.fence = shard.take_fence(names, start)
        state["arrays"].update({f"field.{n}": job.fence.pieces(n) for n in names})
    elif chain is not None:
        state["arrays"].update({f"field.{n}": _views(shard.fields[n], start, hi, shard.stream_capacity)
                                for n in names})
        state["arrays"].update({f"field.{n}": pieces for n, pieces in shard.stacked_since(start).items()})
    starts = [f"field.{n}" for n in shard.start_names]
    is_start = shard.stored_start_flags() if starts else None
    arrays, episodes, report = apply_partial_policy(state["arrays"], partial, starts, is_start)
    arrays.update(episodes.as_arrays())
    if partial == "seal":
        arrays.update(_seal_undo(state["arrays"], arrays))
    if chain is not None and job.segments is not None:
        arrays.update(job.segments.as_arrays())
    meta = dict(state["meta"])
    if sharding is not None:
        meta["sharding"] = sharding
    job.arrays, job.meta = _ordered(arrays), meta
    job.empty_like = {f"field.{k}": v for k, v in shard.fields.items()}
    job.empty_like.update({f"field.{k}": shard.stacked_template(k) for k in shard.stacked_names})
    name = part_name(job.index, job.num_shards)
    job.desc = {
        "format": FORMAT, "version": FORMAT_VERSION, "checkpoint_id": job.checkpoint_id,
        "shard": job.index, "num_shards": job.num_shards, "file": f"{name}.safetensors",
        "steps": int(arrays["row_length"].sum()), "episodes": int(episodes.start.shape[0]),
        "partial_policy": partial, "partial": report,
        "restored": None if job.counts is None else job.counts.as_dict(), "spec": shard.spec.to_dict(),
        "spec_fingerprint": shard.spec.fingerprint, "extra": extra,
    }
    if chain is not None and job.segments is not None:  # only then: a full part is described as before
        job.desc["version"] = INCREMENTAL_VERSION
        job.desc["refs"] = [s.as_json() for s in job.segments.sources]


def _views(arr: np.ndarray, start: np.ndarray, hi: np.ndarray, cap: int) -> list[np.ndarray]:
    """Views of ``arr`` holding steps ``[start_r, hi_r)`` of each row in time order."""
    pieces = []
    for r in range(hi.shape[0]):
        a, n = int(start[r]), int(hi[r] - start[r])
        s = a % cap
        head = min(n, cap - s)
        pieces += [arr[r * cap + s:r * cap + s + head], arr[r * cap:r * cap + n - head]]
    return [p for p in pieces if p.shape[0]]


def run(job: SaveJob) -> Path:
    """Write a prepared part (any thread), the manifest when it is the last, then prune.
    Releases the job's fence, whatever happens.

    Raises:
        CheckpointError: the files could not be written (the previous complete
            checkpoints are untouched).
    """
    shard = job.shard
    assert shard is not None
    try:
        return _write(job, shard)
    finally:  # released last: the next save of this shard sees this one's chain and pruning done
        if job.fence is not None:
            shard.release_fence(job.fence)


def _write(job: SaveJob, shard: Shard) -> Path:
    directory, started = job.directory, time.perf_counter()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        written = {name: _write_file(directory / name, data) for name, data in job.files.items()}
        desc = _write_part(job, written)
        wrote_manifest = _maybe_write_manifest(directory, job.num_shards, desc)
    except OSError as exc:
        forget(shard, directory.parent)
        raise CheckpointError(f"cannot write checkpoint {directory}: {exc}") from exc
    root = directory.parent
    if job.segments is not None:  # an incremental save: the next one continues from this part
        remember(shard, root, directory, desc["file"], desc, job.segments)
    log.info("checkpoint %s: shard %d/%d saved %d steps, %d episodes in %.2f s (%s%s)%s", directory.name,
             job.index, job.num_shards, desc["steps"], desc["episodes"], time.perf_counter() - started,
             _partial_text(desc["partial"]), _refs_text(desc), _restored_text(job.counts))
    if wrote_manifest and job.keep_last is not None:
        _prune(root, job.checkpoint_id, job.keep_last)
    return directory


def _refs_text(desc: dict[str, Any]) -> str:
    if not desc.get("refs"):
        return ""
    return f"; incremental: {desc['bytes']} bytes, other rows in {len(desc['refs'])} earlier file(s)"


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


def _write_file(path: Path, data: bytes) -> FileEntry:
    """Write one of ``save``'s ``files`` atomically; its size and XXH64 for the manifest."""
    atomic_write_bytes(path, data)
    return file_entry(data)


def _write_part(job: SaveJob, files: dict[str, FileEntry]) -> dict[str, Any]:
    name = part_name(job.index, job.num_shards)
    info = write_part(job.directory / f"{name}.safetensors", job.arrays,
                      {"buffer_meta": json.dumps(job.meta)}, empty_like=job.empty_like)
    desc = dict(job.desc)
    refs = desc.pop("refs", None)
    desc.update(bytes=info["bytes"], block_xxh64=info["block_xxh64"])
    if refs is not None:
        desc["refs"] = refs
    # An integer: a float's last digit can change without changing its value.
    desc["created_unix_ms"] = int(time.time() * 1000)
    if files:  # only then: a part without files is described as before
        desc["files"] = {k: v.as_json() for k, v in sorted(files.items())}
    desc["_entry"] = dump_checked(job.directory / f"{name}.json", desc)
    return desc


def _seal_undo(before: dict[str, Any], after: dict[str, Any]) -> dict[str, np.ndarray]:
    """The step types and discounts that sealing changed, as they were (``seal.*``): a
    restore onto the same shards puts them back, so an ongoing episode goes on as if
    no checkpoint had been taken. Empty when nothing was sealed."""
    changed = np.flatnonzero((before["step_type"] != after["step_type"])
                             | (before["discount"] != after["discount"])).astype(np.int64)
    if not changed.shape[0]:
        return {}
    return {"seal.index": changed, "seal.step_type": before["step_type"][changed],
            "seal.discount": before["discount"][changed]}


def _ordered(arrays: dict[str, Any]) -> dict[str, Any]:
    """Small bookkeeping arrays first, so readers of the tables touch few blocks."""
    small = [k for k in arrays if not k.startswith("field.")]
    return {k: arrays[k] for k in small + [k for k in arrays if k.startswith("field.")]}


def _maybe_write_manifest(directory: Path, num_shards: int, mine: dict[str, Any]) -> bool:
    parts = []
    covered: dict[str, FileEntry] = {}
    for shard in range(num_shards):
        stem = part_name(shard, num_shards)
        if shard == mine["shard"]:
            parts.append({k: v for k, v in mine.items() if k != "_entry"})
            covered[f"{stem}.json"] = mine["_entry"]
            continue
        path = directory / f"{stem}.json"
        try:
            raw = read_file(path)
            other = parse_checked(path, raw)
        except ShardReplayError:
            return False  # that shard has not finished (or failed): it writes the manifest
        if (other.get("checkpoint_id"), other.get("spec_fingerprint")) != \
                (mine["checkpoint_id"], mine["spec_fingerprint"]):
            log.warning("checkpoint %s: part %d was saved with another id or spec; no manifest",
                        directory.name, shard)
            return False
        parts.append(other)
        covered[path.name] = file_entry(raw)
    manifest = {key: mine[key] for key in ("format", "version", "checkpoint_id", "num_shards", "spec",
                                           "spec_fingerprint", "extra")}
    # Version 3 when a part is incremental (a full checkpoint stays version 2, as before).
    manifest["version"] = max(int(p.get("version", FORMAT_VERSION)) for p in parts)
    manifest["parts"] = [{k: v for k, v in p.items() if k not in ("spec", "format", "version")}
                         for p in parts]
    manifest["steps"] = sum(p["steps"] for p in parts)
    manifest["episodes"] = sum(p["episodes"] for p in parts)
    manifest["partial"] = {k: sum(int(p["partial"][k]) for p in parts) for k in mine["partial"]}
    total = RestoreCounts.total([RestoreCounts.parse(p.get("restored"), directory) for p in parts])
    manifest["restored"] = None if total is None else total.as_dict()
    # Every file of the checkpoint but this one and the part files (hashed block by block).
    for p in parts:
        files = p.get("files", {})
        covered.update({k: FileEntry(int(v["bytes"]), str(v["xxh64"])) for k, v in files.items()})
    manifest["files"] = {k: v.as_json() for k, v in sorted(covered.items())}
    dump_checked(directory / "manifest.json", manifest)
    log.info("checkpoint %s complete: %d shards, %d steps (%s)%s", directory.name, num_shards,
             manifest["steps"], _partial_text(manifest["partial"]), _restored_text(total))
    return True


def _restored_text(restored: RestoreCounts | None) -> str:
    if restored is None:
        return ""
    return (f"; restored from checkpoint {restored.checkpoint_id} ({restored.saved_steps} steps "
            f"saved, {restored.steps} restored): dropped {restored.dropped_episodes} episodes "
            f"({restored.dropped_steps} steps), sealed {restored.sealed_episodes} episodes "
            f"({restored.sealed_steps} steps)")


def _prune(root: Path, newest: int, keep_last: int) -> None:
    # Structure only (no hashes): reading every kept checkpoint after each save would cost
    # more than the save; a load still passes over a damaged one.
    complete = [c for c in list_checkpoints(root)
                if c <= newest and is_complete(checkpoint_dir(root, c), hashes=False)]
    keep = set(complete[-max(keep_last, 1):])
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


def _partial_text(report: dict[str, int]) -> str:
    return (f"partial episodes: {report['partial_episodes']} ({report['partial_steps']} steps), "
            f"sealed {report['sealed_episodes']} ({report['sealed_steps']} steps), "
            f"dropped {report['dropped_episodes']} ({report['dropped_steps']} steps)")


def _check_json(extra: dict[str, Any]) -> None:
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"extra must be JSON-ready (numbers, strings, lists, dicts): {exc}") from exc

