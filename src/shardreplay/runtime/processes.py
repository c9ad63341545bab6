"""Child processes that always end: actor pools and process-tree cleanup.

Every child asks the kernel for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``),
so killing a learner, even with ``kill -9``, takes its actors with it; stopping sends
SIGTERM, waits, then kills what is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import signal
from typing import Any

from shardreplay.runtime.actor import ActorSettings
from shardreplay.transport.base import Transport

log = logging.getLogger("shardreplay.processes")
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask for SIGTERM when the parent process exits (no-op off Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
    from shardreplay.runtime.actor import run

    run(settings, transport)


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
        self._ctx = mp.get_context("spawn")

    def start(self) -> None:
        """Start every actor."""
        for actor_id in self._settings:
            self._start(actor_id)

    def _start(self, actor_id: int) -> None:
        p = self._ctx.Process(target=_actor_main, name=f"actor-{actor_id}", daemon=False,
                              args=(self._settings[actor_id], self._transport))
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
                del self._procs[actor_id]
        return sum(p.is_alive() for p in self._procs.values())

    def pids(self) -> list[int]:
        """Process ids of the live actors."""
        return [p.pid for p in self._procs.values() if p.is_alive()]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every actor (SIGTERM, then SIGKILL after ``timeout_s``)."""
        stop_processes(list(self._procs.values()), timeout_s)
        self._procs.clear()
