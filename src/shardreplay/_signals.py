"""The one place shardreplay installs signal handlers (``tests/test_package.py`` checks
that no other module calls ``signal.signal``), the stop requests (SIGINT, SIGTERM) it
records from a process's first moments on, and the signal a child asks for when its
parent dies (:func:`die_with_parent`).

Only the main thread may install a handler, so every part that wants one asks
:func:`install`. A signal's default action at the wrong moment loses it or makes a mess
(KeyboardInterrupt inside an import, SIGTERM before anything is saved, SIGINT ignored in a
background process): :func:`take_over` replaces it as early as possible by a record of
the first signal, which the code that knows how to stop asks for (:func:`requested`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from shardreplay.errors import ConfigError

__all__ = ["STOP_SIGNALS", "die_with_parent", "install", "redeliver", "requested", "take_over"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals taken so far, in order


def install(handlers: Mapping[int, Any]) -> Callable[[], None]:
    """Install ``handlers`` (``{signal number: handler}``, a callable or ``signal.SIG_IGN``
    / ``SIG_DFL``); a function that puts back the handlers these replaced.

    Raises:
        ConfigError: not called from the main thread (nothing is installed).
    """
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError("signal handlers can only be installed from the main thread")
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def take_over(parent_pid: int | None = None) -> Callable[[], None] | None:
    """Record SIGINT and SIGTERM from now on instead of their default actions; a function
    that puts the previous handlers back (None off the main thread: nothing installed).
    With ``parent_pid`` (a child's parent as the parent saw it), a signal that comes once
    the parent is gone (``PR_SET_PDEATHSIG``) ends this process at once, as being killed
    would: there is nobody left to stop for."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_signal(signum: int, _frame: Any) -> None:
        if parent_pid is not None and os.getppid() != parent_pid:
            line = f"process {os.getpid()}: its parent (pid {parent_pid}) is gone: exiting\n"
            with contextlib.suppress(OSError):  # no logging: this process is about to _exit
                os.write(2, line.encode())
            os._exit(1)
        _received.append(signum)

    return install(dict.fromkeys(STOP_SIGNALS, on_signal))


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


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGTERM) -> None:
    """Ask for ``signum`` when the parent process exits (``PR_SET_PDEATHSIG``; a no-op off
    Linux). With ``parent_pid`` (the parent as the parent saw it), exit at once when it is
    gone already: it died before this request, so the kernel will never send the signal.

    Raises:
        SystemExit: ``parent_pid`` is given and is no longer this process's parent.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # 1: PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:
        raise SystemExit(f"process {os.getpid()}: its parent (pid {parent_pid}) is gone: exiting")
