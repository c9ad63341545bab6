"""Checkpoint directories, part descriptions, manifests and completeness: the files of a
checkpoint, and what *complete* means: docs/semantics.md, "Checkpoints" (the files) and
"Complete means checksums too" (:func:`check_complete`).
"""

from __future__ import annotations

import json
import re
import time
import zlib
from pathlib import Path
from typing import Any

from shardreplay._hashing import xxh64
from shardreplay._io import atomic_write_bytes
from shardreplay.checkpoint.format import PartReader
from shardreplay.checkpoint.records import FORMAT, READ_VERSIONS, FileEntry, Manifest, ManifestPart
from shardreplay.errors import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointFormatError,
    IncompleteCheckpointError,
)

_DIR_RE = re.compile(r"^ckpt-(\d+)$")
INCOMPLETE_DIR = "incomplete"  # under a checkpoint root: incomplete checkpoints set aside


def checkpoint_dir(root: Path, checkpoint_id: int) -> Path:
    """Directory of checkpoint ``checkpoint_id`` under ``root``."""
    return Path(root) / f"ckpt-{checkpoint_id:010d}"


def part_name(shard: int, num_shards: int) -> str:
    """File stem of part ``shard`` of ``num_shards``."""
    return f"part-{shard:05d}-of-{num_shards:05d}"


def dump_checked(path: Path, body: dict[str, Any]) -> FileEntry:
    """Write ``body`` as JSON with a CRC32 of its canonical text, atomically; returns the
    file's size and XXH64 (for the manifest's ``files``)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    data = json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}, sort_keys=True, indent=1).encode()
    return write_covered(path, data)


def write_covered(path: Path, data: bytes) -> FileEntry:
    """Write ``data`` to ``path`` atomically; its size and XXH64 (for the manifest)."""
    atomic_write_bytes(path, data)
    return file_entry(data)


def file_entry(data: bytes) -> FileEntry:
    """The size and XXH64 of a file's bytes."""
    return FileEntry(len(data), f"{xxh64(data):016x}")


def read_file(path: Path) -> bytes:
    """A checkpoint file's bytes.

    Raises:
        IncompleteCheckpointError: the file does not exist.
        CheckpointFormatError: it cannot be read.
    """
    try:
        return Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(f"{path}: missing") from exc
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc})") from exc


def check_bytes(path: Path, data: bytes, entry: FileEntry) -> bytes:
    """``data`` (the bytes of ``path``) when they have the size and XXH64 of ``entry``.

    Raises:
        CheckpointDamagedError: they do not (naming the file).
    """
    if len(data) != entry.bytes:
        raise CheckpointDamagedError(f"{path}: {len(data)} bytes, the manifest says {entry.bytes} "
                                     "(truncated or replaced)")
    if f"{xxh64(data):016x}" != entry.xxh64:
        raise CheckpointDamagedError(f"{path}: checksum mismatch (the file was changed or corrupted "
                                     "after the checkpoint was saved)")
    return data


