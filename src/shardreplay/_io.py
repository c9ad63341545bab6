"""Durable file writes: temporary name, fsync, rename, fsync of the directory; and
the one translation of a refused write (full, read-only, no permission) into a
:class:`~shardreplay.errors.StorageError` naming the path and the OS error."""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from shardreplay.errors import StorageError

# The OS errors of a file system that refuses writes: a full disk or quota, a
# read-only mount, no permission, a failing device, a file too large.
STORAGE_ERRNOS = frozenset({errno_codes.ENOSPC, errno_codes.EDQUOT, errno_codes.EROFS, errno_codes.EACCES,
                            errno_codes.EPERM, errno_codes.EIO, errno_codes.EFBIG})


def naming(exc: OSError, path: Path | str) -> OSError:
    """``exc`` with ``path`` as its file name when it names none (``os.write`` on a
    descriptor does not), so whoever reports it can say which file."""
    if exc.filename is None:
        exc.filename = str(path)
    return exc


def storage_error(exc: BaseException | None, path: Path | str | None = None) -> StorageError | None:
    """The :class:`StorageError` for ``exc`` when it is one, or is or was caused by an
    OSError of a file system refusing a write (:data:`STORAGE_ERRNOS`; the path is its
    file name, else ``path``): "cannot write PATH: No space left on device (ENOSPC)".
    None otherwise."""
    for cause in causes(exc):
        if isinstance(cause, StorageError):
            return cause
        if isinstance(cause, OSError) and cause.errno in STORAGE_ERRNOS:
            where = cause.filename if cause.filename is not None else path
            code = errno_codes.errorcode.get(cause.errno, str(cause.errno))
            return StorageError(f"cannot write {where}: {cause.strerror} ({code})", path=str(where),
                                errno=cause.errno)
    return None


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then what caused it (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, *, fsync: bool = True, tmp_dir: Path | None = None) -> Iterator[BinaryIO]:
    """The project's one atomic write: a temporary file (in ``tmp_dir``, default ``path``'s
    directory; readers there skip ``.*`` / ``*.tmp``), on success fsynced (``fsync=False``
    only for data a machine crash may lose), renamed to ``path``, its directory fsynced:
    readers of ``path`` see the old file or all of the new one.

    Raises:
        OSError: the write or rename failed (it names ``path``); the temporary file is
            removed and ``path`` is untouched (:func:`storage_error` makes it a
            :class:`StorageError`).
    """
    path = Path(path)
    tmp = Path(tmp_dir or path.parent) / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
    except OSError as exc:
        raise naming(exc, path) from None
    try:
        yield f
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # a full disk fails the close's flush again
            f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            naming(exc, path)
        raise


def atomic_write_bytes(path: Path, data: bytes | bytearray | memoryview, *, fsync: bool = True,
                       tmp_dir: Path | None = None) -> None:
    """Write ``data`` to ``path`` atomically (durably with ``fsync``); see :func:`atomic_writer`.

    Raises:
        OSError: as :func:`atomic_writer`.
    """
    with atomic_writer(path, fsync=fsync, tmp_dir=tmp_dir) as f:
        f.write(data)
