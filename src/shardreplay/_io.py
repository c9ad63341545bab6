"""Durable file writes: temporary name, fsync, rename, fsync of the directory."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_name(path: Path) -> Path:
    """A unique hidden temporary name beside ``path`` (readers skip names starting with '.')."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """Open a temporary file; on success fsync it and rename it to ``path``.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    tmp = temp_name(path)
    f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably."""
    with atomic_writer(path) as f:
        f.write(data)
