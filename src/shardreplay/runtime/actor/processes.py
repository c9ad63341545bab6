"""Child processes that always end: actor pools, which die with their learner, and the
process-tree cleanup of the launcher (docs/semantics.md, "A learner rank that dies")."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import resource_tracker
from typing import Any

from shardreplay import _signals
from shardreplay._signals import die_with_parent  # its home: the bottom layer
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.log_lines import configure_logging, write_line
from shardreplay.transport.base import Transport

log = logging.getLogger("shardreplay.processes")


@contextlib.contextmanager
def children_block_signals(signals: set[signal.Signals]) -> Iterator[None]:
    """Processes started inside this block are born with ``signals`` blocked (the mask
    survives ``fork`` and ``exec``: pending, not lost); a child unblocks one once its handler
    is in place. Only the calling thread blocks them meanwhile, so a Ctrl-C meant for the
    caller is still taken (an ignored disposition would lose it).
    """
    with contextlib.suppress(Exception):
        # Starting the tracker inside the block would unblock SIGINT (it masks and
        # unmasks it around its own start), and the child would not inherit the mask.
        resource_tracker.ensure_running()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def stop_processes(procs: list[Any], timeout_s: float, grace_s: float = 0.0,
                   while_waiting: Callable[[], None] | None = None) -> None:
    """Give started processes up to ``grace_s`` in all to exit by themselves, then SIGTERM
    every live one, wait up to ``timeout_s`` (calling ``while_waiting`` repeatedly until
    they exited, if given), then SIGKILL and reap."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(OSError, ValueError):
                p.terminate()
    deadline = time.monotonic() + timeout_s
    while while_waiting is not None and any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while_waiting()
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.5 if while_waiting else 0.0))
    for p in procs:
        if p.is_alive():
            log.warning("process %s did not stop in %.0f s: killing it", p.name, timeout_s)
            with contextlib.suppress(OSError, ValueError):
                p.kill()
            p.join(5)


def _actor_main(settings: ActorSettings, transports: Mapping[int, Transport] | None, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    configure_logging(logging.WARNING, "%(asctime)s actor %(message)s")
    from shardreplay.runtime.actor.loop import run

    stop = threading.Event()

    def on_sigterm(*_args: Any) -> None:
        if os.getppid() != parent_pid:
            # The learner died (this is PR_SET_PDEATHSIG): nobody drains the ring, so
            # sending what this actor holds would only block. Leave as if killed (every
            # medium survives that: a record half written is never published), without
            # the seconds an interpreter with torch loaded takes to tear down.
            write_line(f"actor {settings.actor_id}: its learner (pid {parent_pid}) is gone: "
                       "exiting without sending what it holds")
            os._exit(1)
        stop.set()

    _signals.install({signal.SIGTERM: on_sigterm})  # SIGINT stays blocked: the learner stops its actors
    run(settings, transports, stop)


class ActorPool:
    """The actors of one learner shard (one ActorSettings each), restarted after a crash
    up to ``max_restarts`` times each. ``transports``: the shards' transport objects to hand
    to children (``local`` rings, by shard: an actor may feed several), or None for each
    actor to open its own.
    """

    def __init__(self, settings: list[ActorSettings], transports: Mapping[int, Transport] | None,
                 max_restarts: int) -> None:
        self._settings = {s.actor_id: s for s in settings}
        self._transports = transports
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
                              args=(settings, self._transports, os.getpid()))
        with children_block_signals({signal.SIGINT}):
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
                    log.warning("actor %d exited with %s after %d restarts: not restarted "
                                "(--max-actor-restarts)", actor_id, p.exitcode, self.restarts[actor_id])
                del self._procs[actor_id]
        return sum(p.is_alive() for p in self._procs.values())

    def pids(self) -> list[int]:
        """Process ids of the live actors."""
        return [p.pid for p in self._procs.values() if p.is_alive()]

    def stop(self, timeout_s: float = 10.0, while_waiting: Callable[[], None] | None = None) -> None:
        """Stop every actor: SIGTERM, wait up to ``timeout_s`` for them to send what they
        hold and exit, then SIGKILL and reap. ``while_waiting`` is called repeatedly until
        they have exited (the learner drains its transport there, so the actors' last chunks
        find room and land in the shard instead of blocking the actors until they are killed).
        """
        stop_processes(list(self._procs.values()), timeout_s, while_waiting=while_waiting)
        self._procs.clear()


def describe_exit(code: int) -> str:
    """How a process ended, from its ``exitcode``: "died with SIGKILL", "exited with code 3"."""
    if code < 0:
        try:
            return f"died with {signal.Signals(-code).name}"
        except ValueError:
            return f"died with signal {-code}"
    return f"exited with code {code}"


