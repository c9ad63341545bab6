"""Atomic file writes: temp name, fsync, rename, fsync of the directory."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["fsync_dir", "temp_name", "write_atomic"]


def temp_name(final_name: str) -> str:
    """A temp file name unique to this process and call, ending in ``.tmp``."""
    return f"{final_name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename still happened
        pass
    finally:
        os.close(fd)


def write_atomic(final: Path, data: bytes | memoryview, *, tmp_dir: Path | None = None,
                 fsync: bool = True) -> None:
    """Write ``data`` so that readers of ``final`` see the old file or all of the new one.

    Args:
        final: the destination path.
        data: the bytes to write.
        tmp_dir: where the temp file goes (same file system as ``final``); default
            ``final``'s directory. Readers must ignore ``*.tmp`` there.
        fsync: flush file and directory to disk (off only for throw-away data).

    Raises:
        OSError: the write or rename failed; the temp file is removed.
    """
    tmp = (tmp_dir or final.parent) / temp_name(final.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(final)  # os.write names no file: say which one was refused
        raise
    os.close(fd)
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(final.parent)
