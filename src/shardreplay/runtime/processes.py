"""Child processes that always end: actor pools and process-tree cleanup.

Every child asks the kernel for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``),
so killing a learner, even with ``kill -9``, takes its actors with it; stopping sends
SIGTERM, waits, then kills what is left. Children start with SIGINT blocked: Ctrl-C
reaches every process of the terminal's process group, and the parent, not each
child, decides how its children stop (a child still importing would otherwise die
of a KeyboardInterrupt and count as a crash).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from shardreplay.runtime.actor import ActorSettings
from shardreplay.transport.base import Transport

log = logging.getLogger("shardreplay.processes")
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask for SIGTERM when the parent process exits (no-op off Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def children_block_sigint() -> Iterator[None]:
    """Processes started inside this block have SIGINT blocked for their whole life.

    The signal mask survives ``fork`` and ``exec``, so a spawned child never sees a
    Ctrl-C, from its first instruction on (it stays pending, undelivered); its own
    children inherit the mask too. Only the calling thread blocks SIGINT meanwhile:
    the process's other threads, or this one after the block, still take a Ctrl-C
    meant for the caller, so nothing is lost (an ignored disposition would lose it).
    """
    with contextlib.suppress(Exception):
        # Starting the tracker inside the block would unblock SIGINT (it masks and
        # unmasks it around its own start), and the child would not inherit the mask.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def stop_processes(procs: list[Any], timeout_s: float) -> None:
    """SIGTERM every live process, wait up to ``timeout_s``, then SIGKILL and reap."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(OSError, ValueError):
                p.terminate()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            log.warning("process %s did not stop in %.0f s: killing it", p.name, timeout_s)
            with contextlib.suppress(OSError, ValueError):
                p.kill()
            p.join(5)


def _actor_main(settings: ActorSettings, transport: Transport | None) -> None:
    die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s actor %(message)s")
    from shardreplay.runtime.actor import StopFlag, run

    stop = StopFlag()
    stop.install((signal.SIGTERM,))  # SIGINT stays blocked: the learner stops its actors
    run(settings, transport, stop)


class ActorPool:
    """The actors of one learner shard, restarted after a crash up to a bound.

    Args:
        settings: one ActorSettings per actor of this shard.
        transport: the shard's transport object to hand to children (``local`` rings),
            or None for each actor to open its own.
        max_restarts: restarts allowed per actor.
    """

    def __init__(self, settings: list[ActorSettings], transport: Transport | None,
                 max_restarts: int) -> None:
        self._settings = {s.actor_id: s for s in settings}
        self._transport = transport
        self._max_restarts = max_restarts
        self._procs: dict[int, Any] = {}
        self.restarts: dict[int, int] = dict.fromkeys(self._settings, 0)
        self.given_up: set[int] = set()
        self._ctx = mp.get_context("spawn")

    def start(self) -> None:
        """Start every actor."""
        for actor_id in self._settings:
            self._start(actor_id)

    def _start(self, actor_id: int) -> None:
        settings = self._settings[actor_id]
        if settings.seed is not None and self.restarts[actor_id]:
            # A restarted actor must not replay the episodes its first life played.
            settings = dataclasses.replace(settings, seed=settings.seed + 1_000_003 * self.restarts[actor_id])
        p = self._ctx.Process(target=_actor_main, name=f"actor-{actor_id}", daemon=False,
                              args=(settings, self._transport))
        with children_block_sigint():
            p.start()
        self._procs[actor_id] = p

    def check(self) -> int:
        """Restart actors that died abnormally (within the bound); returns live actors."""
        for actor_id, p in list(self._procs.items()):
            if p.is_alive() or p.exitcode is None:
                continue
            p.join()
            if p.exitcode != 0 and self.restarts[actor_id] < self._max_restarts:
                self.restarts[actor_id] += 1
                log.warning("actor %d exited with %s: restart %d of %d", actor_id, p.exitcode,
                            self.restarts[actor_id], self._max_restarts)
                self._start(actor_id)
            else:
                if p.exitcode != 0:
                    self.given_up.add(actor_id)
                    log.warning("actor %d exited with %s after %d restarts: not restarted; training "
                                "goes on with the others", actor_id, p.exitcode, self.restarts[actor_id])
                del self._procs[actor_id]
        return sum(p.is_alive() for p in self._procs.values())

    def pids(self) -> list[int]:
        """Process ids of the live actors."""
        return [p.pid for p in self._procs.values() if p.is_alive()]

    def stop(self, timeout_s: float = 10.0, while_waiting: Callable[[], None] | None = None) -> None:
        """Stop every actor: SIGTERM, wait up to ``timeout_s``, then SIGKILL and reap.

        Args:
            timeout_s: how long actors may take to send what they hold and exit.
            while_waiting: called repeatedly until they have exited (the learner drains
                its transport there, so the actors' last chunks find room and land in
                the shard instead of blocking the actors until they are killed).
        """
        procs = list(self._procs.values())
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    p.terminate()
        deadline = time.monotonic() + timeout_s
        while while_waiting is not None and any(p.is_alive() for p in procs) \
                and time.monotonic() < deadline:
            while_waiting()
        stop_processes(procs, max(deadline - time.monotonic(), 0.5))
        self._procs.clear()
