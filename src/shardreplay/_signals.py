"""The one place shardreplay installs signal handlers.

A handler is process-wide and only the main thread may install one (Python's rule), so
every part that wants one (a process's stop record from its first moments,
``runtime.stop_signals``; a checkpoint trigger; an actor's stop flag; the launcher's
forwarding to its learners) asks :func:`install`, which checks the thread and returns
how to put the replaced handlers back. ``tests/test_package.py`` checks that no other
module calls ``signal.signal``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from shardreplay.errors import ConfigError

__all__ = ["install"]


def install(handlers: Mapping[int, Any]) -> Callable[[], None]:
    """Install ``handlers`` (``{signal number: handler}``, a callable or ``signal.SIG_IGN``
    / ``SIG_DFL``).

    Returns:
        A function that puts back the handlers these replaced.

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
