"""Describe (:func:`summarize`: the descriptions and each part's priority array) and verify
(:func:`verify`: every byte) checkpoints, for ``shardreplay checkpoint inspect|verify``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay.buffer.shard import STEP_ARRAYS
from shardreplay.buffer.state import expected_arrays
from shardreplay.checkpoint.loading import episode_table, start_mask
from shardreplay.checkpoint.manifest import (
    check_complete,
    checkpoint_dir,
    list_checkpoints,
    load_checked,
    load_manifest,
)
from shardreplay.checkpoint.records import ManifestPart, PartMeta
from shardreplay.checkpoint.refs import AnyPartReader, open_part
from shardreplay.errors import CheckpointError, CheckpointFormatError
from shardreplay.spec import Spec

_PART_JSON = re.compile(r"^part-(\d+)-of-(\d+)\.json$")


def is_checkpoint_dir(path: Path) -> bool:
    """True when ``path`` looks like one checkpoint (``ckpt-<id>`` or has a manifest)."""
    return (path / "manifest.json").exists() or re.fullmatch(r"ckpt-\d+", path.name) is not None


def list_status(root: Path) -> list[dict[str, Any]]:
    """Every checkpoint under ``root``, oldest first: id, directory, completeness, reason."""
    out = []
    for cid in list_checkpoints(root):
        directory = checkpoint_dir(root, cid)
        entry: dict[str, Any] = {"checkpoint_id": cid, "directory": str(directory)}
        try:
            manifest = check_complete(directory)
            entry.update(complete=True, num_shards=manifest.num_shards, steps=manifest.steps,
                         episodes=manifest.episodes)
        except CheckpointError as exc:
            entry.update(complete=False, reason=str(exc))
        out.append(entry)
    return out


def summarize(directory: Path, *, priorities: bool = True) -> dict[str, Any]:
    """A description of one checkpoint: shards, steps, episodes, partial-episode counts,
    priority summary (min/mean/max of stored priorities), the files saved beside the
    buffer, completeness.

    An incomplete checkpoint is described from the part descriptions that exist.
    """
    directory = Path(directory)
    try:
        manifest = load_manifest(directory)
    except CheckpointError as exc:
        return _summarize_incomplete(directory, str(exc))
    parts = manifest.parts
    rows = []
    stats = []
    for part in parts:
        row: dict[str, Any] = {"shard": part.shard, "steps": part.steps, "episodes": part.episodes,
                               "bytes": part.bytes, "partial": dict(part.partial),
                               "restored": None if part.restored is None else part.restored.as_dict()}
        if priorities:
            with open_part(directory, part) as reader:
                prio = reader.array("priority")
            row["priority"] = _stats(prio)
            stats.append(prio)
        rows.append(row)
    out = {"checkpoint_id": manifest.checkpoint_id, "directory": str(directory), "complete": True,
           "num_shards": manifest.num_shards, "steps": manifest.steps,
           "episodes": manifest.episodes, "partial_policy": sorted({p.partial_policy for p in parts}),
           "partial": dict(manifest.partial),
           "restored": None if manifest.restored is None else manifest.restored.as_dict(),
           "spec": manifest.spec.to_dict(),
           "spec_fingerprint": manifest.spec_fingerprint,
           "bytes": sum(p.bytes for p in parts), "files": {k: v.as_json() for k, v in manifest.files.items()},
           "parts": rows}
    if priorities:
        out["priority"] = _stats(np.concatenate(stats) if stats else np.empty(0, np.float32))
    return out


def _summarize_incomplete(directory: Path, reason: str) -> dict[str, Any]:
    present: list[dict[str, Any]] = []
    for path in sorted(p for p in directory.glob("part-*.json") if _PART_JSON.match(p.name)):
        try:
            part = ManifestPart.parse(load_checked(path), path)
            present.append({"shard": part.shard, "num_shards": part.num_shards, "steps": part.steps,
                            "episodes": part.episodes, "bytes": part.bytes})
        except CheckpointError as exc:
            present.append({"file": path.name, "error": str(exc)})
    return {"directory": str(directory), "complete": False, "reason": reason, "parts_present": present}


def verify(directory: Path) -> dict[str, Any]:
    """Check one checkpoint completely: the manifest and part descriptions (their CRCs and
    that they agree), every block hash, the arrays a loader needs (names, dtypes, shapes
    against the spec) and the episode tables; its id, shards, steps, bytes, blocks and files.

    Raises:
        IncompleteCheckpointError: the manifest, a part or a description is missing.
        CheckpointFormatError: anything else wrong, with the file and the reason.
    """
    directory = Path(directory)
    manifest = check_complete(directory)  # the rule train --resume uses
    blocks = 0
    for part in manifest.parts:
        with open_part(directory, part) as reader:
            blocks += len(part.block_xxh64)
            _check_arrays(reader, manifest.spec, part)
    total = sum(p.steps for p in manifest.parts)
    if total != manifest.steps:
        raise CheckpointFormatError(f"{manifest.path}: steps {manifest.steps} != the parts' sum {total}")
    return {"checkpoint_id": manifest.checkpoint_id, "num_shards": manifest.num_shards,
            "steps": total, "bytes": sum(p.bytes for p in manifest.parts), "blocks": blocks,
            "files": len(manifest.files)}


def _check_arrays(reader: AnyPartReader, spec: Spec, part: ManifestPart) -> None:
    steps = starts = part.steps
    period = PartMeta.parse(reader.metadata.get("buffer_meta", ""), reader.path).period
    if any(f.at_starts for f in spec.fields.values()):  # a row per saved start step only
        starts = int(start_mask(reader, period, steps).sum())
    for name, (dtype, shape) in expected_arrays(spec, STEP_ARRAYS, steps, starts).items():
        got = reader.entry(name)
        if got != (dtype, shape):
            raise CheckpointFormatError(f"{reader.path}: array {name!r} is {got[0]}{list(got[1])}, "
                                        f"expected {dtype}{list(shape)}")
    if int(reader.array("row_length").sum()) != steps:
        raise CheckpointFormatError(f"{reader.path}: row lengths do not add up to {steps} steps")
    episodes = episode_table([reader])
    if len(episodes) != part.episodes or int(episodes.length.sum()) != steps:
        raise CheckpointFormatError(f"{reader.path}: the episode table does not cover the {steps} steps")


def _stats(values: np.ndarray) -> dict[str, float | int | None]:
    if values.size == 0:
        return {"count": 0, "min": None, "mean": None, "max": None}
    v = values.astype(np.float64)
    return {"count": int(v.size), "min": float(v.min()), "mean": float(v.mean()), "max": float(v.max())}

