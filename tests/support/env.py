"""Environments for the processes tests start."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a child that forms a gloo group on loopback: ``GLOO_SOCKET_IFNAME=lo``
    and one OpenMP thread each (2 shared cores), then ``extra``."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra}


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block; every variable is restored after it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
