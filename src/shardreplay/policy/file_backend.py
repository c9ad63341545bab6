"""``file:///dir`` policy broadcast: immutable safetensors files plus a version note.

Publishing version ``v`` writes ``policy-<v>.safetensors``, then replaces ``policy.version``
(``{"version", "file", "crc32", "run"}``), each by temp name, fsync and rename, then prunes
old weights files. The note is written after the file it names, so a subscriber gets
exactly that version's weights, or (the file pruned meanwhile) nothing and tries again; a
file rewritten under the same version fails the note's checksum (counted). Crashed
publishers' temp files and pruning: docs/semantics.md, "Runs, learner lives and policy versions"."""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from collections import deque
from pathlib import Path

from shardreplay._io import atomic_write_bytes
from shardreplay.errors import ConfigError, TransportError
from shardreplay.policy.broadcast import (
    PolicyPublisher,
    PolicySubscriber,
    PolicyUpdate,
)

__all__ = ["FilePublisher", "FileSubscriber"]

NOTE = "policy.version"
_WEIGHTS = re.compile(r"^policy-(\d{20})\.safetensors$")
# atomic_write_bytes's temp names (``.NAME.<hex>.tmp``) of the files a publisher writes here.
_TEMP = re.compile(r"^\.(policy-\d{20}\.safetensors|policy\.version)\.[0-9a-f]+\.tmp$")


def weights_name(version: int) -> str:
    """The file name of a version's weights."""
    return f"policy-{version:020d}.safetensors"


class FilePublisher(PolicyPublisher):
    """Publishes policies into the directory ``path`` (created if missing), keeping the
    newest ``keep`` weights files it wrote (every other one there is deleted at each
    publish); ``fsync`` False skips the flush before each rename (scratch runs only).

    Raises:
        ConfigError: ``keep < 1``.
        TransportError: the directory cannot be created.
    """

    def __init__(self, path: str | os.PathLike[str], *, keep: int = 3, fsync: bool = True) -> None:
        if keep < 1:
            raise ConfigError(f"keep must be >= 1, got {keep}")
        self.path = Path(path)
        self.keep = keep
        self.fsync = fsync
        self._published: deque[str] = deque(maxlen=keep)  # names written here, oldest first
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._remove_dead_temps()
        except OSError as exc:
            raise TransportError(f"cannot create policy directory {self.path}: {exc}") from exc

    def _remove_dead_temps(self) -> None:
        """Delete temp files of an earlier publisher that died mid-write (nobody else
        writes here: they would otherwise stay forever)."""
        for name in os.listdir(self.path):
            if _TEMP.match(name):
                (self.path / name).unlink(missing_ok=True)

    def _write(self, version: int, data: bytes, run: str) -> None:
        name = weights_name(version)
        note = json.dumps({"version": version, "file": name, "crc32": zlib.crc32(data), "run": run}).encode()
        try:
            atomic_write_bytes(self.path / name, data, fsync=self.fsync)
            try:
                atomic_write_bytes(self.path / NOTE, note, fsync=self.fsync)
            except OSError:
                # Unannounced weights only take space (a full disk wants it back).
                (self.path / name).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise TransportError(f"cannot publish policy {version} to {self.path}: {exc}") from exc
        self._published.append(name)
        self._prune()

    def _prune(self) -> None:
        """Delete every weights file but the newest ``keep`` this publisher wrote, whatever
        the versions (docs/semantics.md, "Old weights files")."""
        mine = set(self._published)
        for name in os.listdir(self.path):
            if _WEIGHTS.match(name) and name not in mine:
                (self.path / name).unlink(missing_ok=True)

class FileSubscriber(PolicySubscriber):
    """Polls the publisher's directory ``path`` for new policies, reading the version note
    at most every ``check_interval_s`` (``as_numpy``: numpy arrays, torch never loads).

    Raises:
        ConfigError: a negative interval.
    """

    def __init__(self, path: str | os.PathLike[str], *, check_interval_s: float = 1.0,
                 as_numpy: bool = False) -> None:
        super().__init__(check_interval_s, as_numpy)
        self.path = Path(path)

    def poll(self) -> PolicyUpdate | None:
        """The newest policy if it is newer than ``version`` or another run's; else None."""
        if not self._due():
            return None
        try:
            raw = (self.path / NOTE).read_bytes()
        except FileNotFoundError:
            return None  # nothing published yet
        if raw == self._bad:
            return None  # already rejected; wait for the next publish
        try:
            note = json.loads(raw)
            version, name, crc = int(note["version"]), str(note["file"]), int(note["crc32"])
            run = str(note.get("run", ""))
            if not _WEIGHTS.match(name):
                raise ValueError(f"bad weights file name {name!r}")
        except (ValueError, KeyError, TypeError) as exc:
            self._bad = raw
            self.stats.reject("format", f"{self.path / NOTE}: {exc}")
            return None
        if not self._is_news(version, run):
            return None
        try:
            data = (self.path / name).read_bytes()
        except FileNotFoundError:
            return None  # superseded and pruned since the note was read: look again later
        # The note's run: what the next check compares.
        return self._take(data, crc, version, run, str(self.path / name), raw)

    def pause(self, timeout_s: float) -> None:
        """Sleep ``timeout_s`` (files give no hints) and allow the next check at once."""
        time.sleep(max(timeout_s, 0.0))
        self._next_check = 0.0
