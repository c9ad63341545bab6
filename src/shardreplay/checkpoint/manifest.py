"""Checkpoint directories, part descriptions, manifests and completeness.

Layout of a checkpoint ``<root>/ckpt-<id>/`` saved from M shards::

    part-00000-of-00003.safetensors   steps, priorities, episode table of shard 0
    part-00000-of-00003.json          its description: size, block hashes, counts
    ...
    manifest.json                     every part's description; written last

Each JSON file carries a CRC32 of its own body, so a flipped byte is caught. Each rank
writes its part and description, then the manifest if every description is there:
the last rank to finish writes it, without any collective call. A checkpoint is
**complete** when the manifest lists M parts, each part file has the size the
manifest records, each part's description agrees with the manifest, and every block
of every part has the XXH64 hash the manifest records: a bit flipped anywhere makes a
checkpoint incomplete. ``load``, ``shardreplay checkpoint verify``, ``train --resume``
and ``--auto-resume`` all use this one rule (:func:`check_complete`).
"""

from __future__ import annotations

import json
import re
import time
import zlib
from pathlib import Path
from typing import Any

from shardreplay._io import atomic_write_bytes
from shardreplay.checkpoint.format import PartReader
from shardreplay.errors import CheckpointError, CheckpointFormatError, IncompleteCheckpointError

FORMAT = "shardreplay-checkpoint"
FORMAT_VERSION = 2  # 2: XXH64 block hashes (1 had CRC32)
_DIR_RE = re.compile(r"^ckpt-(\d+)$")
INCOMPLETE_DIR = "incomplete"  # under a checkpoint root: incomplete checkpoints set aside


def checkpoint_dir(root: Path, checkpoint_id: int) -> Path:
    """Directory of checkpoint ``checkpoint_id`` under ``root``."""
    return Path(root) / f"ckpt-{checkpoint_id:010d}"


def part_name(shard: int, num_shards: int) -> str:
    """File stem of part ``shard`` of ``num_shards``."""
    return f"part-{shard:05d}-of-{num_shards:05d}"


def dump_checked(path: Path, body: dict[str, Any]) -> None:
    """Write ``body`` as JSON with a CRC32 of its canonical text, atomically."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    data = json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}, sort_keys=True, indent=1)
    atomic_write_bytes(path, data.encode())


def load_checked(path: Path) -> dict[str, Any]:
    """Read a JSON file written by :func:`dump_checked`, verifying its CRC.

    Raises:
        IncompleteCheckpointError: the file does not exist.
        CheckpointFormatError: unreadable, not JSON, or CRC mismatch.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise IncompleteCheckpointError(f"{path}: missing") from exc
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc})") from exc
    try:
        doc = json.loads(raw)
        body, crc = doc["body"], doc["crc32"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{path}: not a shardreplay checkpoint JSON file ({exc})") from exc
    if zlib.crc32(text.encode()) != crc or not isinstance(body, dict):
        raise CheckpointFormatError(f"{path}: checksum mismatch (the file was changed or corrupted)")
    if body.get("format") != FORMAT or body.get("version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: format {body.get('format')!r} version "
                                    f"{body.get('version')!r}; this shardreplay reads {FORMAT!r} "
                                    f"version {FORMAT_VERSION}")
    return body


def list_checkpoints(root: Path) -> list[int]:
    """Ids of the checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    ids = [int(m.group(1)) for p in root.iterdir() if (m := _DIR_RE.match(p.name)) and p.is_dir()]
    return sorted(ids)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked for shape and part files.

    Raises:
        IncompleteCheckpointError: the manifest, a part file or a part's description
            is missing.
        CheckpointFormatError: the manifest or a part's description is corrupt, they
            disagree, or a part has the wrong size.
    """
    path = Path(directory) / "manifest.json"
    manifest = load_checked(path)
    try:
        parts, num = manifest["parts"], int(manifest["num_shards"])
        shards = sorted(int(p["shard"]) for p in parts)
        if shards != list(range(num)):
            raise CheckpointFormatError(f"{path}: lists shards {shards}, expected 0..{num - 1}")
        for part in parts:
            _check_part(Path(directory), part, num, path)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"{path}: malformed manifest ({exc!r})") from exc
    return manifest


def _check_part(directory: Path, part: dict[str, Any], num_shards: int, manifest_path: Path) -> None:
    """A part listed by the manifest: its file exists with the recorded size, and its
    description (checked JSON) says what the manifest says."""
    stem = part_name(int(part["shard"]), num_shards)
    if part.get("file") != f"{stem}.safetensors":
        raise CheckpointFormatError(f"{manifest_path}: part {part['shard']} names file "
                                    f"{part.get('file')!r}, expected {stem}.safetensors")
    file = directory / part["file"]
    if not file.exists():
        raise IncompleteCheckpointError(f"{file}: part missing")
    if file.stat().st_size != int(part["bytes"]):
        raise CheckpointFormatError(f"{file}: {file.stat().st_size} bytes, the manifest says "
                                    f"{part['bytes']} (truncated or replaced)")
    # The part's own description must agree: a difference means the part was saved
    # again (or damaged) after the manifest was written.
    desc = load_checked(directory / f"{stem}.json")
    if any(desc.get(k) != v for k, v in part.items()):
        raise CheckpointFormatError(f"{directory / (stem + '.json')}: does not match the manifest's "
                                    "entry for this part (saved again after the manifest?)")


