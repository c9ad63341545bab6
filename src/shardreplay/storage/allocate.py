"""Allocation of stream arrays in RAM or in memory-mapped files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardreplay.errors import ConfigError

STORAGE_KINDS = ("memory", "memmap")


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
        """A zero-filled array of ``shape`` and ``dtype`` named ``name``.

        Nothing is touched here: large arrays come as the kernel's untouched zero pages
        (as SB3's ``np.zeros``), so construction costs no time at any capacity and the
        resident memory follows the steps written (a page is faulted in when first written).
        """
        if self.kind == "memory" or self.directory is None:
            return np.zeros(shape, dtype)
        path = self.directory / f"{name}.bin"
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="w+", shape=shape)
