"""Loss accounting: what a shard acknowledged, and what never reached a checkpoint.

``shardreplay train`` acknowledges chunks right after writing them, so a learner killed
between two checkpoints takes the chunks it stored since the last one with it: the
medium forgot them, and the restored checkpoint does not hold them. They are counted,
never silent:

- Each shard appends the identities of the chunks it stores to its *journal*,
  ``<run_dir>/ingest/shard-<k>.<life>.journal`` (24-byte records: actor id, sequence,
  steps; little-endian int64), with ``os.write`` *before* the acknowledgement goes out.
  No fsync: the journal survives the learner's process (SIGKILL, OOM), not a crash of
  the machine. At each checkpoint the shard starts a new file; files that a complete
  checkpoint covers are deleted.
- A learner that starts over a run directory reads the journals its shards left
  (:func:`read_old_journals`); every identity in them that the restored checkpoint
  does not hold is *suspected lost*. Those the medium delivers again (sent before the
  acknowledgement reached it) are stored and cleared; the rest are reported at the
  new life's first checkpoint (:meth:`LossLog.report_lost`).
- :class:`LossLog` appends to ``<run_dir>/lost_chunks.jsonl`` one JSON object per run
  of consecutive sequences, ``{"actor_id", "first", "last", "chunks", "steps",
  "reason", "rank"}``: the chunks lost with a crashed learner, the chunks rejected
  (removed from the medium unstored) and the entries a medium lost (``actor_id`` -1
  where the identities are unknown, ``steps`` -1 where the count is).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shardreplay.runtime.learner.stored_ids import StoredIds

__all__ = ["IngestJournal", "LossLog", "OldJournals", "read_old_journals"]

log = logging.getLogger("shardreplay.learner")
_RECORD = struct.Struct("<qqq")  # actor id, sequence, steps
_FILE = re.compile(r"^shard-(\d+)\.(.+)\.journal$")
_UPTO = re.compile(r"\.upto-(\d+)$")
LOST_FILE = "lost_chunks.jsonl"
CRASHED = "acknowledged_then_learner_crashed"


class IngestJournal:
    """The append-only record of the chunks one shard stored in this life.

    Args:
        directory: ``<run_dir>/ingest`` (created if missing).
        shard: this shard's index.

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, directory: Path, shard: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard = shard
        self._life = f"{time.time_ns()}-{os.getpid()}"
        self._fd = -1
        self._open()

    @property
    def path(self) -> Path:
        """The file records go to now."""
        return self.directory / f"shard-{self.shard}.{self._life}.journal"

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, records: Iterable[tuple[int, int, int]]) -> None:
        """Append ``(actor_id, sequence, steps)`` records in one write (before the ack).

        Raises:
            OSError: the write failed (the caller must not acknowledge then).
        """
        data = b"".join(_RECORD.pack(*r) for r in records)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            if exc.filename is None:
                exc.filename = str(self.path)  # os.write names no file: say which one
            raise

    def rotate(self, checkpoint_id: int, latest_complete: int | None) -> None:
        """Start a new file after this shard saved its part of ``checkpoint_id``; delete
        the files a complete checkpoint (``latest_complete``) covers.

        Raises:
            OSError: the new file cannot be created.
        """
        os.close(self._fd)
        try:
            os.replace(self.path, self.path.with_name(self.path.name.replace(
                ".journal", f".upto-{checkpoint_id}.journal")))
        except OSError as exc:  # records then stay in the current file: kept longer, never lost
            log.warning("shard %d: could not rotate the ingest journal %s: %s", self.shard, self.path, exc)
        self._open()
        if latest_complete is None:
            return
        for path in self.directory.glob(f"shard-{self.shard}.{self._life}.upto-*.journal"):
            m = _UPTO.search(path.name[:-len(".journal")])
            if m is not None and int(m.group(1)) <= latest_complete:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the file (it stays for the next life to read)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class OldJournals:
    """The chunks earlier lives stored that the restored checkpoint does not hold."""

    suspects: dict[tuple[int, int], int] = field(default_factory=dict)  # identity -> steps
    files: list[Path] = field(default_factory=list)
    checkpoint: str = "none"  # the checkpoint restored (for the report)

    def discard(self, identity: tuple[int, int]) -> None:
        """The medium delivered it again and it is stored now: not lost."""
        self.suspects.pop(identity, None)


def read_old_journals(directory: Path, is_mine: Callable[[int], bool], restored: StoredIds,
                      checkpoint: str) -> OldJournals:
    """Read the journals left by earlier lives of the shards ``k`` with ``is_mine(k)``;
    keep what ``restored`` lacks. Call it before this life opens its own journal.

    A torn last record (the process died inside a write) is ignored.
    """
    old = OldJournals(checkpoint=checkpoint)
    if not Path(directory).is_dir():
        return old
    for path in sorted(Path(directory).iterdir()):
        m = _FILE.match(path.name)
        if m is None or not is_mine(int(m.group(1))):
            continue
        data = path.read_bytes()
        usable = len(data) - len(data) % _RECORD.size
        for actor, seq, steps in _RECORD.iter_unpack(data[:usable]):
            if (actor, seq) not in restored:
                old.suspects[(actor, seq)] = steps
        old.files.append(path)
    return old


class LossLog:
    """Appends to ``<run_dir>/lost_chunks.jsonl`` (one ``os.write`` per record, so
    several ranks can append to the same file).

    Args:
        run_dir: the run directory.
        rank: the rank recorded with each entry.
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

    def record_chunks(self, chunks: dict[tuple[int, int], int], reason: str) -> None:
        """Append ``{(actor_id, sequence): steps}`` as runs of consecutive sequences."""
        for actor, first, last, n, steps in _runs(chunks):
            self.record(actor, first, last, n, steps, reason)

    def report_lost(self, old: OldJournals) -> tuple[int, int]:
        """Record the suspects still missing as lost, log one line, delete the old
        journals. Returns ``(chunks, steps)``."""
        chunks, steps = len(old.suspects), sum(old.suspects.values())
        if chunks:
            self.record_chunks(old.suspects, CRASHED)
            log.warning("rank %d: %d chunks (%d steps) acknowledged after checkpoint %s were lost with the "
                        "crashed learner (listed in %s)", self.rank, chunks, steps, old.checkpoint, self.path)
        for path in old.files:
            path.unlink(missing_ok=True)
        old.suspects.clear()
        old.files.clear()
        return chunks, steps


def _runs(chunks: dict[tuple[int, int], int]) -> list[tuple[int, int, int, int, int]]:
    """``(actor, first, last, chunks, steps)`` per run of consecutive sequences."""
    out: list[tuple[int, int, int, int, int]] = []
    for (actor, seq), steps in sorted(chunks.items()):
        if out and out[-1][0] == actor and out[-1][2] == seq - 1:
            a, first, _, n, s = out[-1]
            out[-1] = (a, first, seq, n + 1, s + steps)
        else:
            out.append((actor, seq, seq, 1, steps))
    return out
