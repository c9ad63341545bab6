"""Allocation of stream arrays in RAM or in memory-mapped files."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import platform
import sys
from pathlib import Path

import numpy as np

from shardreplay.errors import ConfigError

STORAGE_KINDS = ("memory", "memmap")
# mmap's flag (Python >= 3.13 names it): a mapping not counted against the commit limit.
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux"
                     and platform.machine() in ("x86_64", "aarch64") else 0)
_HUGE_BYTES = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_COLLAPSE = 14, 15, 25  # Linux (MADV_COLLAPSE: >= 6.1)


class ArrayAllocator:
    """Makes zero-filled arrays, in RAM (``"memory"``) or as files in ``directory``.

    Memory-mapped arrays are files ``<directory>/<name>.bin``; they are created anew
    (a buffer's content is restored through checkpoints, not by reopening these files).

    Raises:
        ConfigError: an unknown kind, or ``"memmap"`` without a usable directory.
    """

    def __init__(self, kind: str = "memory", directory: str | Path | None = None) -> None:
        if kind not in STORAGE_KINDS:
            raise ConfigError(f"storage must be one of {STORAGE_KINDS}, got {kind!r}")
        if kind == "memmap":
            if directory is None:
                raise ConfigError('storage="memmap" needs directory=<path for the array files>')
            directory = Path(directory)
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot create storage directory {directory}: {exc}") from exc
        self.kind = kind
        self.directory = None if directory is None else Path(directory)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zero-filled array of ``shape`` and ``dtype`` named ``name``, untouched: its
        pages come in as written (construction costs no time at any capacity)."""
        if self.kind == "memory" or self.directory is None or not math.prod(shape):
            return np.zeros(shape, dtype)
        return np.memmap(self.directory / f"{name}.bin", dtype=dtype, mode="w+", shape=shape)

    def reserve(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """As :meth:`zeros`, for an array of which only a part is ever written (frame
        rings sized for the worst case): in RAM, address space only (it may exceed RAM and
        swap, which ``np.zeros`` refuses), on 4 KiB pages (a huge page's fault zeroes 2 MiB
        inside one write: the longest adds of a pixel buffer).

        Raises:
            ConfigError: the system refuses the reservation (``vm.overcommit_memory=2``).
        """
        size = math.prod(shape) * dtype.itemsize
        if self.kind == "memmap" or os.name != "posix" or not size:
            return self.zeros(name, shape, dtype)
        try:
            area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        except OSError as exc:
            raise ConfigError(f"cannot reserve {size / 2**30:.1f} GiB of address space for {name}: "
                              f'{exc}; allow overcommit (vm.overcommit_memory 0 or 1) or use storage="memmap"'
                              ) from exc
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            area.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(area, dtype).reshape(shape)


def advise_hugepages(arr: np.ndarray, *advice: int) -> None:
    """``madvise`` the whole 2 MiB pages of a C-contiguous array (each ``advice`` in turn;
    default ``MADV_HUGEPAGE``): ``MADV_HUGEPAGE`` before a loader fills every byte
    (``np.zeros`` memory lacks the hint numpy gives ``np.empty``, so each 4 KiB page would
    fault on its own), ``MADV_COLLAPSE`` to regroup the pages a fork split (docs/semantics.md,
    "Background saves"). A no-op where refused or unsupported."""
    start = -(-arr.ctypes.data // _HUGE_BYTES) * _HUGE_BYTES
    end = (arr.ctypes.data + arr.nbytes) // _HUGE_BYTES * _HUGE_BYTES
    if end > start and arr.flags.c_contiguous and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            for one in advice or (MADV_HUGEPAGE,):
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), one)
