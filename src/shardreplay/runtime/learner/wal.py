"""The ingest log ``<run_dir>/ingest/shard-<k>.<life>[.upto-<id>].wal``, its rollouts archive
(``--keep-rollouts``) and :class:`LossLog`; identity journals of earlier versions
(``.journal``, 24-byte records) read as header-only records. What is logged, replayed,
trimmed and counted lost: docs/semantics.md, "Chunks across crashes"; the record's bytes
(never pickle): docs/transports.md, "Ingest log records".
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from shardreplay._hashing import xxh3_64, xxh64
from shardreplay._io import atomic_write_bytes, fsync_dir
from shardreplay.errors import ConfigError, CorruptChunkError
from shardreplay.spec import Spec
from shardreplay.transport.codec import Chunk, decode, is_packed, pack

__all__ = ["CRASHED", "PASSED_OVER", "IngestLog", "KeptChunk", "LogRecord", "LogScan", "LossLog", "Retention",
           "Suspects", "archive_retention", "archive_summary", "iter_rollouts", "log_files",
           "read_logs", "run_spec"]

log = logging.getLogger("shardreplay.learner")
MAGIC = b"SRWL"
VERSION = 2
HEADER_ONLY = 1  # flags bit 0: the chunk bytes were not kept
_HEAD = struct.Struct("<4sBB2xIIQqqqqqQ")  # through the chunk's checksum (72 bytes)
_HEAD_V1 = struct.Struct("<4sBB2xIIQqqqqQ")  # version 1: no insert time (64 bytes)
_DIGEST = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _DIGEST.size  # 80
_V1_BYTES = _HEAD_V1.size + _DIGEST.size  # 72
ROLLOUTS_DIR = "rollouts"
SPEC_FILE = "spec.json"  # the run's transition spec, fields in the chunks' order
_EMPTY_DIGEST = xxh3_64(b"")
_FILE = re.compile(r"^shard-(\d+)\.(\d+)-(\d+)(?:\.upto-(\d+))?\.(wal|journal)$")
_JOURNAL = struct.Struct("<qqq")  # the identity journal of earlier versions: actor id, sequence, steps
_IOV_MAX = 512  # buffers per writev (Linux allows 1024)
LOST_FILE = "lost_chunks.jsonl"
CRASHED = "acknowledged_then_learner_crashed"
PASSED_OVER = "acknowledged_then_checkpoint_damaged"  # in a checkpoint a resume passed over, in no log


@dataclass(frozen=True)
class LogRecord:
    """One logged chunk.

    Attributes:
        shard: the shard that wrote it; world: of how many shards (-1: not recorded, an
            earlier version's journal).
        actor_id, sequence: the chunk's identity.
        prev: the sequence that shard wrote of the actor just before (-1: none), so a
            replay rebuilds episode boundaries as the first write did.
        steps: steps in the chunk (``S * T``).
        data: the chunk's bytes as received, or packed when kept (decode with the
            transport codec); None in a header-only record.
        insert_ns: when the shard stored it (ns since the epoch; -1: not recorded, a
            version 1 record or a journal).
    """

    shard: int
    world: int
    actor_id: int
    sequence: int
    prev: int
    steps: int
    data: bytes | None
    insert_ns: int = -1


@dataclass
class LogScan:
    """What reading the logs found besides records: torn tails and damaged files."""

    records: int = 0
    torn: list[tuple[Path, int, int]] = field(default_factory=list)  # path, offset, bytes ignored
    damaged: list[tuple[Path, int, int]] = field(default_factory=list)


def pack_header(shard: int, world: int, actor_id: int, sequence: int, prev: int, steps: int,
                data: memoryview | bytes | None, insert_ns: int = -1) -> bytes:
    """The 80-byte header of one record (docs/transports.md); ``data`` None: a header-only
    record."""
    flags, length, digest = (HEADER_ONLY, 0, _EMPTY_DIGEST) if data is None else (0, len(data), xxh3_64(data))
    head = _HEAD.pack(MAGIC, VERSION, flags, shard, world, length, actor_id, sequence, prev, steps, insert_ns,
                      digest)
    return head + _DIGEST.pack(xxh64(head))


class IngestLog:
    """The log shard ``shard`` of ``world`` appends to in this life under ``directory``
    (``<run_dir>/ingest``, created if missing), sealed at each checkpoint.

    Args:
        keep_chunks: log each chunk's bytes after its header (False: header-only
            records, for a medium whose chunks die with the learner).
        fsync, fsync_every_s: ``fdatasync`` before a batch is acknowledged, at most
            every ``fsync_every_s`` (0: every batch; sooner: the page cache alone).
        inherited: files of earlier lives (read by this life); rank 0 passes them, to
            delete them once a checkpoint of this life is complete.
        retention: keep the segments as the run's rollout archive instead of deleting
            them (chunk bytes kept, packed if they came unpacked).

    Raises:
        OSError: the directory or the file cannot be created.
    """

    def __init__(self, directory: Path, shard: int, world: int, *, keep_chunks: bool = True,
                 fsync: bool = True, fsync_every_s: float = 0.0, inherited: Sequence[Path] = (),
                 retention: Retention | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard, self.world, self.fsync = shard, world, fsync
        self.retention = retention
        self.keep_chunks = keep_chunks or retention is not None
        self.dropped_segments = 0  # archive segments rank 0 deleted beyond the cap
        if retention is not None:
            retention.directory.mkdir(parents=True, exist_ok=True)
        self.fsync_every_s = fsync_every_s
        self._synced_at = -math.inf
        self._life = f"{time.time_ns()}-{os.getpid()}"
        self._inherited = list(inherited)
        self._sealed: list[tuple[int, Path, int]] = []  # checkpoint id, path, bytes
        self._first_sealed: int | None = None
        self._complete: tuple[int | None, int | None] = (None, None)  # the two newest seen complete
        self.segment_bytes = 0  # in the open segment
        self.segment_steps = 0
        self.inherited_bytes = sum(_size(p) for p in self._inherited)
        self.peak_bytes = self.size_bytes
        self._fd = -1
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.fsync:  # the new name must survive a machine crash as its synced bytes do
            fsync_dir(self.directory)

    @property
    def path(self) -> Path:
        """The open segment."""
        return self.directory / f"shard-{self.shard}.{self._life}.wal"

    @property
    def size_bytes(self) -> int:
        """Bytes this log keeps on disk now: the open and sealed segments (and, on rank 0,
        the earlier lives' files it is to delete)."""
        return self.segment_bytes + sum(b for _, _, b in self._sealed) + self.inherited_bytes

    def append(self, chunks: Sequence[tuple[memoryview | None, int, int, int, int]]) -> None:
        """Append ``(data, actor_id, sequence, prev, steps)`` records in one write (and
        ``fdatasync`` with ``fsync``). Call it before acknowledging them. Without
        ``keep_chunks`` only the headers are written (``data`` may be None).

        Raises:
            OSError: the write failed (the caller must not acknowledge then).
        """
        if not chunks:
            return
        parts: list[bytes | memoryview] = []
        steps = 0
        now = time.time_ns()
        squeeze = None if self.retention is None else self.retention.pack
        for data, actor, seq, prev, n in chunks:
            kept: memoryview | bytes | None = data if self.keep_chunks else None
            if kept is not None and squeeze is not None and not is_packed(kept):
                kept = squeeze(kept)  # a rollout kept for good: stored compressed
            parts.append(pack_header(self.shard, self.world, actor, seq, prev, n, kept, now))
            if kept is not None:
                parts.append(kept)
            steps += n
        total = sum(len(p) for p in parts)
        try:
            self._write_all(parts)
            if self.fsync and time.monotonic() - self._synced_at >= self.fsync_every_s:
                os.fdatasync(self._fd)
                self._synced_at = time.monotonic()
        except OSError as exc:
            if exc.filename is None:
                exc.filename = str(self.path)  # os.write names no file: say which one
            raise
        self.segment_bytes += total
        self.segment_steps += steps
        self.peak_bytes = max(self.peak_bytes, self.size_bytes)

    def _write_all(self, parts: list[bytes | memoryview]) -> None:
        for at in range(0, len(parts), _IOV_MAX):
            group = parts[at:at + _IOV_MAX]
            want = sum(len(p) for p in group)
            done = os.writev(self._fd, group)
            if done < want:  # a short write (a signal, a full disk): finish it byte-wise
                rest = memoryview(b"".join(group))[done:]
                while rest:
                    rest = rest[os.write(self._fd, rest):]

    def seal(self, checkpoint_id: int) -> None:
        """Close the open segment as covered by ``checkpoint_id`` (this shard saved its
        part of it) and open a new one.

        Raises:
            OSError: the new segment cannot be created.
        """
        self.close()
        sealed = self.path.with_name(self.path.name.replace(".wal", f".upto-{checkpoint_id}.wal"))
        try:
            os.replace(self.path, sealed)
        except OSError as exc:  # it then stays the open segment: kept longer, never lost
            log.warning("shard %d: could not seal the ingest log %s: %s", self.shard, self.path, exc)
        else:
            self._sealed.append((checkpoint_id, sealed, self.segment_bytes))
            self.segment_bytes = self.segment_steps = 0
            if self._first_sealed is None:
                self._first_sealed = checkpoint_id
        self._open()

    @property
    def trimmable(self) -> bool:
        """Whether sealed or inherited files wait for a complete checkpoint."""
        return bool(self._sealed or self._inherited)

    def trim(self, latest_complete: int | None) -> int:
        """Delete (or archive) the sealed segments held by the complete checkpoint seen before
        ``latest_complete`` (a resume finding that one damaged falls back to it and replays the
        rest) and, once that is of this life, the inherited files; returns the bytes freed (a
        file that cannot be deleted is logged and kept)."""
        newest = self._complete[1]
        if latest_complete is not None and (newest is None or latest_complete > newest):
            self._complete = (newest, latest_complete)
        floor = self._complete[0]
        if floor is None:
            return 0
        freed = 0
        keep = []
        for cid, path, size in self._sealed:
            if cid <= floor and self._retire(path):
                freed += size
            else:
                keep.append((cid, path, size))
        self._sealed = keep
        if self._inherited and self._first_sealed is not None and floor >= self._first_sealed:
            self._inherited = [p for p in self._inherited if not self._retire(p)]
            freed += self.inherited_bytes - sum(_size(p) for p in self._inherited)
            self.inherited_bytes = sum(_size(p) for p in self._inherited)
        r = self.retention
        if freed and r is not None and r.max_bytes > 0 and self.shard == 0:
            self.dropped_segments += drop_oldest(r.directory, r.max_bytes)
        return freed

    def _retire(self, path: Path) -> bool:
        """Delete a file the complete checkpoint holds, or move it into the archive
        (with a retention; a journal is deleted: it holds no chunk). False: it stays."""
        if self.retention is None or not path.name.endswith(".wal"):
            return _unlink(path)
        try:
            os.replace(path, self.retention.directory / path.name)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.warning("cannot move the ingest log %s into the rollouts archive: %s", path, exc)
            return False

    def close(self) -> None:
        """Close the open segment (it stays for the next life to replay), synced first.

        Raises:
            OSError: the sync failed.
        """
        if self._fd >= 0:
            if self.fsync:
                os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = -1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Retention:
    """How an :class:`IngestLog` keeps its segments as the rollout archive.

    Attributes:
        directory: ``<run_dir>/rollouts``.
        max_bytes: the archive's cap: rank 0 deletes whole oldest segments beyond it
            (0: no cap).
        pack: compresses a chunk that came unpacked (``transport.codec.pack`` with the
            run's spec); None: kept as received.
    """

    directory: Path
    max_bytes: int = 0
    pack: Callable[[memoryview | bytes], bytes] | None = None


def archive_retention(run_dir: Path, spec: Spec, max_bytes: int = 0) -> Retention:
    """The :class:`Retention` of ``<run_dir>/rollouts`` (created, with its ``spec.json``):
    chunks that come unpacked are packed with LZ4.

    Raises:
        OSError: the directory or ``spec.json`` cannot be written.
    """
    (run_dir / ROLLOUTS_DIR).mkdir(parents=True, exist_ok=True)
    # Not sorted: a reader decodes the chunks with the fields in this order.
    atomic_write_bytes(run_dir / ROLLOUTS_DIR / SPEC_FILE, json.dumps(spec.to_dict()).encode())
    return Retention(run_dir / ROLLOUTS_DIR, max_bytes, pack=lambda data: pack(data, spec, "lz4"))


def _age(path: Path) -> tuple[int, int, int, int]:
    """Sort key of a segment: its life, then its checkpoint (the open one last), then shard."""
    life, started, shard, upto = _name_key(path)
    return life, started, upto, shard


def _name_key(path: Path) -> tuple[int, int, int, int]:
    """A log file's life (two numbers), shard and checkpoint (the open segment: 2**63)."""
    m = _FILE.match(path.name)
    assert m is not None
    upto = m.group(4)
    return int(m.group(2)), int(m.group(3)), int(m.group(1)), int(upto) if upto is not None else 2**63


def drop_oldest(directory: Path, max_bytes: int) -> int:
    """Delete whole oldest segments of the archive ``directory`` until it holds at most
    ``max_bytes``; says so in one log line. Returns the segments deleted."""
    files = sorted(log_files(directory), key=_age)
    sizes = [_size(p) for p in files]
    total, dropped, freed = sum(sizes), 0, 0
    for path, size in zip(files, sizes, strict=True):
        if total - freed <= max_bytes:
            break
        if _unlink(path):
            dropped += 1
            freed += size
    if dropped:
        log.warning("rollouts archive %s over its cap of %d bytes: dropped its %d oldest segment(s) "
                    "(%d bytes); %d bytes kept", directory, max_bytes, dropped, freed, total - freed)
    return dropped


def _unlink(path: Path) -> bool:
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as exc:
        log.warning("cannot delete the trimmed ingest log %s: %s", path, exc)
        return False


def log_files(directory: Path) -> list[Path]:
    """Every shard's log files under ``directory``, oldest life first, each life's
    segments in the order written (sealed by checkpoint id, then the open one)."""
    if not Path(directory).is_dir():
        return []
    return sorted((p for p in Path(directory).iterdir() if _FILE.match(p.name)), key=_name_key)


def read_logs(paths: Sequence[Path], scan: LogScan, *, owns_actor: Callable[[int], bool] | None = None
              ) -> Iterator[LogRecord]:
    """The valid records of ``paths`` (files from :func:`log_files`) in order; ``scan``
    counts them and collects the torn and damaged tails. ``owns_actor``: whether this shard
    owns any stream of an actor in this life's routing; the kept chunks of other actors are
    skipped unread (by actor, not by writer: another number of actors routes streams
    otherwise). Header-only records are all yielded (the caller counts them by the shard
    that wrote them)."""
    for path in paths:
        try:
            with open(path, "rb") as f:
                if path.name.endswith(".journal"):
                    yield from _journal_records(path, f, scan)
                else:
                    yield from _records(path, f, scan, owns_actor)
        except FileNotFoundError:  # trimmed meanwhile by rank 0 (after a complete checkpoint)
            continue


def _journal_records(path: Path, f: BinaryIO, scan: LogScan) -> Iterator[LogRecord]:
    """An earlier version's identity journal as header-only records of its shard (a torn
    last record, the process dying inside a write, is ignored as that version did)."""
    m = _FILE.match(path.name)
    shard = int(m.group(1)) if m is not None else -1
    data = f.read()
    usable = len(data) - len(data) % _JOURNAL.size
    for actor, seq, steps in _JOURNAL.iter_unpack(data[:usable]):
        scan.records += 1
        yield LogRecord(shard, -1, actor, seq, -1, steps, None)


def _records(path: Path, f: BinaryIO, scan: LogScan, owns: Callable[[int], bool] | None
             ) -> Iterator[LogRecord]:
    size = os.fstat(f.fileno()).st_size
    at = 0
    while at < size:
        head = f.read(_V1_BYTES)
        if len(head) == _V1_BYTES and head[4] == VERSION:
            head += f.read(HEADER_BYTES - _V1_BYTES)
        bad, end = _check_head(head), size
        if bad is None:
            _m, _v, flags, shard, world, length, actor, seq, prev, steps, *when, digest = \
                (_HEAD if head[4] == VERSION else _HEAD_V1).unpack_from(head)
            when = when or [-1]  # version 1: no insert time
            end = at + len(head) + length
            data: bytes | None = None
            if end > size:
                bad = "truncated chunk bytes"
            elif flags & HEADER_ONLY:
                f.seek(length, os.SEEK_CUR)
            elif owns is not None and not owns(actor):
                f.seek(length, os.SEEK_CUR)
                at = end
                continue
            else:
                data = f.read(length)
                if xxh3_64(data) != digest:
                    bad = "chunk checksum"
        if bad is not None:
            # Torn: the bad record reaches the end of the file (the write stopped inside
            # it). Anything after it means damage on disk.
            torn = end >= size and (bad != "header checksum" or size - at <= HEADER_BYTES)
            (scan.torn if torn else scan.damaged).append((path, at, size - at))
            log.warning("ingest log %s: %s record at byte %d (%s); its last %d bytes ignored", path,
                        "torn" if torn else "damaged", at, bad, size - at)
            return
        scan.records += 1
        at = end
        yield LogRecord(shard, world, actor, seq, prev, steps, data, when[0])


def _check_head(head: bytes) -> str | None:
    """Why ``head`` is not a valid record header (None: it is)."""
    if len(head) < _V1_BYTES or (head[4] == VERSION and len(head) < HEADER_BYTES):
        return "truncated header"
    fixed = _HEAD.size if head[4] == VERSION else _HEAD_V1.size
    if _DIGEST.unpack_from(head, fixed)[0] != xxh64(head[:fixed]):
        return "header checksum"
    magic, version = head[:4], head[4]
    if magic != MAGIC or version not in (1, VERSION):
        return f"not a version 1 or {VERSION} record"
    return None


@dataclass(frozen=True)
class KeptChunk:
    """One chunk of a run's rollout archive (:func:`iter_rollouts`).

    Attributes:
        shard: the learner shard that stored it.
        insert_ns: when it stored it (ns since the epoch; -1: not recorded).
        chunk: the decoded chunk: ``actor_id``, ``sequence``, ``policy_version``,
            ``stream_ids`` ``[S]``, ``steps`` (each field ``[S, T, ...]``, read-only) and
            ``priorities`` (``[S, T]`` or None) as the actor sent them.
    """

    shard: int
    insert_ns: int
    chunk: Chunk


def _archive_files(run_dir: Path) -> list[Path]:
    """The archive's segments, then those not yet moved there (``ingest/``), oldest first."""
    return sorted(log_files(Path(run_dir) / ROLLOUTS_DIR) + [p for p in log_files(Path(run_dir) / "ingest")
                                                             if p.name.endswith(".wal")], key=_age)


def _kept_records(run_dir: Path, scan: LogScan | None) -> Iterator[tuple[Path, LogRecord]]:
    """Each kept chunk's record once (first copy: a chunk delivered again after a resume
    to an older checkpoint is logged twice), in the order stored; damage raises without
    ``scan``."""
    seen: set[tuple[int, int]] = set()
    for path in _archive_files(run_dir):
        mine = LogScan()
        for rec in read_logs([path], mine):
            if rec.data is not None and (rec.actor_id, rec.sequence) not in seen:
                seen.add((rec.actor_id, rec.sequence))
                yield path, rec
        if scan is None and mine.damaged:
            _where, at, left = mine.damaged[0]
            raise CorruptChunkError(f"rollouts archive {path}: damaged record at byte {at} (its last {left} "
                                    "bytes fail their checksums); delete that segment, or pass a LogScan "
                                    "to read past it", reason="checksum")
        if scan is not None:
            scan.records += mine.records
            scan.torn += mine.torn
            scan.damaged += mine.damaged


def iter_rollouts(run_dir: str | os.PathLike[str], spec: Spec | None = None, *,
                  scan: LogScan | None = None) -> Iterator[KeptChunk]:
    """The chunks a ``--keep-rollouts`` run kept, decoded, each once, per segment in the
    order stored (segments oldest first: by learner life, then checkpoint, then shard).

    Args:
        run_dir: the run directory (its ``rollouts/`` and the ``ingest/`` segments not yet
            moved there).
        spec: the run's transition spec; None: the archive's (:func:`run_spec`).
        scan: collects torn and damaged records (then skipped: the rest of that segment);
            None: a damaged record raises. A torn tail (a learner killed inside a write:
            that chunk was never acknowledged) never raises.

    Raises:
        CorruptChunkError: a damaged segment (checksum), or a chunk of another spec.
        ConfigError: no ``spec``, and the archive has none.
    """
    spec = spec if spec is not None else run_spec(Path(run_dir))
    for _path, rec in _kept_records(Path(run_dir), scan):
        assert rec.data is not None
        yield KeptChunk(rec.shard, rec.insert_ns, decode(rec.data, spec, max_bytes=1 << 40))


def run_spec(run_dir: Path) -> Spec:
    """The transition spec of ``run_dir``'s rollouts archive (``rollouts/spec.json``; its
    field order is the chunks' array order).

    Raises:
        ConfigError: the run keeps no rollouts (no ``rollouts/spec.json``).
    """
    path = Path(run_dir) / ROLLOUTS_DIR / SPEC_FILE
    try:
        return Spec.from_dict(json.loads(path.read_bytes()))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file: {run_dir} keeps no rollouts (train --keep-rollouts)"
                          ) from None


