"""Environments for the processes tests start."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def quick_bench(bench: Path, out: Path, timeout_s: float = 280) -> dict[str, Any]:
    """Run ``bench --quick --out out``; assert it exits 0 and that its last stdout line is
    the JSON it also wrote to ``out``; return that line."""
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    return line
