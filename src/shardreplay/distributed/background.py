"""One background thread that runs a pipelined buffer's exchanges, in submission order.

Every collective of the buffer's own process group is issued from this one thread, job
after job in the order the learner's thread submitted them. Every rank submits the same
jobs in the same order (they follow its ``sample`` / ``flush_updates`` calls, which are
collective), so the group's collectives pair up alike on every rank, whatever the
learner's thread does meanwhile on other groups (DDP's all-reduces). No deadlock with
those: a rank waits for job j only in a call that every rank reaches after submitting j
(the ``sample`` after the one that submitted it, a save, a flush, a close), and the
learner's thread never holds the shard's lock while it waits for anything remote.

A job that raises hands its error to whoever waits for it. An error that every rank
raises alike (a bad argument, an empty buffer: the ranks are still in step) leaves the
thread running; any other error (a timeout, a lost peer, a bug) stops it, fails the jobs
queued behind it, and every later submit raises :class:`SamplerFailed`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from shardreplay.errors import ConfigError, EmptyBufferError, SamplerFailed, ShardReplayError

# Raised alike on every rank after the same collectives: the ranks stay in step.
_IN_STEP = (ConfigError, EmptyBufferError)


class Background:
    """A single worker thread with a FIFO of jobs.

    Args:
        name: the thread's name (shows in stack dumps).
        device: the device collectives run on (a CUDA device is made current in the
            thread, as NCCL needs).
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._device = device
        self.failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread is running."""
        return self._thread.is_alive()

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue ``job``; its future holds what it returns or raises.

        Raises:
            SamplerFailed: an earlier job failed in a way that stopped the thread.
            ConfigError: the thread was closed.
        """
        self.check()
        if self._closed:
            raise ConfigError("this sharded buffer was closed: make a new one to sample again")
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def wait(self, future: Future) -> Any:
        """What the job of ``future`` returned (its error raised here).

        Raises:
            SamplerFailed: the thread ended without running the job, or the job raised
                something not of ours (its error is the ``__cause__``).
            ShardReplayError: the job's own error (e.g. CollectiveTimeout).
        """
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                if not self._thread.is_alive() and not future.done():
                    self.check()
                    raise SamplerFailed("the background sampling thread ended without running "
                                        "this exchange (the buffer was closed?)") from None
            except ShardReplayError:
                raise
            except Exception as exc:  # a bug or an unexpected backend error: ours to name
                raise SamplerFailed(f"the background sampling thread failed: {type(exc).__name__}: "
                                    f"{exc}; this buffer cannot sample any more") from exc

    def check(self) -> None:
        """Raise :class:`SamplerFailed` when a job stopped the thread.

        Raises:
            SamplerFailed: with the job's error as ``__cause__``.
        """
        if self.failure is not None:
            raise SamplerFailed(f"the background sampling thread stopped after an error "
                                f"({type(self.failure).__name__}: {self.failure}); this buffer cannot "
                                "sample any more: close it and stop the run (every rank is told the "
                                "same when a peer is missing)") from self.failure

    def close(self, timeout_s: float) -> bool:
        """Stop the thread once the jobs queued so far have run; wait ``timeout_s`` for it.

        Returns:
            True when the thread has ended.
        """
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)
                if not isinstance(exc, _IN_STEP):
                    self.failure = exc
                    self._fail_queued(exc)
                    return

    def _fail_queued(self, exc: BaseException) -> None:
        """Fail every job queued behind a job that stopped the thread."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(SamplerFailed(f"not run: an earlier exchange failed ({exc})"))
