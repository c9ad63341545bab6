"""``file:///dir`` transport: a spool directory on a (shared) file system.

A writer writes each chunk to ``tmp/`` and renames it into ``ready/``; the reader takes
chunks in sequence order per actor, round robin over actors (:meth:`SpoolReader._refill`),
quarantines bad ones by reason and deletes a chunk at ``ack``. The directory's layout and
rules: docs/transports.md, "file:///dir".
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from shardreplay._io import atomic_write_bytes
from shardreplay.errors import ConfigError, TransportError, TransportTimeout
from shardreplay.spec import Spec
from shardreplay.transport.base import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
    DUPLICATE,
    Backlog,
    IntakeReader,
)
from shardreplay.transport.codec import Chunk, check_codec, wire_encoding

__all__ = ["SpoolReader", "SpoolTransport", "SpoolWriter", "chunk_file_name"]

logger = logging.getLogger("shardreplay.transport")

_NAME = re.compile(r"^(\d{10})-(\d{20})\.chunk$")


def chunk_file_name(actor_id: int, sequence: int) -> str:
    """The file name of a chunk in ``ready/``."""
    return f"{actor_id:010d}-{sequence:020d}.chunk"


# The longest a writer waiting for room sleeps between looks (see _wait_for_room).
_MAX_ROOM_PAUSE_S = 0.05

class SpoolTransport:
    """Chunks of ``spec`` through the spool directory ``path`` (created if missing). A
    writer waits while ``ready/`` holds ``queued_chunks_per_actor`` of its chunks, polling
    from ``poll_interval_s`` (what a waiting reader sleeps) up to 50 ms; ``fsync`` flushes
    chunks before they become visible (off only for scratch data); a new reader deletes
    temp files in ``tmp/`` older than ``stale_tmp_s`` (dead writers), and quarantines
    temp-named files in ``ready/`` unchanged this long. ``max_chunk_bytes`` (larger files
    are quarantined unread), ``dedup_window`` and ``compression``: as for
    :class:`~.local.LocalTransport` and :func:`~.codec.wire_encoding`.

    Raises:
        ConfigError: a bad setting, or a codec whose package is missing.
    """

    def __init__(self, path: str | os.PathLike[str], spec: Spec, *, queued_chunks_per_actor: int = 64,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 dedup_window: int = 4096, poll_interval_s: float = 0.005, fsync: bool = True,
                 stale_tmp_s: float = 600.0, compression: str = "none") -> None:
        if queued_chunks_per_actor < 1:
            raise ConfigError(f"queued_chunks_per_actor must be >= 1, got {queued_chunks_per_actor}")
        if poll_interval_s <= 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.path = Path(path)
        self.url = self.path.absolute().as_uri()
        self.spec = spec
        self.queued_chunks_per_actor = queued_chunks_per_actor
        self.max_chunk_bytes = max_chunk_bytes
        self.dedup_window = dedup_window
        self.poll_interval_s = poll_interval_s
        self.fsync = fsync
        self.stale_tmp_s = stale_tmp_s
        self.compression = check_codec(compression)

    def _dirs(self) -> tuple[Path, Path]:
        ready, tmp = self.path / "ready", self.path / "tmp"
        try:
            for d in (ready, tmp, self.path / "quarantine"):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TransportError(f"cannot create spool directories under {self.path}: {exc}") from exc
        return ready, tmp

    def channel(self, shard: int, run_id: str = "") -> str:
        """The spool directory of ``shard``'s chunks: ``<path>/<run_id>/shard-<k>``
        (``<path>/shard-<k>`` without a run id)."""
        return str(self.path / run_id / f"shard-{shard}" if run_id else self.path / f"shard-{shard}")

    def channels(self, shard: int) -> list[str]:
        """The spool directories of ``shard`` under this one that hold a ``ready/``."""
        found = [self.path / f"shard-{shard}", *sorted(self.path.glob(f"*/shard-{shard}"))]
        return [str(d) for d in found if (d / "ready").is_dir()]

    def backlog(self, channel: str | None = None) -> Backlog:
        """The chunk files in ``ready/`` of spool directory ``channel`` (None: this one),
        temp names excluded, and their sizes; a missing directory holds none."""
        ready = Path(channel if channel is not None else self.path) / "ready"
        chunks = nbytes = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(ready):
                if _is_temp_name(entry.name):
                    continue
                with contextlib.suppress(FileNotFoundError):  # consumed meanwhile
                    nbytes += entry.stat().st_size
                    chunks += 1
        return Backlog(chunks, nbytes)

    def writer(self) -> SpoolWriter:
        """A writer end; call it in the actor process."""
        ready, tmp = self._dirs()
        return SpoolWriter(self, ready, tmp)

    def reader(self) -> SpoolReader:
        """The reader end (one per spool directory, enforced by a lock file).

        Raises:
            TransportError: another live reader holds this spool.
        """
        self._dirs()
        return SpoolReader(self)


class SpoolWriter:
    """Actor end of a :class:`SpoolTransport`."""

    def __init__(self, transport: SpoolTransport, ready: Path, tmp: Path) -> None:
        self._t = transport
        self._ready, self._tmp = ready, tmp
        self._pending: dict[int, deque[str]] = {}  # per actor: names written, maybe not yet consumed

    def send(self, chunk: Chunk, *, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Encode ``chunk`` and publish it atomically in ``ready/``.

        Raises:
            SpecMismatchError: the chunk does not fit the spec.
            TransportTimeout: ``ready/`` held ``queued_chunks_per_actor`` of this actor's
                chunks for ``timeout_s``.
            TransportError: the file system refused the write.
        """
        enc = wire_encoding(chunk, self._t.spec, self._t.compression)
        data = bytearray(enc.nbytes)
        enc.write_into(data)
        pending = self._wait_for_room(chunk.actor_id, timeout_s)
        name = chunk_file_name(chunk.actor_id, chunk.sequence)
        try:  # written in tmp/, renamed into ready/: a reader never sees half a chunk
            atomic_write_bytes(self._ready / name, data, fsync=self._t.fsync, tmp_dir=self._tmp)
        except OSError as exc:
            raise TransportError(f"cannot write chunk {name} to spool {self._t.path}: {exc}") from exc
        pending.append(name)

    def _wait_for_room(self, actor_id: int, timeout_s: float | None) -> deque[str]:
        pending = self._pending.get(actor_id)
        if pending is None:  # a restarted writer first counts what its earlier life left
            prefix = f"{actor_id:010d}-"
            pending = self._pending[actor_id] = deque(
                sorted(e.name for e in os.scandir(self._ready) if e.name.startswith(prefix)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = self._t.poll_interval_s
        while len(pending) >= self._t.queued_chunks_per_actor:
            # The reader consumes each actor's chunks oldest first.
            while pending and not (self._ready / pending[0]).exists():
                pending.popleft()
            if len(pending) < self._t.queued_chunks_per_actor:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"spool {self._t.path}: {len(pending)} chunks of actor {actor_id} still unread "
                    f"after {timeout_s} s: the learner is not draining ready/ (is it alive?)")
            time.sleep(pause if deadline is None else min(pause, max(deadline - time.monotonic(), 0.0)))
            # Back off: hundreds of writers polling an undrained spool kept every core busy.
            pause = min(pause * 2, max(self._t.poll_interval_s, _MAX_ROOM_PAUSE_S))
        return pending

    def close(self) -> None:
        """Nothing to release; present for the interface."""


class SpoolReader(IntakeReader):
    """Learner end of a :class:`SpoolTransport`.

    Raises:
        TransportError: another live reader holds the spool's lock file.
    """

    def __init__(self, transport: SpoolTransport) -> None:
        self._t = transport
        self._ready = transport.path / "ready"
        self._quarantine = transport.path / "quarantine"
        self._lock_fd: int | None = _take_lock(transport.path / "reader.lock")
        super().__init__(transport.spec, transport.max_chunk_bytes, transport.dedup_window,
                         f"spool {transport.path}")
        self._backlog: deque[str] = deque()
        self._inflight: dict[tuple[int, int], str] = {}
        self._sweep_temp(transport.path / "tmp", transport.stale_tmp_s)

    def _receive(self, max_chunks: int, deadline: float, borrow: bool) -> list[Chunk]:
        out: list[Chunk] = []
        while True:
            if not self._backlog:
                self._refill()
            while self._backlog and len(out) < max_chunks:
                chunk = self._ingest(self._backlog.popleft())
                if chunk is not None:
                    out.append(chunk)
            if out or time.monotonic() >= deadline:
                return out
            if not self._backlog:
                time.sleep(min(self._t.poll_interval_s, max(deadline - time.monotonic(), 0.0)))

    def _refill(self) -> None:
        """List ``ready/``: per actor in sequence order, interleaved across actors. A second
        listing adds the chunks the first missed below each actor's highest (POSIX lets a
        listing miss a file renamed in while it shows a later one: docs/semantics.md, "Order")."""
        inflight = set(self._inflight.values())
        first = self._list(inflight)
        if not first:
            return
        second = self._list(inflight)
        for actor, entries in first.items():
            top, seen = max(entries)[0], {name for _, name in entries}
            entries.extend(e for e in second.get(actor, ()) if e[0] < top and e[1] not in seen)
        queues = [sorted(v) for _, v in sorted(first.items())]
        for i in range(max((len(q) for q in queues), default=0)):
            self._backlog.extend(q[i][1] for q in queues if i < len(q))

    def _list(self, inflight: set[str]) -> dict[int, list[tuple[int, str]]]:
        """Per actor, ``(sequence, name)`` of the chunk files in ``ready/``; other names
        are set aside, except temp names younger than ``stale_tmp_s``."""
        per_actor: dict[int, list[tuple[int, str]]] = {}
        for entry in os.scandir(self._ready):
            if entry.name in inflight:
                continue
            parsed = _NAME.match(entry.name)
            if parsed is not None:
                per_actor.setdefault(int(parsed[1]), []).append((int(parsed[2]), entry.name))
            elif _is_temp_name(entry.name):
                self._set_aside_if_stale(entry)
            else:
                self._set_aside(entry.name, "name", "not a chunk file name")
        return per_actor

    def _set_aside_if_stale(self, entry: os.DirEntry[str]) -> None:
        try:
            idle_s = time.time() - entry.stat().st_mtime
        except FileNotFoundError:  # renamed to its final name meanwhile
            return
        if idle_s >= self._t.stale_tmp_s:
            self._set_aside(entry.name, "stale_temp", f"a temp file unchanged for {idle_s:.0f} s "
                            f"(stale_tmp_s={self._t.stale_tmp_s}): its writer died")

    def _ingest(self, name: str) -> Chunk | None:
        try:
            data = _read_at_most(self._ready / name, self._t.max_chunk_bytes)
        except FileNotFoundError:  # consumed by an earlier life of this reader, or removed
            return None
        if data is None:
            self._set_aside(name, "too_large", f"more than max_chunk_bytes={self._t.max_chunk_bytes}")
            return None
        result = self._admit(data, name)
        if isinstance(result, str):
            if result == DUPLICATE:
                self._consume(name)
            else:
                self._quarantine_file(name, result)
            return None
        self._inflight[result.identity] = name
        return result

    def ack(self, chunks: Iterable[Chunk]) -> None:
        """Delete the files of stored chunks. Unknown chunks are ignored."""
        for chunk in chunks:
            name = self._inflight.pop(chunk.identity, None)
            if name is not None:
                self._consume(name)
                self.stats.acked += 1

    def _consume(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self._ready / name).unlink()

    def _set_aside(self, name: str, reason: str, detail: str) -> None:
        self._reject(reason, f"{name}: {detail}")
        self._quarantine_file(name, reason)

    def _quarantine_file(self, name: str, reason: str) -> None:
        dest = self._quarantine / name
        if dest.exists():  # keep both: the earlier one may be the evidence someone needs
            dest = self._quarantine / f"{name}.{time.time_ns()}"
        try:
            os.replace(self._ready / name, dest)
            dest.with_name(dest.name + ".reason").write_text(reason + "\n")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TransportError(f"cannot move {name} to {self._quarantine}: {exc}") from exc

    @staticmethod
    def _sweep_temp(tmp_dir: Path, stale_tmp_s: float) -> None:
        now = time.time()
        for entry in os.scandir(tmp_dir):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime >= stale_tmp_s:
                    os.unlink(entry.path)
                    logger.info("spool: removed stale temp file %s (a writer died mid-write)", entry.path)

    def close(self) -> None:
        """Release the reader lock; unacknowledged chunks stay in ``ready/``."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _is_temp_name(name: str) -> bool:
    """A name a writer uses before renaming: ours end in ``.tmp``; rsync's and many
    other tools' start with a dot."""
    return name.endswith(".tmp") or name.startswith(".")


def _read_at_most(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes, or None when it is longer than ``max_bytes`` (not read then)."""
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            return None
        return f.readall()


def _take_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise TransportError(f"another reader holds {path}: one reader per spool directory "
                             "(give each learner rank its own directory)") from exc
    return fd