def load_checked(path: Path, raw: bytes | None = None) -> dict[str, Any]:
    """The body of the JSON file ``path`` written by :func:`dump_checked`, its CRC
    verified (``raw``: its bytes, when read already).

    Raises:
        IncompleteCheckpointError: the file does not exist.
        CheckpointFormatError: unreadable, not JSON, CRC mismatch, another format or version.
    """
    if raw is None:
        raw = read_file(path)
    try:
        doc = json.loads(raw)
        body, crc = doc["body"], doc["crc32"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{path}: not a shardreplay checkpoint JSON file ({exc})") from exc
    if zlib.crc32(text.encode()) != crc or not isinstance(body, dict):
        raise CheckpointFormatError(f"{path}: checksum mismatch (the file was changed or corrupted)")
    if body.get("format") != FORMAT or body.get("version") not in READ_VERSIONS:
        raise CheckpointFormatError(f"{path}: format {body.get('format')!r} version "
                                    f"{body.get('version')!r}; this shardreplay reads {FORMAT!r} "
                                    f"versions {', '.join(map(str, READ_VERSIONS))}")
    return body


def list_checkpoints(root: Path) -> list[int]:
    """Ids of the checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _DIR_RE.match(p.name)) and p.is_dir())


def load_manifest(directory: Path) -> Manifest:
    """The manifest of a checkpoint directory, checked for structure (:func:`_check_part`;
    block hashes are not read here).

    Raises:
        IncompleteCheckpointError: the manifest, a part file or a part's description
            is missing.
        CheckpointFormatError: the manifest or a part's description is corrupt, they
            disagree, or a part has the wrong size (CheckpointDamagedError: a description
            differs from its recorded hash).
    """
    path = Path(directory) / "manifest.json"
    manifest = Manifest.parse(Path(directory), load_checked(path))
    for part in manifest.parts:
        _check_part(manifest, part)
    return manifest


def _check_part(manifest: Manifest, part: ManifestPart) -> None:
    """A part listed by the manifest: its file exists with the recorded size, its
    description (checked JSON, of the recorded hash) says what the manifest says (else
    it was saved again, or damaged, after the manifest), and so do its references."""
    directory, path = manifest.directory, manifest.path
    stem = part_name(part.shard, manifest.num_shards)
    if part.file != f"{stem}.safetensors":
        raise CheckpointFormatError(f"{path}: part {part.shard} names file "
                                    f"{part.file!r}, expected {stem}.safetensors")
    _check_size(directory / part.file, part.bytes, "part missing", "the manifest says")
    desc_path = directory / f"{stem}.json"
    raw = read_file(desc_path)
    entry = manifest.files.get(desc_path.name)
    if entry is None:
        raise CheckpointFormatError(f"{path}: does not cover {desc_path.name}")
    check_bytes(desc_path, raw, entry)
    if ManifestPart.parse(load_checked(desc_path, raw), desc_path) != part:
        raise CheckpointFormatError(f"{desc_path}: does not match the manifest's "
                                    "entry for this part (saved again after the manifest?)")
    for ref in part.refs:  # blocks are hashed as they are read, or by check_complete
        _check_size(ref.path(directory.parent), ref.bytes,
                    f"missing, and {directory.name} reads rows from it (an incremental checkpoint "
                    "needs the files it refers to)", f"{directory.name} refers to it as")


def _check_size(file: Path, size: int, missing: str, recorded: str) -> None:
    """Raise IncompleteCheckpointError (saying ``missing``) unless ``file`` exists, and
    CheckpointFormatError (naming who ``recorded`` the size) unless it has ``size`` bytes."""
    if not file.exists():
        raise IncompleteCheckpointError(f"{file}: {missing}")
    if file.stat().st_size != size:
        raise CheckpointFormatError(f"{file}: {file.stat().st_size} bytes, {recorded} {size} "
                                    "(truncated or replaced)")


def referenced_checkpoints(manifest: Manifest) -> set[str]:
    """The directory names of the earlier checkpoints whose files ``manifest``'s parts
    read rows from (pruning keeps them)."""
    return {ref.checkpoint for part in manifest.parts for ref in part.refs}


def read_covered(manifest: Manifest, name: str) -> bytes:
    """The bytes of file ``name`` of a checkpoint, verified against the manifest's
    ``files`` entry.

    Raises:
        IncompleteCheckpointError: the file is missing, or the manifest does not list it.
        CheckpointDamagedError: its size or hash differs from the manifest's.
    """
    path = manifest.directory / name
    entry = manifest.files.get(name)
    if entry is None:
        raise IncompleteCheckpointError(f"{path}: not part of checkpoint {manifest.directory.name} "
                                        f"(its manifest lists {sorted(manifest.files)})")
    return check_bytes(path, read_file(path), entry)


def check_complete(directory: Path, *, hashes: bool = True) -> Manifest:
    """The manifest of a complete checkpoint (docs/semantics.md, "Complete means checksums
    too"; ``hashes=False``: :func:`load_manifest`'s checks only).

    Raises:
        IncompleteCheckpointError: the manifest, a part or a description is missing.
        CheckpointFormatError: anything else wrong, naming the file and the reason.
    """
    directory = Path(directory)
    manifest = load_manifest(directory)
    if not hashes:
        return manifest
    for part in manifest.parts:
        with PartReader(directory / part.file, part) as reader:
            reader.verify_all()
        for ref in part.refs:
            with PartReader(ref.path(directory.parent), ref) as reader:
                reader.verify_all()
    descriptions = {f"{part_name(p.shard, manifest.num_shards)}.json" for p in manifest.parts}
    for name in sorted(set(manifest.files) - descriptions):  # the descriptions were checked above
        read_covered(manifest, name)
    return manifest


def incomplete_reason(directory: Path, *, hashes: bool = True, missing: bool = True) -> str | None:
    """None for a complete checkpoint (:func:`check_complete`), else why it is not;
    ``missing=False`` asks only whether it is *damaged* (None also when a part or the
    manifest is merely missing: a run stopped before every rank saved)."""
    try:
        check_complete(directory, hashes=hashes)
    except IncompleteCheckpointError as exc:
        return str(exc) if missing else None
    except CheckpointFormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"{directory}: cannot read it ({exc})"
    return None


def is_complete(directory: Path, *, hashes: bool = True) -> bool:
    """True when the checkpoint is complete (:func:`check_complete`)."""
    return incomplete_reason(directory, hashes=hashes) is None


def latest_complete(root: Path, *, hashes: bool = True) -> int | None:
    """Newest complete checkpoint id under ``root`` (:func:`check_complete`; ``hashes``:
    checksums included)."""
    return next((c for c in reversed(list_checkpoints(root))
                 if is_complete(checkpoint_dir(root, c), hashes=hashes)), None)


def set_aside(root: Path, ids: list[int] | None = None) -> tuple[list[int], Path | None]:
    """Move the checkpoints ``ids`` under ``root`` (None: every incomplete or damaged one)
    to ``root/incomplete/<UTC time>/``, out of the way of the ids a run saves; nothing is
    deleted (``shardreplay checkpoint inspect`` reads that directory as a root). Call it
    only while no run writes under ``root``. Returns the ids moved and the directory they
    went to (None when there were none).

    Raises:
        CheckpointError: a directory could not be moved (the message says which).
    """
    if ids is None:
        ids = [c for c in list_checkpoints(root) if not is_complete(checkpoint_dir(root, c))]
    if not ids:
        return [], None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = Path(root) / INCOMPLETE_DIR / stamp
    n = 1
    while target.exists():  # two set-asides within one second
        n += 1
        target = Path(root) / INCOMPLETE_DIR / f"{stamp}-{n}"
    try:
        target.mkdir(parents=True)
        for cid in ids:
            source = checkpoint_dir(root, cid)
            source.rename(target / source.name)
    except OSError as exc:
        raise CheckpointError(f"cannot move checkpoints of {root} to {target}: {exc}; "
                              "move or delete them by hand") from exc
    return ids, target
