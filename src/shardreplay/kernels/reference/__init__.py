"""Plain-numpy twins of the write and check kernels, which a process runs before numba
loads (docs/internals.md, "Numpy twins and lazy kernels")."""

from __future__ import annotations

import sys

__all__ = ["NUMPY_WRITES", "numpy_first"]

# Writes of a process served by numpy before the compiled kernels load: enough for a
# script's or an actor's first steps, few enough that a long run soon runs compiled.
NUMPY_WRITES = 64
_writes_left = NUMPY_WRITES


def numpy_first(spend: bool = False) -> bool:
    """Whether the numpy twins serve this call: numba is not imported yet and fewer than
    :data:`NUMPY_WRITES` writes were served. ``spend`` (a write, not a check) counts the
    call. Threads may race on the count: either answer gives the same results."""
    global _writes_left
    if _writes_left <= 0 or "numba" in sys.modules:
        return False
    if spend:
        _writes_left -= 1
    return True
