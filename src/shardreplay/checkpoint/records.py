"""Typed records of a checkpoint: each ``parse`` checks every value's type and range
(raising :class:`CheckpointFormatError` naming the file) and reads what its ``as_json``
(or ``as_text``) writes; code downstream reads attributes, never ``.get``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shardreplay.errors import CheckpointFormatError, ConfigError
from shardreplay.spec import Spec
from shardreplay.spec.keys import is_key_tag

FORMAT = "shardreplay-checkpoint"
FORMAT_VERSION = 2  # 2: XXH64 block hashes (1 had CRC32); what a full save writes
# 3: an incremental checkpoint (a part refers to earlier part files: checkpoint/refs.py);
# 4: its episode ids and generations (and episode offsets) are chained too; 5: every per-step array.
INCREMENTAL_VERSION = 3
STEPS_CHAINED_VERSION = 4
ALL_CHAINED_VERSION = 5
READ_VERSIONS = (FORMAT_VERSION, INCREMENTAL_VERSION, STEPS_CHAINED_VERSION, ALL_CHAINED_VERSION)
# What an incremental part writes only the new rows of (the last three: version 5, docs/semantics.md).
CHAINABLE_STEPS = ("episode_id", "generation", "episode_step", "step_type", "discount", "priority")


def _count(value: Any, what: str, where: Path | str, low: int = 0) -> int:
    """An integer >= ``low`` (a bool or float is damage, not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CheckpointFormatError(f"{where}: {what} is {value!r}, not an integer >= {low}")
    return value


def _counts(value: Mapping[str, Any], what: str, where: Path | str) -> dict[str, int]:
    """A JSON object of counts (``partial``)."""
    return {str(k): _count(v, f"{what}.{k}", where) for k, v in value.items()}


@dataclass(frozen=True)
class FileEntry:
    """A whole file of a checkpoint: its size and XXH64 (16 hex digits)."""

    bytes: int
    xxh64: str

    @classmethod
    def parse(cls, name: str, value: Any, where: Path) -> FileEntry:
        """Parse ``{"bytes": n, "xxh64": "<hex>"}``.

        Raises:
            CheckpointFormatError: malformed (naming ``where`` and ``name``).
        """
        if not isinstance(value, Mapping) or not isinstance(value.get("xxh64"), str):
            raise CheckpointFormatError(f"{where}: the entry of file {name!r} is malformed")
        try:
            int(value["xxh64"], 16)
        except ValueError as exc:
            raise CheckpointFormatError(f"{where}: the hash of file {name!r} is not hex") from exc
        return cls(_count(value.get("bytes"), f"the size of {name!r}", where), value["xxh64"])

    def as_json(self) -> dict[str, Any]:
        """The JSON form (as stored)."""
        return {"bytes": self.bytes, "xxh64": self.xxh64}


@dataclass(frozen=True)
class RefSource:
    """A part file of an earlier checkpoint that an incremental part reads rows from:
    ``<root>/<checkpoint>/<file>``, with its size and block hashes (as that checkpoint's
    manifest lists them)."""

    checkpoint: str
    file: str
    bytes: int
    block_xxh64: tuple[str, ...]

    @classmethod
    def parse(cls, value: Any, where: Path) -> RefSource:
        """Parse ``{"checkpoint", "file", "bytes", "block_xxh64"}``.

        Raises:
            CheckpointFormatError: malformed, or a name that is not a plain one.
        """
        if not isinstance(value, Mapping):
            raise CheckpointFormatError(f"{where}: a 'refs' entry is not a JSON object")
        ckpt, file, hashes = value.get("checkpoint"), value.get("file"), value.get("block_xxh64")
        if not isinstance(ckpt, str) or not ckpt.startswith("ckpt-") or "/" in ckpt or \
                not isinstance(file, str) or not file.startswith("part-") or "/" in file or \
                not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise CheckpointFormatError(f"{where}: malformed 'refs' entry {value!r}")
        return cls(ckpt, file, _count(value.get("bytes"), "a reference's size", where), tuple(hashes))

    def as_json(self) -> dict[str, Any]:
        """The JSON form (as stored)."""
        return {"checkpoint": self.checkpoint, "file": self.file, "bytes": self.bytes,
                "block_xxh64": list(self.block_xxh64)}

    def path(self, root: Path) -> Path:
        """The file under checkpoint root ``root``."""
        return Path(root) / self.checkpoint / self.file


@dataclass(frozen=True)
class RestoreCounts:
    """What a restore kept and lost (``LoadReport.counts()``; recorded in the next save):
    the source checkpoint, its shards and steps, then this shard's (or, in a manifest,
    every shard's summed) restored steps and episodes, dropped and sealed ones."""

    checkpoint_id: int
    saved_shards: int
    saved_steps: int
    steps: int
    episodes: int
    dropped_episodes: int
    dropped_steps: int
    sealed_episodes: int
    sealed_steps: int

    @classmethod
    def parse(cls, value: Any, where: Path | str) -> RestoreCounts | None:
        """Parse a stored record (None or empty: nothing was restored).

        Raises:
            CheckpointFormatError: a key is missing or not a count.
        """
        if not value:
            return None
        if not isinstance(value, Mapping):
            raise CheckpointFormatError(f"{where}: 'restored' is not a record of counts")
        return cls(**{f.name: _count(value.get(f.name), f"restored.{f.name}", where) for f in fields(cls)})

    @classmethod
    def total(cls, parts: list[RestoreCounts | None]) -> RestoreCounts | None:
        """The parts' counts summed (None when no part was restored). Every new shard of
        one restore records the same source checkpoint and total."""
        got = [p for p in parts if p is not None]
        if not got:
            return None
        first = got[0]
        return cls(first.checkpoint_id, first.saved_shards, first.saved_steps,
                   *(sum(getattr(p, f.name) for p in got) for f in fields(cls)[3:]))

    def as_dict(self) -> dict[str, int]:
        """The JSON form (as stored)."""
        return {f.name: getattr(self, f.name) for f in fields(RestoreCounts)}


@dataclass(frozen=True)
class ManifestPart:
    """One part: its entry in the manifest, and its description file (``part-*.json``),
    which says the same with the format, version and spec."""

    checkpoint_id: int
    shard: int
    num_shards: int
    file: str
    bytes: int
    block_xxh64: tuple[str, ...]
    steps: int
    episodes: int
    partial_policy: str
    partial: Mapping[str, int]
    restored: RestoreCounts | None
    spec_fingerprint: str
    created_unix_ms: int  # when the part was written
    files: Mapping[str, FileEntry] = field(default_factory=dict)  # this rank's other files
    refs: tuple[RefSource, ...] = ()  # the earlier files an incremental part reads rows from
    extra: Mapping[str, Any] = field(default_factory=dict)  # as saved before named files
    chained: bool = False  # an incremental part (a segment table; refs may be empty)
    chained_steps: tuple[str, ...] = ()  # per-step arrays read through the segment table too

    @property
    def version(self) -> int:
        """The format version of the part (and of a manifest listing it)."""
        if self.chained_steps:
            return ALL_CHAINED_VERSION if "priority" in self.chained_steps else STEPS_CHAINED_VERSION
        return INCREMENTAL_VERSION if self.chained else FORMAT_VERSION

    @classmethod
    def parse(cls, entry: Any, where: Path) -> ManifestPart:
        """Parse a part's entry (or its description: the same keys and more).

        Raises:
            CheckpointFormatError: a field is missing or malformed.
        """
        if not isinstance(entry, Mapping):
            raise CheckpointFormatError(f"{where}: a part entry is not a JSON object")
        hashes, partial, extra = entry.get("block_xxh64"), entry.get("partial"), entry.get("extra", {})
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise CheckpointFormatError(f"{where}: part {entry.get('shard')!r} has no valid block hashes")
        if not isinstance(partial, Mapping) or not isinstance(extra, Mapping) or \
                not all(isinstance(entry.get(k), str) for k in ("file", "partial_policy",
                                                                "spec_fingerprint")):
            raise CheckpointFormatError(f"{where}: part {entry.get('shard')!r} is malformed")
        files, refs, steps = entry.get("files", {}), entry.get("refs", []), entry.get("chained_steps", [])
        if not isinstance(files, Mapping) or not isinstance(refs, list) or not isinstance(steps, list) or \
                not set(steps) <= set(CHAINABLE_STEPS) or (steps and "refs" not in entry):
            raise CheckpointFormatError(f"{where}: part {entry.get('shard')!r}: 'files', 'refs' or "
                                        "'chained_steps' is malformed")
        n = {k: _count(entry.get(k), f"a part's {k}", where) for k in
             ("checkpoint_id", "shard", "num_shards", "bytes", "steps", "episodes", "created_unix_ms")}
        return cls(n["checkpoint_id"], n["shard"], n["num_shards"], entry["file"], n["bytes"], tuple(hashes),
                   n["steps"], n["episodes"], entry["partial_policy"], _counts(partial, "partial", where),
                   RestoreCounts.parse(entry.get("restored"), where), entry["spec_fingerprint"],
                   n["created_unix_ms"],
                   {str(k): FileEntry.parse(k, v, where) for k, v in files.items()},
                   tuple(RefSource.parse(r, where) for r in refs), dict(extra), "refs" in entry, tuple(steps))

    def as_json(self) -> dict[str, Any]:
        """The manifest's entry (as :meth:`parse` reads it)."""
        out: dict[str, Any] = {
            "checkpoint_id": self.checkpoint_id, "shard": self.shard, "num_shards": self.num_shards,
            "file": self.file, "bytes": self.bytes, "block_xxh64": list(self.block_xxh64),
            "steps": self.steps, "episodes": self.episodes, "partial_policy": self.partial_policy,
            "partial": dict(self.partial), "spec_fingerprint": self.spec_fingerprint,
            "restored": None if self.restored is None else self.restored.as_dict(),
            "created_unix_ms": self.created_unix_ms}
        if self.files:  # only then: a part without files is described as before
            out["files"] = {k: v.as_json() for k, v in sorted(self.files.items())}
        if self.chained:  # only then: a full part is described as before
            out["refs"] = [r.as_json() for r in self.refs]
        if self.chained_steps:
            out["chained_steps"] = list(self.chained_steps)
        if self.extra:
            out["extra"] = dict(self.extra)
        return out

    def description(self, spec: Spec) -> dict[str, Any]:
        """The part's description file (its entry with the format, version and spec)."""
        return {**self.as_json(), "format": FORMAT, "version": self.version, "spec": spec.to_dict()}


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, parsed and checked against its parts' descriptions.

    ``parts`` are in shard order. ``files`` gives the size and XXH64 of every other
    file but ``manifest.json`` (the part descriptions and the files saved with
    ``save(files=...)``). ``extra`` (and each part's) is what checkpoints written before
    named files stored beside the buffer; empty since.
    """

    directory: Path
    checkpoint_id: int
    num_shards: int
    spec: Spec
    spec_fingerprint: str
    steps: int
    episodes: int
    partial: Mapping[str, int]
    restored: RestoreCounts | None
    parts: tuple[ManifestPart, ...]
    files: Mapping[str, FileEntry]
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """The manifest file."""
        return self.directory / "manifest.json"

    @property
    def version(self) -> int:
        """The format version: its newest part's (2 without parts)."""
        return max(p.version for p in self.parts) if self.parts else FORMAT_VERSION

    @classmethod
    def of_parts(cls, directory: Path, spec: Spec, parts: list[ManifestPart],
                 files: Mapping[str, FileEntry]) -> Manifest:
        """The manifest of ``parts`` (in shard order, one checkpoint's), covering ``files``
        (the part descriptions) and every file the parts list."""
        first = parts[0]
        covered = dict(files)
        for part in parts:  # a later part's description of a file wins
            covered.update(part.files)
        return cls(Path(directory), first.checkpoint_id, first.num_shards, spec, first.spec_fingerprint,
                   sum(p.steps for p in parts), sum(p.episodes for p in parts),
                   _summed_partial(parts), RestoreCounts.total([p.restored for p in parts]), tuple(parts),
                   dict(sorted(covered.items())))

    @classmethod
    def parse(cls, directory: Path, body: Mapping[str, Any]) -> Manifest:
        """Parse a manifest's JSON body (its CRC already checked).

        Raises:
            CheckpointFormatError: a field is missing or malformed, or the shards listed
                are not ``0..num_shards-1``.
        """
        where = Path(directory) / "manifest.json"
        num = _count(body.get("num_shards"), "num_shards", where)
        raw_parts = body.get("parts")
        if not isinstance(raw_parts, list):
            raise CheckpointFormatError(f"{where}: malformed manifest (no list of parts)")
        parts = tuple(sorted((ManifestPart.parse(p, where) for p in raw_parts), key=lambda p: p.shard))
        shards = [p.shard for p in parts]
        if shards != list(range(num)):
            raise CheckpointFormatError(f"{where}: lists shards {shards}, expected 0..{num - 1}")
        try:
            spec = Spec.from_dict(body["spec"])
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointFormatError(f"{where}: bad spec ({exc!r})") from exc
        partial, extra, files = body.get("partial"), body.get("extra", {}), body.get("files")
        if not isinstance(partial, Mapping) or not isinstance(extra, Mapping) or \
                not isinstance(body.get("spec_fingerprint"), str) or not isinstance(files, Mapping):
            raise CheckpointFormatError(f"{where}: malformed manifest")
        return cls(Path(directory), _count(body.get("checkpoint_id"), "checkpoint_id", where), num, spec,
                   body["spec_fingerprint"], _count(body.get("steps"), "steps", where),
                   _count(body.get("episodes"), "episodes", where), _counts(partial, "partial", where),
                   RestoreCounts.parse(body.get("restored"), where), parts,
                   {str(k): FileEntry.parse(k, v, where) for k, v in files.items()}, dict(extra))

    def as_json(self) -> dict[str, Any]:
        """The manifest's JSON body (as :meth:`parse` reads it; the part entries without
        their spec, format and version)."""
        out: dict[str, Any] = {
            "format": FORMAT, "version": self.version, "checkpoint_id": self.checkpoint_id,
            "num_shards": self.num_shards, "spec": self.spec.to_dict(),
            "spec_fingerprint": self.spec_fingerprint,
            "steps": self.steps, "episodes": self.episodes, "partial": dict(self.partial),
            "restored": None if self.restored is None else self.restored.as_dict(),
            "parts": [p.as_json() for p in self.parts],
            "files": {k: v.as_json() for k, v in sorted(self.files.items())}}
        if self.extra:
            out["extra"] = dict(self.extra)
        return out


def _summed_partial(parts: tuple[ManifestPart, ...] | list[ManifestPart]) -> dict[str, int]:
    """The parts' partial-episode counts summed."""
    return {k: sum(p.partial[k] for p in parts) for k in (parts[0].partial if parts else {})}


@dataclass(frozen=True)
class PartMeta:
    """A part's buffer metadata (``buffer_meta`` in its safetensors header), checked:
    ``max_priority``/``draws`` are the prioritized sampler's (1.0 and 0 without it),
    ``sharding`` the sharded buffer's own state (None: a plain buffer's part), ``period``
    the saving buffer's sequence period.
    """

    num_streams: int
    stream_capacity: int
    key_epoch: int
    key_tag: int
    next_episode_id: int
    stale_updates: int
    max_priority: float
    draws: int
    rng: Mapping[str, Any]
    sharding: Mapping[str, Any] | None
    period: int = 1

    @classmethod
    def of_state(cls, meta: Mapping[str, Any], sharding: Mapping[str, Any] | None) -> PartMeta:
        """The metadata of a shard's exported state (``Shard.export()["meta"]``) and, for a
        sharded buffer, its sharding state."""
        sampler = meta["sampler_state"]
        return cls(int(meta["num_streams"]), int(meta["stream_capacity"]), int(meta["key_epoch"]),
                   int(meta["key_tag"]), int(meta["next_episode_id"]), int(meta["stale_updates"]),
                   float(sampler.get("max_priority", 1.0)), int(sampler.get("draws", 0)), dict(meta["rng"]),
                   None if sharding is None else dict(sharding), int(meta.get("period", 1)))

    def as_text(self) -> str:
        """The ``buffer_meta`` JSON text (as :meth:`parse` reads it)."""
        out: dict[str, Any] = {
            "num_streams": self.num_streams, "stream_capacity": self.stream_capacity,
            "key_epoch": self.key_epoch, "key_tag": self.key_tag, "next_episode_id": self.next_episode_id,
            "stale_updates": self.stale_updates, "period": self.period,
            "sampler_state": {"max_priority": self.max_priority, "draws": self.draws}, "rng": dict(self.rng)}
        if self.sharding is not None:
            out["sharding"] = dict(self.sharding)
        return json.dumps(out)

    @classmethod
    def parse(cls, text: str, where: Path) -> PartMeta:
        """Parse the ``buffer_meta`` JSON text of part file ``where``.

        Raises:
            CheckpointFormatError: not JSON, or a value missing or malformed.
        """
        try:
            meta = json.loads(text)
        except ValueError as exc:
            raise CheckpointFormatError(f"{where}: malformed buffer metadata ({exc})") from exc
        if not isinstance(meta, dict):
            raise CheckpointFormatError(f"{where}: malformed buffer metadata")
        sampler = meta.get("sampler_state", {})
        sampler = sampler if isinstance(sampler, dict) else {}
        try:
            max_priority, draws = float(sampler.get("max_priority", 1.0)), int(sampler.get("draws", 0))
        except (TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{where}: malformed sampler state ({exc})") from exc
        rng, sharding, tag = meta.get("rng"), meta.get("sharding"), meta.get("key_tag")
        if not isinstance(rng, dict) or not isinstance(sharding, dict | None) or not is_key_tag(tag):
            raise CheckpointFormatError(f"{where}: malformed buffer metadata (rng, sharding or key_tag)")

        def count(key: str, low: int = 0, default: int | None = None) -> int:
            return _count(meta.get(key, default), f"buffer metadata {key!r}", where, low)

        return cls(count("num_streams", 1), count("stream_capacity", 1), count("key_epoch"), int(tag),
                   count("next_episode_id"), count("stale_updates"), max_priority, draws, rng, sharding,
                   count("period", 1, 1))

