"""CPU-seconds per test (``SHARDREPLAY_CPU_LOG=path``): what 2 cores limit, unlike wall time.

Each test's setup, call and teardown are timed as user+sys of the pytest process plus its
reaped descendants (``RUSAGE_CHILDREN``: a launch's launcher, learners and actors once
waited for; a process killed after its parent died is reaped by init and not counted).
One JSON line per test is appended to the file named by ``SHARDREPLAY_CPU_LOG`` (under
pytest-xdist every worker appends to it); tests/conftest.py loads this hook only then.
``python -m tests.support.cpu_time FILE`` prints the lines as a table, heaviest first.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Generator

import pytest

LOG_ENV = "SHARDREPLAY_CPU_LOG"


def _cpu_s() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Append ``{"test", "cpu_s", "wall_s", "start", "worker"}`` for ``item`` to the log
    file (``start``: Unix time; with ``wall_s`` it places the test on the run's timeline)."""
    cpu, wall, start = _cpu_s(), time.monotonic(), time.time()
    yield
    line = {"test": item.nodeid, "cpu_s": round(_cpu_s() - cpu, 2),
            "wall_s": round(time.monotonic() - wall, 2), "start": round(start, 2),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(json.dumps(line) + "\n")


def main(path: str) -> None:
    """Print the log's tests, heaviest CPU first, and the totals."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: -r["cpu_s"])
    for r in rows:
        print(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}")
    cpu, wall = sum(r["cpu_s"] for r in rows), sum(r["wall_s"] for r in rows)
    print(f"{cpu:8.1f} {wall:8.1f}  total ({len(rows)} tests)")


if __name__ == "__main__":
    main(sys.argv[1])
