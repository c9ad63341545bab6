"""Kernel modules imported on first use, so that numba loads only when compiled code runs
(docs/internals.md, "Numpy twins and lazy kernels")."""

from __future__ import annotations

import importlib
import threading
from typing import Any

__all__ = ["LazyKernels", "lazy"]

_LOCK = threading.Lock()


class LazyKernels:
    """A stand-in for a kernel module that imports it on the first attribute read."""

    def __init__(self, name: str) -> None:
        self._lazy_name = name

    def __getattr__(self, attr: str) -> Any:
        """The module's attribute ``attr`` (importing the module the first time).

        Raises:
            AttributeError: the module has no attribute ``attr``.
        """
        if attr.startswith("__"):  # copy, pickle and inspect probe dunders: never import for them
            raise AttributeError(attr)
        value = getattr(importlib.import_module(self._lazy_name), attr)
        with _LOCK:  # threads may race here; they store the same object
            setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy kernels {self._lazy_name}>"


def lazy(name: str) -> Any:
    """A :class:`LazyKernels` for the kernel module ``name`` (typed ``Any``: callers type it
    by a ``TYPE_CHECKING`` import of the module itself)."""
    return LazyKernels(name)
