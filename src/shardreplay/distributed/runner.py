"""Where a :class:`ShardedReplayBuffer`'s exchanges run: inline, in the caller's ``sample``,
or on a background thread (``pipeline=True``; docs/semantics.md, "Sharded sampling").
A runner owns the prefetched batches and, pipelined, the thread, its job queue and the
shard's lock, which a job's collectives let go while they wait. The thread issues the
jobs in the order the caller's collective calls submitted them, so they pair up alike on
every rank; a rank waits for job j only in a call every rank reaches after submitting j.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch

from shardreplay.buffer.batch import Batch
from shardreplay.distributed.exchange import Drawn, Refill
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.priorities import PriorityRouter
from shardreplay.errors import ConfigError, EmptyBufferError, SamplerFailed, ShardReplayError

Asked = tuple[int, str]  # (batch_size, mode) of a sample() call
Serve = Callable[[Drawn], Batch]


class InlineRunner:
    """Exchanges (``refill``, with the ``router``'s queue) run in the calling thread; no
    lock (nothing else touches the shard)."""

    pipeline = False

    def __init__(self, refill: Refill, router: PriorityRouter) -> None:
        self._refill, self._router = refill, router
        self._ready: deque[Drawn] = deque()
        self._ready_for: Asked | None = None

    @property
    def prefetched(self) -> int:
        """Batches drawn and not yet served."""
        return len(self._ready)

    def guard(self) -> AbstractContextManager[Any]:
        """What a write to the shard holds: nothing inline."""
        return contextlib.nullcontext()

    def next(self, asked: Asked, serve: Serve) -> Batch:
        """The next batch (an exchange first when none is prefetched), served by ``serve``.

        Raises:
            ConfigError: ``asked`` differs from the prefetched batches'.
            EmptyBufferError, CollectiveTimeout: from the exchange.
        """
        if not self._ready:
            self._ready.extend(self._refill(asked[0], self._router.pending.detach()))
            self._ready_for = asked
        self._check_asked(asked)
        return serve(self._ready.popleft())

    def flush(self) -> int:
        """Route the queued updates now (collective); the number applied here."""
        return self._router.flush(self._router.pending.detach())

    def settle(self) -> None:
        """Nothing is in flight inline."""

    def discard(self) -> None:
        """Drop the prefetched batches and the queued updates; the next exchange agrees."""
        self.settle()
        self._ready.clear()
        self._ready_for = None
        self._router.pending.take()
        self._refill.agreed = None

    def close(self) -> None:
        """Nothing to stop inline."""

    def _check_asked(self, asked: Asked) -> None:
        if self._ready_for != asked:
            raise ConfigError(
                f"{len(self._ready)} prefetched batches of {self._ready_for} (batch_size, mode) are "
                f"waiting; with prefetch={self._refill.prefetch}"
                f"{' and pipeline=True' if self.pipeline else ''} "
                f"every sample() call must ask for the same batch_size until they are used "
                f"(got {asked}); discard_prefetched() on every rank drops them")


class BackgroundRunner(InlineRunner):
    """Exchanges run on one background thread (named ``name``) over the buffer's own
    group ``comm`` (destroyed by :meth:`close`), under the shard's lock."""

    pipeline = True

    def __init__(self, refill: Refill, router: PriorityRouter, comm: Collectives, name: str) -> None:
        super().__init__(refill, router)
        self._comm = comm
        self._lock = threading.Lock()
        self._background = Background(name, comm.device)
        self._inflight: Future | None = None
        self._inflight_for: Asked | None = None
        self._closed = False
        weakref.finalize(self, self._background.close, 0.0)

    @property
    def alive(self) -> bool:
        """Whether the background thread runs."""
        return self._background.alive

    @property
    def in_flight(self) -> bool:
        """Whether an exchange was started and not yet collected."""
        return self._inflight is not None

    def guard(self) -> AbstractContextManager[Any]:
        """The shard's lock (the thread draws from the shard)."""
        return self._lock

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The lock let go while a collective of a job waits (passed to the collectives),
        taken back on the way out."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def next(self, asked: Asked, serve: Serve) -> Batch:
        """A batch an earlier exchange drew; starts the next exchange after the last one.

        Raises:
            ConfigError: ``asked`` differs from the prefetched batches'; closed.
            SamplerFailed: the thread stopped after an error.
            EmptyBufferError, CollectiveTimeout: from the exchange collected.
        """
        self._background.check()
        if not self._ready:
            if self._inflight is None:
                self._start(asked)
            self._collect()
        self._check_asked(asked)
        with self._lock:
            batch = serve(self._ready.popleft())
        if not self._ready:  # the next exchange runs while this batch trains
            self._start(asked)
        return batch

    def flush(self) -> int:
        """Finish the exchange in flight, then route the queued updates on the thread."""
        if self._inflight is not None:
            self._collect()
        job = partial(self._locked, self._router.flush, self._router.pending.detach())
        return int(self._background.wait(self._background.submit(job)))

    def settle(self) -> None:
        """Wait for the exchange in flight, if any (errors are raised by the next call)."""
        if self._inflight is None:
            return
        try:
            self._collect()
        except Exception:  # kept by the thread, raised by the next call
            self._ready.clear()
            self._ready_for = None

    def close(self) -> None:
        """Stop the thread after the exchange in flight; destroy the buffer's own group."""
        self.settle()
        self._ready.clear()
        if self._background.close(timeout_s=10.0) and not self._closed:
            self._closed = True
            self._comm.destroy()

    def _start(self, asked: Asked) -> None:
        """Queue a refill on the thread, with the updates queued so far."""
        job = partial(self._locked, self._refill, asked[0], self._router.pending.detach())
        self._inflight, self._inflight_for = self._background.submit(job), asked

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args, released)`` under the lock, which its collectives let go."""
        with self._lock:
            return fn(*args, self.released)

    def _collect(self) -> None:
        """Wait for the exchange in flight and queue its batches."""
        assert self._inflight is not None
        future, self._inflight = self._inflight, None
        self._ready.extend(self._background.wait(future))
        self._ready_for = self._inflight_for


# Raised alike on every rank after the same collectives: the ranks stay in step.
_IN_STEP = (ConfigError, EmptyBufferError)


class Background:
    """A single worker thread with a FIFO of jobs (a CUDA ``device`` is made current in
    it, as NCCL needs). Apart from its runner: a runner that is collected closes it."""

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
        """Stop the thread once the jobs queued so far have run; wait ``timeout_s`` for it
        to end (True when it has)."""
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
