"""What a fresh process pays before its first write: ``import torch``, then ``import
shardreplay`` and ``from shardreplay import ReplayBuffer`` on top of it, then the first
``ReplayBuffer.add`` (compiled kernels loaded from numba's cache on first use) and the
second one (the steady path), each in a fresh interpreter.

Issue 20's targets: the import <= 0.3 s beyond ``import torch``, the first write <= 0.1 s.
Every figure is the median over ``--reps`` fresh processes run one after another (the
machine's load moves them: compare runs made on the same machine at the same load). One
JSON line; a benchmark, never a timed assertion in the tests.

Usage::

    python benchmarks/startup/bench_startup.py               # 5 fresh processes
    python benchmarks/startup/bench_startup.py --reps 9 --out .bench/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import emit_line

# Run in each fresh interpreter: one line of seconds per phase.
CHILD = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import shardreplay
from shardreplay import ReplayBuffer
t2 = time.perf_counter()
import numpy as np
buf = ReplayBuffer(shardreplay.Spec({"obs": shardreplay.Field((4,), np.float32)}), num_streams=2,
                   stream_capacity=100)
step = {"obs": np.zeros((2, 4), np.float32), "step_type": np.zeros(2, np.uint8),
        "discount": np.ones(2, np.float32)}
t3 = time.perf_counter()
buf.add(step)
t4 = time.perf_counter()
buf.add(step)
t5 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "import_s": t2 - t1, "first_add_s": t4 - t3,
                  "second_add_s": t5 - t4}))
"""
PHASES = ("torch_s", "import_s", "first_add_s", "second_add_s")


def one_process() -> dict[str, float]:
    """The phases of one fresh interpreter (this one's ``sys.path`` is its PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="fresh processes (median of each phase)")
    p.add_argument("--out", type=Path, help="also write the JSON line to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = [one_process() for _ in range(args.reps)]
    line: dict[str, Any] = {"bench": "startup", "reps": args.reps, "python": platform.python_version(),
                            "loadavg_1m": round(os.getloadavg()[0], 2)}
    for phase in PHASES:
        line[phase] = round(statistics.median(r[phase] for r in runs), 4)
    line["targets"] = {"import_s": 0.3, "first_add_s": 0.1}
    emit_line(line, args.out)


if __name__ == "__main__":
    main()