def archive_summary(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What a run's rollout archive holds, every record's checksums checked: ``segments``,
    ``bytes`` (on disk), ``chunks``, ``steps``, ``first_insert`` and ``last_insert`` (Unix
    seconds; None: no time recorded), ``span_s``, ``torn`` and ``damaged`` (``"path@byte"``
    each). None when the run keeps no rollouts (no ``rollouts/`` directory)."""
    run_dir = Path(run_dir)
    if not (run_dir / ROLLOUTS_DIR).is_dir():
        return None
    scan = LogScan()
    chunks = steps = 0
    first, last = math.inf, -math.inf
    for _path, rec in _kept_records(run_dir, scan):
        chunks += 1
        steps += rec.steps
        if rec.insert_ns >= 0:
            first, last = min(first, rec.insert_ns / 1e9), max(last, rec.insert_ns / 1e9)
    sizes = [s for s in map(_size, _archive_files(run_dir)) if s]
    timed = math.isfinite(first)
    return {"segments": len(sizes), "bytes": sum(sizes), "chunks": chunks, "steps": steps,
            "first_insert": first if timed else None, "last_insert": last if timed else None,
            "span_s": last - first if timed else None, "torn": [f"{p}@{at}" for p, at, _ in scan.torn],
            "damaged": [f"{p}@{at}" for p, at, _ in scan.damaged]}


@dataclass
class Suspects:
    """Chunks earlier lives logged that this life neither restored nor replayed: lost
    unless the medium delivers them again before this life's first checkpoint."""

    chunks: dict[tuple[int, int], int] = field(default_factory=dict)  # identity -> steps
    checkpoint: str = "none"  # the checkpoint restored (for the report)


class LossLog:
    """Appends to ``<run_dir>/lost_chunks.jsonl`` one JSON object per run of consecutive
    sequences, ``{"actor_id", "first", "last", "chunks", "steps", "reason", "rank"}``
    (one ``os.write`` each: ranks share the file): chunks lost with a crashed learner,
    rejected ones and entries a medium lost (-1: identities or steps unknown).
    """

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / LOST_FILE
        self.rank = rank

    def record(self, actor_id: int, first: int, last: int, chunks: int, steps: int, reason: str) -> None:
        """Append one entry (a file that cannot be written is logged, not raised: the
        loss is in the log then)."""
        line = json.dumps({"actor_id": actor_id, "first": first, "last": last, "chunks": chunks,
                           "steps": steps, "reason": reason, "rank": self.rank}) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("cannot record a loss in %s (%s): %s", self.path, exc, line.strip())

    def record_runs(self, chunks: dict[tuple[int, int], int], reason: str) -> None:
        """Record ``chunks`` (identity -> steps, -1: unknown) lost for ``reason``, an entry per
        run of consecutive sequences."""
        runs: list[list[int]] = []  # actor, first, last, chunks, steps
        for (actor, seq), steps in sorted(chunks.items()):
            if runs and runs[-1][0] == actor and runs[-1][2] == seq - 1:
                runs[-1][2:] = [seq, runs[-1][3] + 1, runs[-1][4] + steps]
            else:
                runs.append([actor, seq, seq, 1, steps])
        for actor, first, last, n, steps in runs:
            self.record(actor, first, last, n, max(steps, -1), reason)  # -1 each sums to -n

    def report_lost(self, suspects: Suspects) -> tuple[int, int]:
        """Record the suspects still missing as lost (runs of consecutive sequences) and
        log one line; clears them. Returns ``(chunks, steps)``."""
        chunks, steps = len(suspects.chunks), sum(suspects.chunks.values())
        self.record_runs(suspects.chunks, CRASHED)
        if chunks:
            log.warning("rank %d: %d chunks (%d steps) acknowledged after checkpoint %s were lost with the "
                        "crashed learner (listed in %s)", self.rank, chunks, steps, suspects.checkpoint,
                        self.path)
        suspects.chunks.clear()
        return chunks, steps
