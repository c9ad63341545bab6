"""One compute thread per actor: torch's (where its policy loaded torch) and numpy's BLAS.

An actor acts on a few observations at a time, and a machine runs many actors: a second
thread only contends with the other actors. numpy's BLAS (OpenBLAS in numpy's wheels)
starts one thread per core when it loads (before the actor's code runs: the actor's
modules import numpy) and, on a busy machine, its threads spin: a matrix product of a
policy's size costs many times the CPU of one thread's (benchmarks/startup/RESULTS-actor.md).
``OPENBLAS_NUM_THREADS`` is read only when the library loads, so the running library is
limited through threadpoolctl (OpenBLAS, MKL or BLIS alike).
"""

from __future__ import annotations

import sys

__all__ = ["blas_threads", "one_compute_thread"]


def blas_threads() -> int | None:
    """The most threads any BLAS loaded in this process uses, or None where none is loaded."""
    from threadpoolctl import threadpool_info

    counts = [int(pool["num_threads"]) for pool in threadpool_info() if pool.get("user_api") == "blas"]
    return max(counts) if counts else None


def one_compute_thread() -> None:
    """Run this process's numpy BLAS calls, and torch's where torch is loaded, on one
    thread (process-wide: call it in a process that runs an actor)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # called, not entered: the limit stays