# Whether this kernel lists each thread's children in /proc (CONFIG_PROC_CHILDREN, Linux 3.5 on).
_HAS_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def descendant_pids(root: int) -> list[int] | None:
    """The pids under ``root`` now (children, theirs, ...), or None where the kernel does
    not list children in ``/proc`` (the caller then asks ``psutil``).

    Reads the tree's own ``/proc/<pid>/task/<tid>/children`` files: a few reads per
    process of the tree, where ``psutil``'s ``children(recursive=True)`` reads the stat
    file of every process on the machine.
    """
    if not _HAS_CHILDREN_FILES:
        return None
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone meanwhile
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:  # the thread or the process ended meanwhile
                continue
            found += children
            todo += children
    return found


class ProcessTree:
    """Every descendant of this process ever seen, by pid and start time.

    A process whose parent dies is reparented (to init or a subreaper) and leaves this
    process's tree: call :meth:`scan` regularly while the children run, so
    :meth:`stop` still finds it. ``exclude()`` gives the pids never to signal (the
    resource tracker: closing its pipe stops it, so it can still unlink what leaked).
    Without ``psutil`` (the ``train`` extra) nothing is recorded and :meth:`stop` does
    nothing: the caller still stops its own children.
    """

    def __init__(self, exclude: Callable[[], set[int]] = lambda: set()) -> None:
        try:
            import psutil
        except ImportError:  # the ``train`` extra brings it; without it, only direct children are stopped
            psutil = None
        self._psutil = psutil
        self._exclude = exclude
        self._seen: dict[int, float] = {}

    def scan(self) -> None:
        """Record the descendants alive now."""
        if self._psutil is None:
            return
        pids = descendant_pids(os.getpid())
        if pids is None:
            with contextlib.suppress(self._psutil.Error):
                pids = [child.pid for child in self._psutil.Process().children(recursive=True)]
        for pid in pids or []:
            with contextlib.suppress(self._psutil.Error):
                self._seen[pid] = self._psutil.Process(pid).create_time()  # a reused pid: the newest

    def alive(self) -> list[Any]:
        """The recorded processes still running (not zombies, not excluded)."""
        if self._psutil is None:
            return []
        found, skip = [], self._exclude()
        for pid, created in self._seen.items():
            with contextlib.suppress(self._psutil.Error):
                p = self._psutil.Process(pid)
                if pid not in skip and p.create_time() == created \
                        and p.status() != self._psutil.STATUS_ZOMBIE:
                    found.append(p)
        return found

    def stop(self, timeout_s: float) -> list[str]:
        """SIGTERM every recorded process still running, wait up to ``timeout_s``, then
        SIGKILL the rest; returns descriptions of those that had to be killed."""
        self.scan()
        procs = self.alive()
        for p in procs:
            with contextlib.suppress(self._psutil.Error if self._psutil else OSError):
                p.terminate()
        procs = self._still_running(procs, timeout_s)
        killed = []
        for p in procs:
            with contextlib.suppress(self._psutil.Error):
                killed.append(f"pid {p.pid} ({p.name()})")
                p.kill()
        self._still_running(procs, 5.0)
        return killed

    def _still_running(self, procs: list[Any], timeout_s: float) -> list[Any]:
        """Wait up to ``timeout_s`` for ``procs`` to end (zombies count as ended); returns the rest."""
        deadline = time.monotonic() + timeout_s
        while procs and time.monotonic() < deadline:
            time.sleep(0.02)
            procs = [p for p in procs if self._running(p)]
        return procs

    def _running(self, p: Any) -> bool:
        try:
            return bool(p.is_running() and p.status() != self._psutil.STATUS_ZOMBIE)
        except self._psutil.Error:
            return False


def resource_tracker_pid() -> int | None:
    """The pid of this process's multiprocessing resource tracker, or None."""
    return getattr(resource_tracker._resource_tracker, "_pid", None)


def stop_resource_tracker(timeout_s: float = 5.0) -> None:
    """End the multiprocessing resource tracker this process started (once every child has
    exited: they hold its pipe too), and wait up to ``timeout_s`` before killing it. Closing
    its pipe makes it unlink whatever is still registered (leaked); garbage is collected
    first, so semaphores referenced only by garbage unregister themselves.
    """
    gc.collect()
    tracker = resource_tracker._resource_tracker
    lock = getattr(tracker, "_lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
        if fd is None or pid is None:
            return
        # Private attributes the stub does not declare; read through getattr above.
        tracker._fd = tracker._pid = None  # type: ignore[attr-defined]
        with contextlib.suppress(OSError):
            os.close(fd)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            log.warning("the multiprocessing resource tracker (pid %d) did not exit: killing it", pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)
