"""Starting many processes that need torch without importing it in each: a ``forkserver``
context imports them once and forks each child from it (docs/semantics.md, "A learner rank
that dies", How they start). The server inherits the caller's signal mask, environment and
``sys.path`` at the first ``Process.start()``. Private attributes of
``multiprocessing.forkserver`` are read through ``getattr``: the stdlib offers no public
way to stop the server or to drop a child's copy of its pipe.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from typing import Any

from shardreplay.transport.local import pid_alive


def preloaded_context(modules: list[str]) -> Any:
    """A ``forkserver`` multiprocessing context whose server imports ``modules`` once (it
    starts as the module docstring says and serves until :func:`stop_server`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(modules)
    return ctx


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the body (a burst of imports: torch's
    leaves some 300,000 objects, none garbage, and starts hundreds of collections that walk
    them), then turn it on and freeze every object alive (:func:`gc.freeze`), so that later
    collections, also those of forked children, skip them. Raises what the body raises (the
    collector is on again, nothing frozen)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
    gc.freeze()


# Set only while a server starts (it inherits the environment then): the file its preload
# creates once imported. The server removes it from its own environment, so its children
# never see it.
READY_ENV = "SHARDREPLAY_FORKSERVER_READY"


def start_server() -> str | None:
    """Start this process's fork server now (it inherits this moment's signal mask) without
    waiting for its preload; returns the file :func:`mark_ready` creates once the preload
    is imported, or None when a server was running already."""
    if server_pid() is not None:
        return None
    path = os.path.join(tempfile.gettempdir(), f"shardreplay-forkserver-{os.getpid()}-{uuid.uuid4().hex}")
    os.environ[READY_ENV] = path
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[READY_ENV]
    return path


def mark_ready() -> None:
    """In a fork server started by :func:`start_server`: say the preload is imported (call
    it at the end of the last preload module). Elsewhere it does nothing."""
    path = os.environ.pop(READY_ENV, None)
    if path:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def wait_until_ready(path: str | None, stop: Callable[[], bool], poll_s: float = 0.05,
                     timeout_s: float = 600.0) -> bool:
    """Wait, with signal handlers free to run, until the server of :func:`start_server`
    has imported its preload (``path`` exists) or has died (the first ``start()`` then
    raises as usual), at most ``timeout_s`` (a preload module the server cannot find is
    skipped by it silently, and nothing marks it ready: ``start()`` then serves as before).
    Returns False when ``stop()`` became true first: the server, still importing and with
    no child yet, is killed (:func:`stop_server` then reaps it), so a stop asked while a
    loaded machine imports torch takes effect at once."""
    if path is None:
        return True
    deadline = time.monotonic() + timeout_s
    try:
        while not os.path.exists(path) and time.monotonic() < deadline:
            pid = server_pid()
            if pid is None or not pid_alive(pid):
                return True
            if stop():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                return False
            time.sleep(poll_s)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def server_pid() -> int | None:
    """The pid of this process's fork server, or None when none runs."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def stop_server() -> None:
    """Stop this process's fork server (if one runs) and reap it; call it once its
    children have exited."""
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None and server_pid() is not None:
        with contextlib.suppress(OSError, ChildProcessError):
            stop()


def release_server() -> None:
    """In a child of a fork server: close this process's copy of the server's keep-alive
    pipe, so the server exits with the process that started it (not with the last of
    its children), and a child watching its parent learns of that death."""
    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and server_pid() is None:  # inherited from the server, not our own
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def parent_or_exit(starter_pid: int) -> int:
    """The pid whose exit means this process must go: its parent now (``starter_pid``
    itself when spawned, a fork server ``starter_pid`` started otherwise).

    Raises:
        SystemExit: ``starter_pid`` is gone already (a server exits only after it).
    """
    parent = os.getppid()
    if parent != starter_pid and not pid_alive(starter_pid):
        raise SystemExit(f"process {os.getpid()}: the process that started it (pid {starter_pid}) "
                         "is gone: exiting")
    return parent