def check_complete(directory: Path, *, hashes: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint: :func:`read_manifest`'s checks, then (with
    ``hashes``) every block of every part against its recorded XXH64 hash.

    Hashing reads every byte once (at disk speed: XXH64 is faster than the reads); a
    checkpoint verified before in this process, whose files have the same sizes and
    modification times, is not read again.

    Raises:
        IncompleteCheckpointError: the manifest, a part or a description is missing.
        CheckpointFormatError: anything else wrong (corrupt block, sizes, descriptions),
            naming the file and the reason.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not hashes:
        return manifest
    stamp = _stamp(directory, manifest)
    if _VERIFIED.get(str(directory.resolve())) == stamp:
        return manifest
    for part in manifest["parts"]:
        with PartReader(directory / part["file"], part) as reader:
            reader.verify_all()
    _VERIFIED[str(directory.resolve())] = stamp
    return manifest


# Checkpoints whose every block was verified in this process, with the sizes and
# modification times of their files then: loads and restarts check the same
# checkpoint several times, and reading a large one again would cost seconds.
_VERIFIED: dict[str, tuple[tuple[str, int, int], ...]] = {}


def _stamp(directory: Path, manifest: dict[str, Any]) -> tuple[tuple[str, int, int], ...]:
    names = ["manifest.json"] + [n for p in manifest["parts"]
                                 for n in (p["file"], p["file"].replace(".safetensors", ".json"))]
    out = []
    for name in names:
        st = (directory / name).stat()
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def incomplete_reason(directory: Path, *, hashes: bool = True) -> str | None:
    """None for a complete checkpoint (:func:`check_complete`), else why it is not."""
    try:
        check_complete(directory, hashes=hashes)
    except (IncompleteCheckpointError, CheckpointFormatError) as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read it ({exc})"
    return None


def damage(directory: Path) -> str | None:
    """Why a checkpoint is *damaged* (its files are all there, but one fails its checks:
    a block's checksum, a size, a description; the message names the file and the
    block), or None when it is complete or merely incomplete (a part or the manifest
    missing: a run stopped before every rank saved)."""
    try:
        check_complete(directory)
    except IncompleteCheckpointError:
        return None
    except CheckpointFormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"{directory}: cannot read it ({exc})"
    return None


def is_complete(directory: Path, *, hashes: bool = True) -> bool:
    """True when the checkpoint is complete (:func:`check_complete`): manifest, every
    part of the recorded size, and (with ``hashes``, the default) every block's hash."""
    return incomplete_reason(directory, hashes=hashes) is None


def latest_complete(root: Path, before: int | None = None) -> int | None:
    """Newest complete checkpoint id under ``root`` (older than ``before`` if given),
    checksums included (:func:`check_complete`)."""
    for cid in reversed(list_checkpoints(root)):
        if (before is None or cid < before) and is_complete(checkpoint_dir(root, cid)):
            return cid
    return None


def incomplete_checkpoints(root: Path) -> list[int]:
    """Ids of the checkpoints under ``root`` that are not complete (checksums included:
    a damaged one counts as incomplete), oldest first."""
    return [c for c in list_checkpoints(root) if not is_complete(checkpoint_dir(root, c))]


def set_aside_incomplete(root: Path) -> tuple[list[int], Path | None]:
    """Move every incomplete checkpoint under ``root`` to ``root/incomplete/<UTC time>/``.

    Nothing is deleted: the parts a crash left stay readable there (``shardreplay
    checkpoint inspect`` takes that directory as a root), out of the way of the ids a new
    or resumed run saves. Call it only while no run writes under ``root``.

    Returns:
        The ids moved and the directory they went to (None when there were none).

    Raises:
        CheckpointError: a directory could not be moved (the message says which).
    """
    return set_aside(root, incomplete_checkpoints(root))


def set_aside(root: Path, ids: list[int]) -> tuple[list[int], Path | None]:
    """Move the checkpoints ``ids`` under ``root`` to ``root/incomplete/<UTC time>/``
    (see :func:`set_aside_incomplete`; ``train --resume --checkpoint-id`` sets aside the
    ones newer than the checkpoint it continues from).

    Returns:
        The ids moved and the directory they went to (None when there were none).

    Raises:
        CheckpointError: a directory could not be moved (the message says which).
    """
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
