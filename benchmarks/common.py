"""What every benchmark shares: the usual options, timed blocks, medians, the machine facts
and the one JSON line each prints (and writes to ``--out``).

A script in ``benchmarks/<area>/`` imports its own area's helpers by bare name (Python puts
the script's folder on ``sys.path``) and this module after one line::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
    import common

Figures keep each script's own key names (tests and RESULTS files read them); the helpers
here only compute them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent


def use(*areas: str) -> None:
    """Put ``benchmarks/<area>`` on ``sys.path`` for each area, so a script can import another
    area's helpers by bare name (``use("net")`` then ``import netns``)."""
    for area in areas:
        path = str(BENCHMARKS / area)
        if path not in sys.path:
            sys.path.insert(0, path)


def load_module(name: str, path: str) -> Any:
    """Import the file ``path`` as module ``name`` (an older copy of a package module, for
    a before/after in one process). It is registered in ``sys.modules``: numba's cache
    imports a cached kernel's module by name. Raises what the import raises."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------- arguments

def parser(doc: str | None, *, quick: str | None = None, reps: int | None = None,
           reps_flag: str = "--reps", reps_help: str | None = None,
           out: bool = True) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` described by the first paragraph of ``doc`` with the options the
    benchmarks share: ``--quick`` (when ``quick`` gives its help), ``reps_flag`` (``--reps`` or
    ``--repeat``, when ``reps`` gives its default) and ``--out``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if reps is not None:
        p.add_argument(reps_flag, type=int, default=reps, help=reps_help or "repetitions, median reported")
    if out:
        p.add_argument("--out", type=Path, help="also write the JSON line to this file")
    return p


# ---------------------------------------------------------------------------- timed blocks

@dataclass
class Timed:
    """Wall and CPU seconds of one block (filled in when the block ends)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0


@contextmanager
def timed(cpu: str = "process") -> Iterator[Timed]:
    """Time the ``with`` block: wall time (``perf_counter``) and CPU time of the process
    (``cpu="process"``) or of this thread only (``cpu="thread"``)."""
    cpu_clock = time.thread_time if cpu == "thread" else time.process_time
    got = Timed()
    wall0, cpu0 = time.perf_counter(), cpu_clock()
    try:
        yield got
    finally:
        got.wall_s, got.cpu_s = time.perf_counter() - wall0, cpu_clock() - cpu0


def median(values: Iterable[float], ndigits: int | None = None) -> float:
    """The median of ``values`` (rounded to ``ndigits`` when given); raises
    ``statistics.StatisticsError`` when there are none."""
    mid = statistics.median(values)
    return mid if ndigits is None else round(mid, ndigits)


# --------------------------------------------------------------------------- machine facts

def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 2 digits (other work skews rates)."""
    return [round(x, 2) for x in os.getloadavg()]


def cpus() -> int | None:
    """The logical cores this process may run on (its affinity: ``taskset -c 0,1`` on a
    larger machine reports 2), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def python() -> str:
    """This interpreter's version, e.g. ``3.11.9``."""
    return platform.python_version()


def now() -> str:
    """Local time as ``YYYY-MM-DDTHH:MM:SS``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def commit() -> str | None:
    """The short commit of the checkout the measured ``shardreplay`` is imported from (a
    ``PYTHONPATH`` may name another tree than these scripts'), or None outside a git checkout."""
    found = importlib.util.find_spec("shardreplay")
    where = Path(found.origin).parent if found is not None and found.origin else BENCHMARKS
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=where, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def free_port() -> int:
    """A TCP port free on loopback now (for a gloo group or a redis-server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the JSON line

def emit_line(line: dict[str, Any], out: Path | None) -> None:
    """Print ``line`` as one JSON line and, when ``out`` is given, write it there too."""
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
