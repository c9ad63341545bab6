"""The pipelined half of :class:`ShardedReplayBuffer` (``pipeline=True``): exchanges
queued on the background thread (:mod:`background`), collected by later calls.

``sample`` collects the exchange in flight when it has no batch left, serves one, and
starts the next exchange when it has handed out the last, so that exchange runs while the
learner trains. Every exchange runs under the shard's lock, which the thread lets go while
a collective is in flight (``Collectives.unlocked_while_waiting``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from shardreplay.buffer.batch import Batch
from shardreplay.distributed.background import Background
from shardreplay.distributed.drawn import Drawn
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.pending import PendingUpdates


class Pipelining:
    """Pipelined sampling for :class:`ShardedReplayBuffer` (a mixin: it uses the buffer's
    queues, lock, group and draw)."""

    # Class defaults: nothing in flight, no thread (also for stand-ins made without __init__).
    _background: Background | None = None
    _inflight: Future | None = None
    _inflight_for: tuple[int, str] | None
    _ready: deque[Drawn]
    _ready_for: tuple[int, str] | None
    _pending: PendingUpdates
    _lock: threading.Lock
    _xcomm: Collectives
    _closed: bool

    def _check_asked(self, asked: tuple[int, str]) -> None:
        raise NotImplementedError

    def _serve(self, d: Drawn) -> Batch:
        raise NotImplementedError

    def _draw_batches(self, n: int, mode: str, pending: PendingUpdates) -> list[Drawn]:
        raise NotImplementedError

    def _sample_pipelined(self, asked: tuple[int, str]) -> Batch:
        assert self._background is not None
        self._background.check()
        if not self._ready:
            if self._inflight is None:
                self._start_exchange(asked)
            self._collect()
        self._check_asked(asked)
        with self._lock:
            batch = self._serve(self._ready.popleft())
        if not self._ready:  # the next exchange runs while this batch trains
            self._start_exchange(asked)
        return batch

    def _start_exchange(self, asked: tuple[int, str]) -> None:
        """Queue a refill on the background thread, with the updates queued so far."""
        assert self._background is not None
        job = partial(self._locked, self._draw_batches, *asked, self._pending.detach())
        self._inflight, self._inflight_for = self._background.submit(job), asked

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    def _collect(self) -> None:
        """Wait for the exchange in flight and queue its batches."""
        assert self._background is not None and self._inflight is not None
        future, self._inflight = self._inflight, None
        self._ready.extend(self._background.wait(future))
        self._ready_for = self._inflight_for

    def settle(self) -> None:
        """Wait for the background exchange in flight, if any (its batches stay
        prefetched); afterwards nothing touches the shard until the next call. Not
        collective, and it raises nothing: an error that stopped the thread is raised by
        the next call that needs it; one every rank meets alike (an empty buffer) goes
        with its exchange, and the next ``sample`` draws anew. A checkpoint save does
        this first.

        Waits at most about ``timeout_s`` per collective of that exchange (a missing peer).
        """
        if self._inflight is None:
            return
        try:
            self._collect()
        except Exception:  # kept by the thread, raised by the next call
            self._ready.clear()
            self._ready_for = None

    def close(self) -> None:
        """Stop the background thread (after the exchange in flight) and release the
        buffer's own process group. Idempotent; a no-op without a pipeline. Every rank
        should close at the same point; a rank whose peers never join its last exchange
        waits for the collective timeout first. Later ``sample`` calls raise ConfigError.
        """
        if self._background is None:
            return
        self.settle()
        self._ready.clear()
        if self._background.close(timeout_s=10.0) and not self._closed:
            self._closed = True
            self._xcomm.destroy()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
