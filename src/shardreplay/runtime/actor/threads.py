"""One compute thread per actor: torch's (where its policy loaded torch) and numpy's OpenBLAS.

An actor acts on a few observations at a time, and a machine runs many actors: a second
thread only contends with the other actors. numpy's OpenBLAS starts one thread per core
when it loads (before the actor's code runs: the actor's modules import numpy) and, on a
busy machine, its threads spin: a matrix product of a policy's size costs many times the
CPU of one thread's (benchmarks/startup/RESULTS-actor.md). ``OPENBLAS_NUM_THREADS`` is read
only when the library loads, so the running library is asked directly (its
``*openblas_set_num_threads*`` function, found among the process's mapped libraries on
Linux); a numpy built on another BLAS is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["one_compute_thread", "openblas_threads"]

# The thread functions of OpenBLAS builds: numpy's wheels (scipy-openblas, 64-bit ints,
# prefixed symbols), then a plain OpenBLAS (a distribution's numpy).
_SET = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
        "openblas_set_num_threads")
_GET = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
        "openblas_get_num_threads")


def _openblas_libraries() -> Iterator[Any]:
    """The OpenBLAS libraries mapped into this process (none off Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split(maxsplit=5)[-1].strip() for line in maps
                            if "openblas" in line.rsplit("/", 1)[-1]})
    except OSError:
        return
    for path in paths:
        with contextlib.suppress(OSError):
            yield ctypes.CDLL(path)  # already loaded: this only looks its symbols up


def _first(lib: Any, names: tuple[str, ...]) -> Any:
    return next((f for f in (getattr(lib, name, None) for name in names) if f is not None), None)


def openblas_threads() -> int | None:
    """The threads of the OpenBLAS numpy uses, or None where none is found."""
    for lib in _openblas_libraries():
        getter = _first(lib, _GET)
        if getter is not None:
            return int(getter())
    return None


def one_compute_thread() -> None:
    """Run this process's numpy BLAS calls, and torch's where torch is loaded, on one
    thread (process-wide: call it in a process that runs an actor)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    for lib in _openblas_libraries():
        setter = _first(lib, _SET)
        if setter is not None:
            setter(1)
