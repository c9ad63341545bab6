"""Background saves: a forked child process (as Redis's ``BGSAVE``) writes the part from
its copy-on-write memory, the buffer at the call; a thread of the parent reaps it.
Semantics: docs/semantics.md, "Background saves" and "Never two at once".
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardreplay import _signals
from shardreplay._io import causes
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint.records import ManifestPart
from shardreplay.checkpoint.saving import SaveJob, forget, prepare, run, write, written
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import CheckpointError, ConfigError

log = logging.getLogger("shardreplay.checkpoint.save")
_ORPHAN_POLL_S = 0.2  # how often the child checks that its parent still runs
_NICE = 10  # the child's niceness over its parent's


class PendingSave:
    """A checkpoint part (of ``checkpoint_id``, in ``directory``) being written by a forked
    child process ``pid`` (None: nothing to write, or written before the call returned); a
    thread of this process (non-daemon: an exiting interpreter waits for it) collects its
    result, reaps it and regroups the shard's arrays on huge pages."""

    def __init__(self, job: SaveJob) -> None:
        self.directory = job.directory
        self.checkpoint_id = job.checkpoint_id
        self.pid: int | None = None
        self._error: CheckpointError | None = None
        self._done = threading.Event()
        shard = job.shard
        if job.skip or shard is None:
            self._done.set()
            return
        if shard.file_backed:  # no copy-on-write snapshot of shared file pages: written now
            try:
                run(job)
            except CheckpointError as exc:
                self._error = exc
            self._done.set()
            return
        shard.begin_save()
        try:
            self.pid, fd = _fork(job)
        except BaseException:
            shard.end_save()
            raise
        threading.Thread(target=self._collect, args=(job, self.pid, fd), daemon=False,
                         name=f"shardreplay-save-{job.checkpoint_id}").start()

    def _collect(self, job: SaveJob, pid: int, fd: int) -> None:
        """Read the child's report, reap it, and record the part (or the error)."""
        assert job.shard is not None
        try:
            try:
                with os.fdopen(fd, "rb") as pipe:
                    data = pipe.read()
            finally:
                _, status = os.waitpid(pid, 0)
                job.shard.regroup()  # the pages are this process's alone again
            self._finish(job, _report(data, status, pid))
        except BaseException as exc:  # kept for wait(): a thread has no caller to raise to
            forget(job.shard, job.directory.parent)
            if not isinstance(exc, CheckpointError):
                wrapped = CheckpointError(f"checkpoint {self.directory.name}: the background write "
                                          f"failed: {exc!r}")
                wrapped.__cause__ = exc
                exc = wrapped
            self._error = exc
        finally:
            job.shard.end_save()
            self._done.set()

    def _finish(self, job: SaveJob, report: dict[str, Any]) -> None:
        for name, level, message in report.get("logs", []):
            logging.getLogger(str(name)).log(int(level), "%s", message)
        if "error" in report:
            # The OSError behind it, rebuilt: a caller tells a refused write (a full disk)
            # by it (``_io.storage_error``), as from a synchronous save.
            cause = OSError(int(report["errno"]), str(report["strerror"]), report.get("filename")) \
                if isinstance(report.get("errno"), int) else None
            raise CheckpointError(f"checkpoint {self.directory.name}: the background write failed: "
                                  f"{report['error']}") from cause
        written(job, ManifestPart.parse(report["part"], self.directory))

    def done(self) -> bool:
        """Whether the part is written (or the write failed) and the child reaped."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait until the part is written and the child reaped; the checkpoint directory.

        Raises:
            CheckpointError: the write failed or the child was killed (the previous
                complete checkpoints are untouched), or ``timeout`` seconds passed first.
        """
        if not self._done.wait(timeout):
            raise CheckpointError(f"checkpoint {self.directory.name}: still writing after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.directory


def save_in_background(buffer: ReplayBuffer | ShardedReplayBuffer, path: str | Path, checkpoint_id: int,
                       *, partial: str = "seal", keep_last: int | None = 2,
                       files: Mapping[str, bytes] | None = None, incremental: bool = False) -> PendingSave:
    """:func:`~shardreplay.checkpoint.save` (same arguments) whose files are written by a
    forked child: the checkpoint holds the buffer (and ``files``) as they are at this
    call, however the buffer is written meanwhile; ``wait()`` on the :class:`PendingSave`.

    Raises:
        ConfigError: as ``save``, or this system cannot fork (no ``os.fork``: use ``save``).
        CheckpointError: as ``save``, before anything is written. Errors of the write
            itself are raised by ``PendingSave.wait``.
    """
    if not hasattr(os, "fork"):
        raise ConfigError("save_in_background forks a writer process, which this system cannot "
                          "(no os.fork); use checkpoint.save")
    return PendingSave(prepare(buffer, path, checkpoint_id, partial=partial, keep_last=keep_last, files=files,
                               incremental=incremental))


def _fork(job: SaveJob) -> tuple[int, int]:
    """Fork the writer; ``(its pid, the read end of its report pipe)`` in the parent.
    The child never returns."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # pragma: no cover - the child (its coverage is not collected)
        _child(job, parent, read_fd, write_fd)
    os.close(write_fd)
    return pid, read_fd


def _child(job: SaveJob, parent: int, read_fd: int, write_fd: int) -> None:  # pragma: no cover
    """The writer: write the part, report through ``write_fd``, ``os._exit`` (always)."""
    code, report, logs = 1, dict[str, Any](), logging.handlers.BufferingHandler(sys.maxsize)
    try:
        os.close(read_fd)
        # Below the training thread: on a busy host a writer at the same priority takes a
        # whole CPU share from it (the write may take longer; it is in the background).
        os.nice(_NICE)
        # The caller decides when to stop (and waits for this save); not its handlers.
        _signals.install({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN})
        threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
        # Its log records go to the parent in the report (the parent's handlers may be
        # threads or queues that the fork did not copy).
        logger = logging.getLogger("shardreplay")
        logger.handlers, logger.propagate = [logs], False
        part = write(job)
        report, code = {"part": part.as_json()}, 0
    except BaseException as exc:  # reported, never raised: the child must reach os._exit
        report = {"error": str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}",
                  **_os_error(exc)}
    finally:
        try:
            lines = [[r.name, r.levelno, r.getMessage()] for r in logs.buffer]
            data = memoryview(json.dumps({**report, "logs": lines}).encode())
            while data:
                data = data[os.write(write_fd, data):]
        finally:
            os._exit(code)


def _os_error(exc: BaseException | None) -> dict[str, Any]:
    """The errno, message and file of the OSError that caused ``exc``, if any (JSON)."""
    for cause in causes(exc):
        if isinstance(cause, OSError) and cause.errno is not None:
            name = cause.filename if isinstance(cause.filename, str) else None
            return {"errno": cause.errno, "strerror": cause.strerror or "", "filename": name}
    return {}


def _exit_when_orphaned(parent: int) -> None:  # pragma: no cover - in the child
    """A writer whose parent is gone stops (it was a part of that process's save)."""
    while os.getppid() == parent:
        time.sleep(_ORPHAN_POLL_S)
    os._exit(1)


def _report(data: bytes, status: int, pid: int) -> dict[str, Any]:
    """The child's report, or why there is none (killed, or exited without one)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"error": f"the writer process {pid} was killed by signal {sig} "
                         f"({signal.Signals(sig).name}) before it finished"}
    try:
        report = json.loads(data.decode()) if data else None
    except ValueError:
        report = None
    if not isinstance(report, dict) or ("error" not in report and os.waitstatus_to_exitcode(status) != 0):
        return {"error": f"the writer process {pid} exited with status "
                         f"{os.waitstatus_to_exitcode(status)} without a report"}
    return report
