"""Background saves: the content is fixed at the call, the files are written by a thread.

``save_in_background(buffer, path, id)`` takes what :func:`~shardreplay.checkpoint.save`
would write at that moment (small arrays copied: step types, discounts, episode ids,
generations, priorities, positions, episode tables, sampler, RNG and counters; the
user fields, frame-stacked ones included, fenced, see :mod:`shardreplay.buffer.fence`) and returns a
:class:`PendingSave` at once; a thread writes the part, the manifest when it is the last
one, and prunes. Writes to the buffer go on meanwhile: a write that would replace a
fenced step the thread has not read yet copies that step aside first.

Overlap: a shard has at most one save in flight. The next save of it (background or
not), a ``load`` into it and ``load_state_dict`` wait until the one in flight has
written its part (they are not coalesced: each checkpoint asked for is written).

Crash safety is the format's: parts are renamed into place once whole and the manifest
is written last, so a process killed mid-write leaves the previous complete checkpoint
the newest complete one (pruning runs only after a manifest is written).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint.saving import SaveJob, prepare, run
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import CheckpointError


class PendingSave:
    """A checkpoint part being written by a background thread (non-daemon: an
    interpreter that exits waits for it)."""

    def __init__(self, job: SaveJob) -> None:
        self.directory = job.directory
        self.checkpoint_id = job.checkpoint_id
        self._error: BaseException | None = None
        self._done = threading.Event()
        if job.skip:
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=False,
                                        name=f"shardreplay-save-{job.checkpoint_id}")
        self._thread.start()

    def _run(self, job: SaveJob) -> None:
        try:
            run(job)
        except BaseException as exc:  # kept for wait(): a thread has no caller to raise to
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the part is written (or the write failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait until the part is written.

        Returns:
            The checkpoint directory.

        Raises:
            CheckpointError: the write failed (the previous complete checkpoints are
                untouched), or ``timeout`` seconds passed first.
        """
        if not self._done.wait(timeout):
            raise CheckpointError(f"checkpoint {self.directory.name}: still writing after {timeout} s")
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"checkpoint {self.directory.name}: the background write failed: "
                                  f"{self._error!r}") from self._error
        return self.directory


def save_in_background(buffer: ReplayBuffer | ShardedReplayBuffer, path: str | Path, checkpoint_id: int,
                       *, partial: str = "seal", keep_last: int | None = 2,
                       files: Mapping[str, bytes] | None = None, incremental: bool = False) -> PendingSave:
    """:func:`~shardreplay.checkpoint.save` whose files are written by a thread: the
    checkpoint holds the buffer as it is at this call, however it is written meanwhile.

    Arguments as ``save``. ``files`` are bytes already (e.g. the learner's state at this
    update), so they are as of this call too. Frame-stacked fields are fenced too: a
    write that would overwrite a frame the save still needs copies it aside first.

    Returns:
        A :class:`PendingSave` (``wait()`` for the directory, or the error).

    Raises:
        ConfigError, CheckpointError: as ``save``, before anything is written. Errors
            of the write itself are raised by ``PendingSave.wait``.
    """
    job = prepare(buffer, path, checkpoint_id, partial=partial, keep_last=keep_last, files=files,
                  incremental=incremental, background=True)
    return PendingSave(job)
