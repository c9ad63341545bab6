"""numba's on-disk kernel cache, made safe for several processes at once: saves and loads
lock the kernel's index, one process compiles a signature while the others wait for it
(docs/internals.md, "The kernel cache across processes")."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import time
from typing import Any

from numba.core import caching, sigutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.cpu import CPUTargetOptions
from numba.core.dispatcher import Dispatcher

_FILE: Any = caching.IndexDataCacheFile
_LOCATOR: Any = caching._SourceFileBackedLocatorMixin
_STAMP = _LOCATOR.get_source_stamp
_SAVE = _FILE.save
_LOAD = _FILE.load
_COMPILE = Dispatcher.compile
_compiling: set[str] = set()  # the compile locks this process holds (flock is per open file)
COMPILE_WAIT_S = 300.0  # the longest a process waits for another's compile of a signature
_POLL_S = 0.05
# The njit options of a cached kernel shaped for a small batch, where numba's dispatch is
# much of the cost: compiled without numba's reference counting where numba has that option.
SMALL_CALL: dict[str, Any] = {"cache": True, "nogil": True,
                              **({"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {})}


def _lock(index_path: str, mode: int, suffix: str = ".lock", wait_s: float | None = None) -> int | None:
    """An open lock file ``index_path + suffix``, locked (``mode``: ``fcntl.LOCK_EX`` or
    ``LOCK_SH``), or None where it cannot be created or locked, or (``wait_s``) is still
    held by another after that long."""
    try:
        fd = os.open(index_path + suffix, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode if deadline is None else mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if deadline is not None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                continue
            os.close(fd)
            return None
        except OSError:  # a file system without locks: numba's own, unlocked behaviour
            os.close(fd)
            return None


def modules_stamp(directory: str) -> tuple[tuple[str, int, int], ...]:
    """Name, mtime (ns) and size of every module of ``directory``. Raises OSError."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    stats = [os.stat(os.path.join(directory, n)) for n in names]
    return tuple((n, s.st_mtime_ns, s.st_size) for n, s in zip(names, stats, strict=True))


_KERNELS = os.path.dirname(os.path.abspath(__file__))
_kernels_stamp = functools.cache(lambda: modules_stamp(_KERNELS))


def _package_stamp(self: Any) -> Any:
    """numba's stamp of a kernel's file; for a kernel of this package with the stamp of
    every kernel module beside it (code inlined from another file is not in numba's)."""
    stamp = _STAMP(self)
    if os.path.dirname(os.path.abspath(self._py_file)) == _KERNELS:
        return (stamp, _kernels_stamp())
    return stamp


def _locked(call: Any, mode: int) -> Any:
    """numba's cache ``call`` (its save or load), holding a ``mode`` lock beside the index."""
    def locked(self: Any, *args: Any) -> Any:
        fd = _lock(self._index_path, mode)
        try:
            return call(self, *args)
        finally:
            if fd is not None:
                os.close(fd)  # closing releases the lock

    return locked


def _locked_compile(self: Any, sig: Any) -> Any:
    """``Dispatcher.compile`` of a cached kernel, holding the lock of ``sig`` across the
    cache lookup, the compile and the save, unless this dispatcher holds ``sig`` already.

    The process's compiler lock is taken first, as numba's own compile takes it: one
    thread of a process at a time then waits for a file lock, and a kernel's compile
    waits only for the kernels it calls (a call graph has no cycles), so no wait closes
    a loop."""
    index = getattr(getattr(self._cache, "_cache_file", None), "_index_path", None)
    args, _ = sigutils.normalize_signature(sig)
    if index is None or tuple(args) in self.overloads:
        return _COMPILE(self, sig)
    suffix = "." + hashlib.sha1(str(tuple(args)).encode()).hexdigest()[:16] + ".compiling"
    key = index + suffix
    with global_compiler_lock:
        if key in _compiling:  # compiling it already, further up this stack
            return _COMPILE(self, sig)
        fd = _lock(index, fcntl.LOCK_EX, suffix, COMPILE_WAIT_S)
        _compiling.add(key)
        try:
            return _COMPILE(self, sig)
        finally:
            _compiling.discard(key)
            if fd is not None:
                os.close(fd)


if not getattr(_FILE, "_shardreplay_locked", False):
    _FILE.save, _FILE.load = _locked(_SAVE, fcntl.LOCK_EX), _locked(_LOAD, fcntl.LOCK_SH)
    _LOCATOR.get_source_stamp = _package_stamp
    _FILE._shardreplay_locked = True
    Dispatcher.compile = _locked_compile  # type: ignore[method-assign]
