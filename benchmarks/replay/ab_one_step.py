"""Before/after of ``ReplayBuffer.add`` of one step, in one process, against SB3 (issue 24).

Loads an older ``storage/one_step.py`` and ``kernels/add_step.py`` (files given on the
command line, e.g. from ``git show``) beside the current ones, builds three buffers per
field kind (old short path, new short path, SB3) and times their adds in rotating
blocks (CPU time of this thread), so that load from other work hits all three alike.
Prints JSON: per kind, the median and range over the blocks of each time ratio vs SB3.

    PYTHONPATH=src python benchmarks/replay/ab_one_step.py OLD_ONE_STEP.py OLD_ADD_STEP.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common
import replay_fill_sweep as F


def main(old_one_step: str, old_add_step: str, rounds: int = 11, calls: int = 300) -> dict[str, Any]:
    """Time the three adds per kind (see the module docstring)."""
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer as Sb3

    import shardreplay as sr

    old_kernel = common.load_module("old_add_step", old_add_step)
    old = common.load_module("old_one_step", old_one_step)
    old.kernel = old_kernel
    clock = time.thread_time
    out: dict[str, Any] = {"load_before": os.getloadavg()}
    for kind in ("vector", "float", "pixel"):
        pool = F._kind_pool(kind, np.random.default_rng(1))
        capacity = F.PIXEL_CAPACITY if kind == "pixel" else 1_000_000
        theirs = F._sb3_for(kind, Sb3, spaces, capacity)
        steps = {}
        for version in ("old", "new"):
            buf = sr.ReplayBuffer(F._kind_spec(sr, kind), num_streams=1, stream_capacity=capacity, seed=0)
            shard = buf._shard
            assert shard.use_one_step()
            if version == "old":
                shard._one_step = old.one_step_add(shard._storage, None, None)
            steps[version] = F._Steps(sr, kind, pool, buf, theirs, "add")
        runs = {"old": steps["old"].add_ours, "new": steps["new"].add_ours, "sb3": steps["old"].add_theirs}
        for f in runs.values():
            for _ in range(50):
                f()
        times: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        for r in range(rounds):
            for name in order[r % 3:] + order[:r % 3]:
                f = runs[name]
                start = clock()
                for _ in range(calls):
                    f()
                times[name].append((clock() - start) / calls * 1e6)
        row: dict[str, Any] = {k: round(statistics.median(v), 2) for k, v in times.items()}
        for version in ("old", "new"):
            ratios = [a / b for a, b in zip(times[version], times["sb3"], strict=True)]
            row[f"{version}_ratio"] = {"median": round(statistics.median(ratios), 3),
                                       "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
        out[kind] = row
        print(kind, json.dumps(row), flush=True)
    out["load_after"] = os.getloadavg()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
