"""Typed records of a checkpoint, parsed once from its JSON and part headers.

:class:`Manifest` (``manifest.json``: the parts and every other file it covers),
:class:`ManifestPart` (one part's entry), :class:`FileEntry` (size and XXH64 of a whole
file), :class:`PartMeta` (a part's buffer metadata, from its safetensors header) and
:class:`RestoreCounts` (what a restore kept and lost). Every check of a value's type and
range happens in the ``parse`` functions, which raise :class:`CheckpointFormatError`
naming the file; code downstream reads attributes, never ``.get`` with a default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from shardreplay.errors import CheckpointFormatError, ConfigError
from shardreplay.spec import Spec
from shardreplay.spec.keys import is_key_tag


def _count(value: Any, what: str, where: Path | str) -> int:
    """A non-negative integer (a bool or float is damage, not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointFormatError(f"{where}: {what} is {value!r}, not a count")
    return value


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
        """The JSON form (as stored), which ``PartReader`` takes as its expectation."""
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
    def from_counts(cls, value: Mapping[str, Any]) -> RestoreCounts:
        """The counts a caller passes to ``save(restored=...)``.

        Raises:
            ConfigError: a key is missing or not an integer.
        """
        missing = sorted({f.name for f in fields(cls)} - set(value))
        if missing:
            raise ConfigError(f"restored must be LoadReport.counts() (missing {missing})")
        try:
            return cls(**{f.name: int(value[f.name]) for f in fields(cls)})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"restored must hold integers (LoadReport.counts()): {exc}") from exc

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
        """The JSON form (as stored, and as ``LoadReport.counts()``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ManifestPart:
    """One part's entry in the manifest (what its description file says too)."""

    shard: int
    file: str
    bytes: int
    block_xxh64: tuple[str, ...]
    steps: int
    episodes: int
    partial_policy: str
    partial: Mapping[str, int]
    restored: RestoreCounts | None
    extra: Mapping[str, Any]
    files: Mapping[str, FileEntry]
    entry: Mapping[str, Any]  # the JSON entry as listed (compared with the description)
    refs: tuple[RefSource, ...] = ()  # an incremental part's earlier files (none: a full part)

    @classmethod
    def parse(cls, entry: Any, where: Path) -> ManifestPart:
        """Parse a part's entry.

        Raises:
            CheckpointFormatError: a field is missing or malformed.
        """
        if not isinstance(entry, Mapping):
            raise CheckpointFormatError(f"{where}: a part entry is not a JSON object")
        hashes, partial, extra = entry.get("block_xxh64"), entry.get("partial"), entry.get("extra", {})
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise CheckpointFormatError(f"{where}: part {entry.get('shard')!r} has no valid block hashes")
        if not isinstance(partial, Mapping) or not isinstance(extra, Mapping) or \
                not isinstance(entry.get("file"), str) or not isinstance(entry.get("partial_policy"), str):
            raise CheckpointFormatError(f"{where}: part {entry.get('shard')!r} is malformed")
        files, refs = entry.get("files", {}), entry.get("refs", [])
        if not isinstance(files, Mapping) or not isinstance(refs, list):
            raise CheckpointFormatError(f"{where}: part {entry.get('shard')!r}: 'files' or 'refs' "
                                        "is malformed")
        return cls(_count(entry.get("shard"), "a part's shard", where), entry["file"],
                   _count(entry.get("bytes"), "a part's size", where), tuple(hashes),
                   _count(entry.get("steps"), "a part's steps", where),
                   _count(entry.get("episodes"), "a part's episodes", where), entry["partial_policy"],
                   {str(k): _count(v, f"partial.{k}", where) for k, v in partial.items()},
                   RestoreCounts.parse(entry.get("restored"), where), dict(extra),
                   {str(k): FileEntry.parse(k, v, where) for k, v in files.items()}, dict(entry),
                   tuple(RefSource.parse(r, where) for r in refs))


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, parsed and checked against its parts' descriptions.

    ``parts`` are in shard order. ``files`` gives the size and XXH64 of every file of
    the checkpoint other than ``manifest.json`` (which has its own CRC) and the part
    files (covered block by block by ``parts``): the part descriptions and the files
    saved with ``save(files=...)`` such as the runtime's ``learner_state.pt``.
    ``covers_files`` is False for a manifest written before that table existed (it still
    loads; those files are then read unchecked). ``body`` is the JSON as read.
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
    extra: Mapping[str, Any]
    parts: tuple[ManifestPart, ...]
    files: Mapping[str, FileEntry]
    covers_files: bool
    body: Mapping[str, Any]

    @property
    def path(self) -> Path:
        """The manifest file."""
        return self.directory / "manifest.json"

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
        partial, extra, files = body.get("partial", {}), body.get("extra", {}), body.get("files")
        if not isinstance(partial, Mapping) or not isinstance(extra, Mapping) or \
                not isinstance(body.get("spec_fingerprint"), str) or \
                not (files is None or isinstance(files, Mapping)):
            raise CheckpointFormatError(f"{where}: malformed manifest")
        return cls(Path(directory), _count(body.get("checkpoint_id"), "checkpoint_id", where), num, spec,
                   body["spec_fingerprint"], _count(body.get("steps"), "steps", where),
                   _count(body.get("episodes"), "episodes", where),
                   {str(k): _count(v, f"partial.{k}", where) for k, v in partial.items()},
                   RestoreCounts.parse(body.get("restored"), where), dict(extra), parts,
                   {str(k): FileEntry.parse(k, v, where) for k, v in (files or {}).items()},
                   files is not None, body)


@dataclass(frozen=True)
class PartMeta:
    """A part's buffer metadata (``buffer_meta`` in its safetensors header), checked.

    ``num_streams``/``stream_capacity``/``key_epoch`` are None when a part from an older
    version carries none (it is then never restored as saved, and adds nothing to the
    new key epoch); ``key_tag`` None keeps the buffer's tag; ``max_priority``/``draws``
    are the prioritized sampler's (1.0 and 0 when the part has none); ``period`` the
    saving buffer's sequence period (1 when the part has none).
    """

    num_streams: int | None
    stream_capacity: int | None
    key_epoch: int | None
    key_tag: int | None
    next_episode_id: int
    stale_updates: int
    max_priority: float
    draws: int
    rng: Mapping[str, Any] | None
    sharding: Mapping[str, Any] | None
    period: int = 1

    @classmethod
    def parse(cls, text: str, where: Path) -> PartMeta:
        """Parse the ``buffer_meta`` JSON text of part file ``where``.

        Raises:
            CheckpointFormatError: not JSON, or a counter or the sampler state malformed.
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
        rng, sharding = meta.get("rng"), meta.get("sharding")
        tag = meta.get("key_tag")
        period = _positive(meta.get("period", 1))
        if period is None:
            raise CheckpointFormatError(f"{where}: malformed buffer metadata 'period'")
        return cls(_positive(meta.get("num_streams")), _positive(meta.get("stream_capacity")),
                   _optional_count(meta.get("key_epoch", 0)), int(tag) if is_key_tag(tag) else None,
                   _count(meta.get("next_episode_id", 0), "buffer metadata 'next_episode_id'", where),
                   _count(meta.get("stale_updates", 0), "buffer metadata 'stale_updates'", where),
                   max_priority, draws, rng if isinstance(rng, dict) else None,
                   sharding if isinstance(sharding, dict) else None, period)


def _positive(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return value if ok else None


def _optional_count(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None
