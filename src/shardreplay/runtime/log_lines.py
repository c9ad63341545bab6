"""Log lines that never glue onto the live status line another process draws: on a
terminal each line first returns the cursor to the line's start and clears it (rank 0
redraws its status line below at the next refresh); files and pipes get plain lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, NoReturn

from shardreplay.secrets import mask

CLEAR_LINE = "\r\x1b[K"  # carriage return, then erase to the end of the line


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed stream
        return False


class LineSafeHandler(logging.StreamHandler):
    """A stream handler whose lines start on a cleared line when the stream is a terminal,
    and never show the run's Redis password (:func:`shardreplay.secrets.mask`)."""

    def format(self, record: logging.LogRecord) -> str:
        """The formatted record, after :data:`CLEAR_LINE` on a terminal."""
        text = mask(super().format(record))
        return CLEAR_LINE + text if _is_terminal(self.stream) else text


def configure_logging(level: int, fmt: str) -> None:
    """Like ``logging.basicConfig(level=, format=)`` on stderr, with a :class:`LineSafeHandler`
    (does nothing when the root logger already has handlers, as basicConfig)."""
    handler = LineSafeHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])


def write_line(text: str, fd: int = 2) -> None:
    """Write one line straight to ``fd`` (no logging: for a process about to ``os._exit``),
    on a cleared line when ``fd`` is a terminal. Errors are ignored: nobody may be reading."""
    prefix = CLEAR_LINE if os.isatty(fd) else ""
    with contextlib.suppress(OSError):
        os.write(fd, (prefix + text.rstrip("\n") + "\n").encode())


def exit_directly(code: int) -> NoReturn:
    """Flush the logs and the standard streams, then leave at once (``os._exit``): torch
    2.13's gloo threads can abort the interpreter at exit while DDP still holds a process
    group, or after it was destroyed (pytorch#190489; seen as SIGABRT "terminate called
    without an active exception" on a rank that finished first)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
