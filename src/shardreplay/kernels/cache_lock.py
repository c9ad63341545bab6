"""numba's on-disk kernel cache, made safe for several processes at once.

numba saves a newly compiled signature of a kernel by reading the kernel's index, taking
the first free data-file number, writing the index, then the data file, with no lock.
Two processes that compile different signatures of one kernel at the same moment take
the same number: the index then names one data file for both signatures, and a later
load hands out a kernel compiled for other types (numba fails with "can't unbox array
from PyObject into native value"). Two learners of different runs on a fresh install can
meet this, and the test suite's workers did.

Importing this module (every kernel module does) makes each save hold an exclusive lock
on a file beside the kernel's index, and each load a shared one, so that a save and
another save or load of the same kernel never interleave. A cache directory this process
cannot write to is read without a lock, as numba reads it.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from numba.core import caching

_FILE: Any = caching.IndexDataCacheFile
_SAVE = _FILE.save
_LOAD = _FILE.load


def _lock(index_path: str, mode: int) -> int | None:
    """An open lock file beside ``index_path``, locked (``mode``: ``fcntl.LOCK_EX`` or
    ``LOCK_SH``), or None where it cannot be created or locked."""
    try:
        fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, mode)
    except OSError:  # a file system without locks: numba's own, unlocked behaviour
        os.close(fd)
        return None
    return fd


def _locked_save(self: Any, key: Any, data: Any) -> None:
    fd = _lock(self._index_path, fcntl.LOCK_EX)
    try:
        _SAVE(self, key, data)
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def _locked_load(self: Any, key: Any) -> Any:
    fd = _lock(self._index_path, fcntl.LOCK_SH)
    try:
        return _LOAD(self, key)
    finally:
        if fd is not None:
            os.close(fd)


if not getattr(_FILE, "_shardreplay_locked", False):
    _FILE.save, _FILE.load = _locked_save, _locked_load
    _FILE._shardreplay_locked = True
