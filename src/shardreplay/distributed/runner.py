"""Where a :class:`ShardedReplayBuffer`'s exchanges run: inline, in the caller's ``sample``,
or on a background thread (``pipeline=True``). A runner owns the prefetched batches and,
when pipelined, the thread, its job queue and the shard's lock.

Pipelined, ``sample`` collects the exchange in flight when it has no batch left, serves one,
and starts the next exchange when it has handed out the last, so that exchange runs while
the learner trains. Every exchange runs under the shard's lock; the runner passes
:meth:`BackgroundRunner.released` with each job to the collectives, which let the lock go
while they wait, so the learner's thread can write meanwhile. The ordering argument is in
:mod:`background`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from shardreplay.buffer.batch import Batch
from shardreplay.distributed.background import Background
from shardreplay.distributed.drawn import Drawn
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.priorities import PriorityRouter
from shardreplay.distributed.refill import Refill
from shardreplay.errors import ConfigError

Asked = tuple[int, str]  # (batch_size, mode) of a sample() call
Serve = Callable[[Drawn], Batch]


class InlineRunner:
    """Exchanges run in the calling thread; no lock (nothing else touches the shard).

    Args:
        refill: one exchange.
        router: the priority router (its queue travels with each exchange).
    """

    pipeline = False

    def __init__(self, refill: Refill, router: PriorityRouter) -> None:
        self._refill, self._router = refill, router
        self._ready: deque[Drawn] = deque()
        self._ready_for: Asked | None = None

    @property
    def prefetched(self) -> int:
        """Batches drawn and not yet served."""
        return len(self._ready)

    @property
    def alive(self) -> bool:
        """Whether a background thread runs (never inline)."""
        return False

    @property
    def in_flight(self) -> bool:
        """Whether an exchange was started and not yet collected (never inline)."""
        return False

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
            self._ready.extend(self._refill(asked[0], self._router.pending))
            self._ready_for = asked
        self._check_asked(asked)
        return serve(self._ready.popleft())

    def flush(self) -> int:
        """Route the queued updates now (collective); the number applied here."""
        return self._router.flush(self._router.pending.detach())

    def settle(self) -> None:
        """Nothing is in flight inline."""

    def discard(self) -> None:
        """Drop the prefetched batches and the queued updates."""
        self.settle()
        self._ready.clear()
        self._ready_for = None
        self._router.pending.take()

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


class _Unlocked:
    """``lock`` let go for the span of a ``with`` (taken back on the way out)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        self._lock.release()

    def __exit__(self, *exc: object) -> None:
        self._lock.acquire()


class BackgroundRunner(InlineRunner):
    """Exchanges run on one background thread over the buffer's own group, under the
    shard's lock.

    Args:
        refill: one exchange (over ``comm``).
        router: the priority router.
        comm: the buffer's own group, destroyed by :meth:`close`.
        name: the thread's name.
    """

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

    def released(self) -> AbstractContextManager[Any]:
        """The lock let go while a collective of a job waits (passed to the collectives)."""
        return _Unlocked(self._lock)

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
