"""Before/after of ``GymStepWriter.step``, in one process: the current
``kernels/gym_step.py`` against an older copy of it (a file given on the command line,
e.g. from ``git show``).

Builds two writers per field kind (vector: 4 envs of 4 float32; pixel: 2 envs of 4x84x84
uint8), one on each kernel, and times their steps in alternating blocks (CPU time of this
thread), so that load from other work hits both alike. Prints one JSON line: per kind, the
median microseconds per step of each, and the median and range of new / old over blocks.

    git show HEAD~1:src/shardreplay/kernels/gym_step.py > /tmp/old_gym_step.py
    PYTHONPATH=src python benchmarks/replay/ab_gym_step.py /tmp/old_gym_step.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common

KINDS = {"vector": (4, (4,), np.float32), "pixel": (2, (4, 84, 84), np.uint8)}


def _writer_step(kind: str, kernel: ModuleType) -> Callable[[], None]:
    """A writer built on ``kernel`` (the module's entry points patched into gym/writer.py
    while it is built; a writer keeps the dispatcher it was built with) and its step."""
    import shardreplay as sr
    from shardreplay.gym import writer as w

    envs, shape, dtype = KINDS[kind]
    spec = sr.Spec({"obs": sr.Field(shape, dtype), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})
    buf = sr.ReplayBuffer(spec, num_streams=envs, stream_capacity=4096, window=2, seed=0)
    saved = w.compiled_gym_write, w.allow_inputs
    w.compiled_gym_write, w.allow_inputs = kernel.compiled_gym_write, kernel.allow_inputs
    try:
        writer = w.GymStepWriter(buf, autoreset_mode="next_step")
    finally:
        w.compiled_gym_write, w.allow_inputs = saved
    obs = np.ones((envs, *shape), dtype)
    writer.reset(obs)
    action, reward = np.zeros(envs, np.int64), np.ones(envs, np.float32)
    no = np.zeros(envs, np.bool_)

    def step() -> None:
        writer.step(action, obs, reward, no, no, {})
    return step


def main(old_gym_step: str, rounds: int = 15, calls: int = 2000) -> dict[str, Any]:
    """Time both writers per kind (see the module docstring)."""
    from shardreplay.kernels import gym_step as new

    old = common.load_module("old_gym_step", old_gym_step)
    out: dict[str, Any] = {}
    for kind in KINDS:
        steps = {"old": _writer_step(kind, old), "new": _writer_step(kind, new)}
        for f in steps.values():
            for _ in range(50):
                f()
        times: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(rounds):
            for name in (("old", "new") if r % 2 else ("new", "old")):
                start = time.thread_time()
                for _ in range(calls):
                    steps[name]()
                times[name].append((time.thread_time() - start) / calls * 1e6)
        ratios = [b / a for a, b in zip(times["old"], times["new"], strict=True)]
        out[kind] = {**{k: round(statistics.median(v), 2) for k, v in times.items()},
                     "new_vs_old": {"median": round(statistics.median(ratios), 3),
                                    "min": round(min(ratios), 3), "max": round(max(ratios), 3)}}
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(json.dumps(main(sys.argv[1])))
