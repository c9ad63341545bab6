"""Warm numba's on-disk cache once, before pytest-xdist starts its workers.

Every kernel is compiled with ``cache=True`` into ``src/shardreplay/kernels/__pycache__``
(or ``NUMBA_CACHE_DIR``), which all processes share. On a fresh checkout the cache is
empty, and each xdist worker would compile the same kernels at the same time on the same
cores; compiled once here, every worker (and every process a test starts) loads them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np


def cache_is_cold() -> bool:
    """No index file in the kernels' ``__pycache__`` (a fresh checkout), or a cache directory
    of numba's own (``NUMBA_CACHE_DIR``) that this cannot read cheaply: warm it."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return True
    spec = importlib.util.find_spec("shardreplay.kernels")  # the package only: no numba import
    if spec is None or spec.origin is None:
        return True
    return not any((Path(spec.origin).parent / "__pycache__").glob("*.nbi"))


def warm_kernel_cache() -> None:
    """Write, sample and update a small buffer of each sampler: the kernels of the write,
    validation, sampling and priority paths are compiled (or loaded) and cached."""
    import shardreplay as sr

    spec = sr.Spec({"obs": sr.Field((4,), np.float32)})
    types = np.array([0, 1, 1, 1, 2], np.uint8)  # FIRST, MID, MID, MID, LAST
    for sampler in ("uniform", "prioritized", "fifo"):
        buf = sr.ReplayBuffer(spec, num_streams=2, stream_capacity=64, sampler=sampler, window=2)
        for t in range(20):
            buf.add({"obs": np.zeros((2, 4), np.float32), "step_type": np.full(2, types[t % 5]),
                     "discount": np.ones(2, np.float32)})
        batch = buf.sample(8)
        if sampler == "prioritized":
            buf.update_priorities(batch.keys, np.ones(8, np.float32))
