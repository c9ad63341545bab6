"""Stop requests (SIGINT, SIGTERM) taken from a process's first moments on.

A signal's default action at the wrong moment loses it or makes a mess: SIGINT raises
KeyboardInterrupt wherever the process happens to be (inside an import of torch, say,
where a library may swallow it, or as a traceback), SIGTERM kills the process before it
could say or save anything, and a process started in the background inherits SIGINT
ignored. :func:`take_over` replaces that, as early as a process can, by a record of the
first signal; the code that knows how to stop (the launcher, a learner's loop) asks
:func:`requested` at its own points, or installs its own handler and asks once whether
a signal came before. Only the main thread may install handlers (a ``signal`` rule).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from shardreplay import _signals
from shardreplay.runtime.log_lines import write_line

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the signals taken so far, in order


def _record(signum: int, _frame: Any) -> None:
    _received.append(signum)


def take_over(parent_pid: int | None = None) -> Callable[[], None] | None:
    """Record SIGINT and SIGTERM from now on instead of their default actions.

    Args:
        parent_pid: a child's parent as the parent saw it: a signal that comes once the
            parent is gone (``PR_SET_PDEATHSIG``) ends this process at once, as being
            killed would; there is nobody left to stop for.

    Returns:
        A function that puts the previous handlers back, or None when this is not the
        main thread (nothing was installed).
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_signal(signum: int, frame: Any) -> None:
        if parent_pid is not None and os.getppid() != parent_pid:
            write_line(f"process {os.getpid()}: its parent (pid {parent_pid}) is gone: exiting")
            os._exit(1)
        _record(signum, frame)

    return _signals.install(dict.fromkeys(STOP_SIGNALS, on_signal))


def requested() -> int | None:
    """The first stop signal taken since :func:`take_over`, or None."""
    return _received[0] if _received else None


def redeliver(restore: Callable[[], None] | None) -> None:
    """Put the previous handlers back (``restore`` from :func:`take_over`), then raise
    the signal taken meanwhile, if any, so it has the effect it would have had."""
    if restore is None:
        return
    restore()
    if _received:
        signal.raise_signal(_received.pop(0))
