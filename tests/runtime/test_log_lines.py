"""Log lines of other processes never glue onto rank 0's live status line (issue 11, 8).

A real rich progress bar draws on a pseudo-terminal; a log line is written to the same
terminal through :class:`LineSafeHandler`, as another process of the run would; a small
terminal model replays the bytes the terminal received, and the screen must show the log
line alone on its line with the status line drawn again below it.
"""

from __future__ import annotations

import io
import logging
import os
import pty
import re

from shardreplay.runtime.log_lines import CLEAR_LINE, LineSafeHandler, write_line

_CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")


def screen(data: str, width: int = 80) -> list[str]:
    """The lines a terminal shows after ``data`` (CR, LF, cursor up, erase line; colours
    and cursor visibility ignored)."""
    lines, row, col, i = [""], 0, 0, 0
    while i < len(data):
        m = _CSI.match(data, i)
        if m:
            arg, cmd = m.groups()
            if cmd == "A":
                row = max(row - int(arg or 1), 0)
            elif cmd == "K":
                lines[row] = lines[row][:col] if arg in ("", "0") else ""
            i = m.end()
            continue
        ch = data[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            lines.extend([""] * (row + 1 - len(lines)))
        elif ch.isprintable():
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col = min(col + 1, width)
        i += 1
    return lines


def _read_all(fd: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out.decode()
        if not chunk:
            return out.decode()
        out += chunk


def test_a_log_line_lands_on_its_own_line_above_a_live_bar() -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    master, slave = pty.openpty()
    os.set_blocking(master, False)
    term = os.fdopen(slave, "w", buffering=1)
    try:
        console = Console(file=term, force_terminal=True, width=80, color_system=None)
        bar = Progress(TextColumn("train"), BarColumn(bar_width=10), TextColumn("{task.fields[t]}"),
                       console=console, auto_refresh=False)
        bar.start()
        task = bar.add_task("train", total=100, t="steps 10")
        bar.refresh()
        handler = LineSafeHandler(term)  # another process's handler on the same terminal
        handler.setFormatter(logging.Formatter("rank 1: %(message)s"))
        handler.emit(logging.LogRecord("x", logging.WARNING, __file__, 1, "peer slow", None, None))
        bar.update(task, completed=50, t="steps 50")
        bar.refresh()
        bar.stop()
        term.flush()
        shown = [line.rstrip() for line in screen(_read_all(master)) if line.strip()]
    finally:
        term.close()
        os.close(master)
    assert shown[0] == "rank 1: peer slow", shown
    assert len(shown) == 2 and shown[1].startswith("train") and "steps 50" in shown[1], shown


def test_without_the_clearing_the_same_line_is_glued_onto_the_bar() -> None:
    """The model above can see the fault: a plain handler's line continues the bar's."""
    from rich.console import Console
    from rich.progress import Progress, TextColumn

    master, slave = pty.openpty()
    os.set_blocking(master, False)
    term = os.fdopen(slave, "w", buffering=1)
    try:
        console = Console(file=term, force_terminal=True, width=80, color_system=None)
        bar = Progress(TextColumn("train steps 10"), console=console, auto_refresh=False)
        bar.start()
        bar.add_task("train", total=100)
        bar.refresh()
        plain = logging.StreamHandler(term)
        plain.emit(logging.LogRecord("x", logging.WARNING, __file__, 1, "peer slow", None, None))
        term.flush()
        shown = screen(_read_all(master))
        bar.stop()
    finally:
        term.close()
        os.close(master)
    assert any("train steps 10" in line and "peer slow" in line for line in shown), shown


def test_files_and_pipes_get_plain_lines() -> None:
    stream = io.StringIO()
    handler = LineSafeHandler(stream)
    handler.emit(logging.LogRecord("x", logging.WARNING, __file__, 1, "hello", None, None))
    assert stream.getvalue() == "hello\n"
    r, w = os.pipe()
    try:
        write_line("bye", fd=w)
        assert os.read(r, 100) == b"bye\n"
    finally:
        os.close(r)
        os.close(w)


def test_write_line_clears_the_line_on_a_terminal() -> None:
    master, slave = pty.openpty()
    try:
        write_line("actor 3: leaving", fd=slave)
        assert os.read(master, 100).startswith((CLEAR_LINE + "actor 3: leaving").encode())
    finally:
        os.close(master)
        os.close(slave)
